"""prefill_pool."""
