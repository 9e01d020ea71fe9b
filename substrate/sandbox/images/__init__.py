"""Offline sandbox images: a Debian root filesystem and the images built from it.

The Debian root filesystem (`rootfs`, debootstrap from a local mirror, slimmed) and the
images built from it (`build`: base, sandbox, tiny). Never pulled from a registry."""

from substrate.sandbox.images.build import (
    BASE_TAG,
    SANDBOX_TAG,
    TINY_TAG,
    build_images,
    engine_client,
    image_present,
)

__all__ = [
    "BASE_TAG",
    "SANDBOX_TAG",
    "TINY_TAG",
    "build_images",
    "engine_client",
    "image_present",
]
