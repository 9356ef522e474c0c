"""decode_pool."""
