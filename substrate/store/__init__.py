"""substrate.store.db."""
