"""What runs an engine inside a worker process, below the roles that use it: the step loop and its inbox,
the output channels to the gateway, the load and info records the gateway reads, the Role enum, and the
process's own setup (threads, pinning, model files, heap). Imports no role and no actor."""
