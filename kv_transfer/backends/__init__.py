"""Transfer backends; import them through `kv_transfer.registry`, which imports each one lazily."""
