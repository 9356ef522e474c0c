"""What the request path records and the controller reads: Prometheus metrics and recent latencies."""
