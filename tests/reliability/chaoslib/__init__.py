"""The chaos benchmark's parts (tests/reliability/chaos.py and tests/gateway/test_chaos.py run them).

config        ChaosConfig (the run's settings) and ChaosTarget (the server under test: URL, its processes)
reference     the greedy prompts and their tokens from transformers' `generate`
connections   the run's HTTP client; with several frontends a fresh connection per request, its port noted
traffic       the request mix and one client per request, each checked as it ends (ChaosRecord)
driver        the faults: layout PUTs, auto on/off (also mid-move), SIGKILL of busy workers, a grace past the
              drain timeout; with several frontends also those of frontends, burst, fleet_faults
frontends     which frontend holds which connection (FrontendMap); kill_frontend, pause_frontend
burst         loop_burst: large distinct schemas and MiB-sized /tokenize at once
fleet_faults  kill_fleet (its /health and recovery timed), pause_fleet, pause_worker
watch         /admin/pools and /health every few hundred ms: workers stuck outside `active`, the gateway's RSS
departures    every worker that left /admin/pools and the fault that explains it (else a violation)
run           run_chaos(): traffic + driver + watch, then the end checks (layout, KV, health) → ChaosResult
report        summary.json, summary.md, requests.jsonl, events.jsonl under --out
"""
