"""What runs an engine inside a worker process, below the roles that use it: the one worker skeleton
(step_worker.py) with its step loop, inbox and offered KV, the output channels to the gateway, the load and
info records the gateway reads, the Role enum, and the process's own setup (threads, pinning, model files,
heap). Imports no role and no actor."""
