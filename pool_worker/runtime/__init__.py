"""What runs an engine inside a worker process: the step loop and its inbox, the output channels to the
gateway, load reports, and the process's own setup (threads, pinning, model files, heap)."""
