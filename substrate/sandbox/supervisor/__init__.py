"""Fast exec: substrate's own supervisor inside each sandbox (docs/fast-exec.md).

`agent` is the program that runs inside the container (standard library only; the
daemon imports its wire codec); `supervisors.Supervisors` prepares each sandbox's
supervisor directory, starts, checks, replaces and journals supervisors and spawns
commands through them; `link` is the daemon's side of one running supervisor; `checks`
reads a supervisor and each command's own process from the host and compares them with
the sandbox's confinement.
"""
