"""The sandbox: where a command runs and what proves it is confined.

Profiles (`profiles`, `seccomp`) declare everything a sandbox may get; `spec` turns one
into the engine's create request (pure); `containers` is `Containers`, the cache of one
verified `Sandbox` (`sandboxes`) per (workspace, profile), whose `ensure` is one
pipeline: resolve (secrets, who runs, image) → the environment (`environment`: secrets,
the persistent home) → require (`facts`; `labelled` removes our labelled containers this
run did not create) → create through an `engine` (the `Engine` Protocol; `docker_engine`
is the real one, the daemon's only module importing `docker`) → observe and verify
(`verification`: `observe`, with `observe_gvisor`, `netns`, `parsers`, read through a
`host` view; `facts.compare`) → journal. `mounts` decides what is read-only over the
workspace (a `workspace = "layer"` sandbox's overlay is `substrate.layer.mounts`, below
this package); `proxy_link` links an egress sandbox to the proxy; `reaper` and `cmd_cgroups`
find, signal and reap a command's host processes; `supervisor` is fast exec: each
sandbox's own supervisor, and the host's checks of it and of every command it starts
(docs/fast-exec.md). `fake_engine` is an in-memory engine and host for tests of logic.

`Containers` and `Sandbox` are not re-exported here: `substrate.schema` imports
`substrate.sandbox.facts` and `.profiles`, and `containers` imports the workspace gate,
which imports `substrate.schema.proc`; import them from `substrate.sandbox.containers`.
"""

from substrate.sandbox.engine import ContainerGone, Engine, EngineError, ExecStream
from substrate.sandbox.facts import Fact, FactValue, Mismatch, compare, required_facts
from substrate.sandbox.host import HostKernel, SandboxHost
from substrate.sandbox.profiles import Profile, ProfileError, find_profile, load_profiles
from substrate.sandbox.spec import RunAs, container_spec, run_as

__all__ = [
    "ContainerGone",
    "Engine",
    "EngineError",
    "ExecStream",
    "Fact",
    "FactValue",
    "HostKernel",
    "Mismatch",
    "Profile",
    "ProfileError",
    "RunAs",
    "SandboxHost",
    "compare",
    "container_spec",
    "find_profile",
    "load_profiles",
    "required_facts",
    "run_as",
]
