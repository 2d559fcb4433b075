"""A complete example of a user's own model and dataset for ``edge-coordinator train``."""
