"""substrate.protocol."""
