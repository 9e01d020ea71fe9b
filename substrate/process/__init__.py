"""substrate.process."""
