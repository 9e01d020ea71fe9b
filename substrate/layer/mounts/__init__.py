"""The working layer's host side: the overlay a sandbox sees as `/workspace`, one
generation after another (docs/working-layer.md, "The mounts on the host side").

Where things are: `plan` is the mount plan of one generation and its check against the
kernel's mount table (pure; `mountinfo` parses that table); `overlay` makes the mounts —
prepare, mount a generation, swap, tear down, sweep what a previous run left (ctypes
`mount(2)`, worker threads only); `passthrough` checks a profile's passthrough dirs and
finds those a generation binds, `passthrough_scan` looks at what a command left in them;
`working_layer` is one sandbox's `WorkingLayer` (its generation mounted now, its users,
the identity facts its container must show); `layer_mounts` is how
`substrate.sandbox.containers` reaches all of it: `LayerMounts`, through worker threads,
no layer before the start-up sweep.
"""

from substrate.layer.mounts.layer_mounts import LayerMounts
from substrate.layer.mounts.mountinfo import Mount, parse_mountinfo, visible_mounts
from substrate.layer.mounts.plan import PASSTHROUGH_OPTIONS, LayerPlan, layers_dir
from substrate.layer.mounts.working_layer import WorkingLayer

__all__ = [
    "PASSTHROUGH_OPTIONS",
    "LayerMounts",
    "LayerPlan",
    "Mount",
    "WorkingLayer",
    "layers_dir",
    "parse_mountinfo",
    "visible_mounts",
]
