"""The working layer (docs/working-layer.md): a `workspace = "layer"` sandbox writes into
an overlay whose lower layer is the checkout; when its commands end, what they changed
becomes a change set applied through the guarded write path.

Where things are: `mounts` is the host side (the overlay's plan, mounts and generations,
passthrough dirs, one sandbox's `WorkingLayer`); `generation` counts who uses the
generation mounted now and says when it concludes (pure).
"""
