"""substrate.sandbox.images."""
