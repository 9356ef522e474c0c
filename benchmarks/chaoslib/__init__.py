"""The chaos benchmark's parts (benchmarks/chaos.py and tests/gateway/test_chaos.py run them).

config     ChaosConfig (the run's settings) and ChaosTarget (the server under test: URL, its processes)
reference  the greedy prompts and their tokens from transformers' `generate`
traffic    the request mix and one client per request, each checked as it ends (ChaosRecord)
driver     the faults: layout PUTs, auto on/off (also mid-move), SIGKILL of busy workers, a grace past the
           drain timeout
watch      /admin/pools and /health every few hundred ms: workers stuck outside `active`, the gateway's RSS
run        run_chaos(): traffic + driver + watch, then the end checks (layout, KV, health) → ChaosResult
report     summary.json, summary.md, requests.jsonl, events.jsonl under --out
"""
