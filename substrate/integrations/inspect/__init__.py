"""The Inspect AI sandbox provider: sandbox type `substrate` (docs/integrations.md).

Importing this package registers the provider with Inspect (its entry point
`[project.entry-points.inspect_ai]` names this package, so `sandbox="substrate"` finds it).

- `config.py`: `SubstrateSandboxConfig`, what a task may configure (profile, checkout, files).
- `commands.py`: Inspect's exec and file calls as argv, and their outcomes as exceptions.
- `calls.py`: the blocking calls to the daemon, each on its own connection.
- `sandbox.py`: `SubstrateSandboxEnvironment`, the sample lifecycle and the provider.
"""

from substrate.integrations.inspect.config import SubstrateSandboxConfig
from substrate.integrations.inspect.sandbox import SubstrateSandboxEnvironment

__all__ = ["SubstrateSandboxConfig", "SubstrateSandboxEnvironment"]
