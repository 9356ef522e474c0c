"""`pdserve tune`: profile a worker, simulate this system's policies for every layout, recommend, apply,
validate. Modules: measure/transfer_probe (profile) → fits/profile (profile.json) → simulator/sim_workers →
metrics/planner/table/plots (plan.json) → apply (PUT /admin/pools) → validate (bench vs prediction); cli."""
