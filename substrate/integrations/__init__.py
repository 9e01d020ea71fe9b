"""Integrations: substrate as a component of other tools, through its own client.

- `inspect/`: an [Inspect AI](https://inspect.aisi.org.uk) sandbox environment provider,
  sandbox type `substrate` (docs/integrations.md).
"""
