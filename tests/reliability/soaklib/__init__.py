"""The soak benchmark's parts (tests/reliability/soak.py runs them in order).

config   SoakConfig, the run's settings
cluster  the Ray head and `pdserve serve` processes it starts and stops, worker pids, the model it serves
traffic  the request mix (endpoints, streaming, cancellations) and sending it, one SoakRecord per request
sampling /health, /admin/pools, per-process RSS and /metrics, and the end-of-run KV settle
kills    SIGKILL of one worker every --kill-every s, and timing its replacement
report   summary.json, summary.md, soak.png and the other files under --out
"""
