"""The worker process every pool runs: one Ray actor (`actor.WorkerActor`), one model, one KV cache, in one
of three roles. This package is the top of the worker side: actor → the roles (prefill_pool/, decode_pool/)
→ worker_runtime/ (step loop, inbox, output channels, load and info records, the Role enum) → kv_transfer /
llm_engine."""
