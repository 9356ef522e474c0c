"""A Grafana dashboard's queries evaluated by a real Prometheus (promtool, from Debian's `prometheus` package)
over scrapes of pdserve's /metrics, through the recording rules of deploy/prometheus/.

`promtool test rules` loads the rules, replays the scrapes as input series (as a Prometheus scraping the
gateway every SCRAPE_S would have stored them, with the `job` and `instance` it adds) and evaluates each query
at the end: a query "returns data" when it gives at least one series with a value that is a number (not NaN:
a quantile or a mean over no requests). Grafana's own variables are replaced as Grafana would, nothing else.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "vllm-names.rules.yaml"
VLLM_DASHBOARD = ROOT / "tests" / "fixtures" / "vllm_grafana" / "grafana.json"
# On the PATH, or where the Makefile unpacks it (beside the venv's python).
PROMTOOL = shutil.which("promtool") or shutil.which("promtool", path=str(Path(sys.executable).parent))
NO_PROMTOOL = ("promtool is not installed (Debian/Ubuntu: apt-get install prometheus; `make test` unpacks it "
               "into .venv/bin where apt-get can download the package)")
SCRAPE_S = 15
SAMPLES_PER_SCRAPE = 4  # each scrape's values held for a minute, so that rate() spans two scrapes
RATE_INTERVAL = "5m"  # Grafana's $__rate_interval: here, the whole replay
JOB, INSTANCE = "pdserve", "pdserve-gateway:8000"


@dataclass(frozen=True)
class PanelQuery:
    panel: str  # the panel's title
    ref_id: str  # the target's refId
    expr: str  # as the dashboard has it


def panel_queries(dashboard: Path) -> list[PanelQuery]:
    """Every query of every panel (rows' nested panels included), hidden ones too."""
    board = json.loads(dashboard.read_text())
    panels = [p for top in board["panels"] for p in [top, *top.get("panels", [])]]
    return [PanelQuery(p["title"], t.get("refId", ""), t["expr"])
            for p in panels for t in p.get("targets", []) if t.get("expr")]


def grafana_expr(expr: str, variables: dict[str, str]) -> str:
    """`expr` with Grafana's variables replaced ($name, ${name}, [[name]], and its built-in intervals)."""
    values = {"__rate_interval": RATE_INTERVAL, "__interval": "1m", "__range": RATE_INTERVAL, **variables}

    def value(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        assert name in values, f"no value for Grafana's variable {name} in {expr!r}"
        return values[name]

    replaced = re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", value, expr)
    assert "$" not in replaced, replaced
    return replaced


def _series_name(name: str, labels: dict[str, str]) -> str:
    def quoted(value: str) -> str:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    return name + "{" + ",".join(f"{k}={quoted(v)}" for k, v in sorted(labels.items())) + "}"


def _value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    return repr(value)


def input_series(scrapes: list[str]) -> list[dict[str, str]]:
    """The scrapes (exposition texts, oldest first) as promtool's input series: a series absent from a scrape
    is `_` (no sample) there."""
    seen: dict[str, list[float | None]] = {}
    for index, text in enumerate(scrapes):
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = _series_name(sample.name, {**sample.labels, "job": JOB, "instance": INSTANCE})
                seen.setdefault(key, [None] * len(scrapes))[index] = sample.value
    return [{"series": key, "values": " ".join(
        ("_" if v is None else _value(v)) for v in values for _ in range(SAMPLES_PER_SCRAPE))}
        for key, values in seen.items()]


def returns_data(expr: str) -> str:
    """A query that is `{} 1` when `expr` gives at least one series with a number, nothing otherwise."""
    return f"count(({expr}) == ({expr})) > bool 0"


def failing_queries(scrapes: list[str], exprs: list[str], workdir: Path, rules: Path = RULES) -> list[str]:
    """The expressions (of `exprs`) that return no data over `scrapes` through `rules`, evaluated by promtool
    (one run: it names every failing expression)."""
    assert PROMTOOL is not None, NO_PROMTOOL
    eval_s = SCRAPE_S * SAMPLES_PER_SCRAPE * len(scrapes)  # just past the last sample
    checks = {returns_data(expr): expr for expr in exprs}
    test = {"rule_files": [str(rules)], "evaluation_interval": f"{SCRAPE_S}s",
            "tests": [{"interval": f"{SCRAPE_S}s", "input_series": input_series(scrapes),
                       "promql_expr_test": [{"expr": check, "eval_time": f"{eval_s}s",
                                             "exp_samples": [{"labels": "{}", "value": 1}]}
                                            for check in checks]}]}
    path = Path(tempfile.mkdtemp(prefix="promtool-", dir=workdir)) / "dashboard.test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False, width=1000))
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True,
                            timeout=300)
    output = result.stdout + result.stderr
    if result.returncode == 0:
        return []
    # A failure reads `expr: "<the check, Go-quoted>", time: …` then `got: …`; anything else is no run.
    failed = [json.loads(quoted) for quoted in re.findall(r'^\s*expr: (".*"), time: ', output, re.MULTILINE)]
    if not failed or "got:" not in output or any(check not in checks for check in failed):
        raise AssertionError(f"promtool did not run the test: {output}")
    return [checks[check] for check in failed]
