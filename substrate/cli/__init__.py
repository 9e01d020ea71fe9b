"""The `substrate` command line: the daemon (`serve`), a client for people at a shell,
`doctor`, image builds. `main` parses and dispatches; `exec` holds the commands that run
things (exec, grant, attach, image build); `common` the connection and workspace helpers.

The console script is `substrate.cli.main:main`; nothing is re-exported here, so
`substrate.cli.main` always names the module.
"""
