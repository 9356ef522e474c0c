"""LayoutPlanner: which layout of the fleet's N workers the recent traffic would be served best by, predicted
with the tuner's simulator (tuner/simulator.py: this system's policies, priced by a worker's fitted step
times from `pdserve tune profile`).

    predict(recent arrivals): the window's requests (their arrival times, prompt and output lengths) replayed
      on every candidate layout → each one's predicted goodput, SLO attainment, TTFT p90 and ITL p99 →
      the best (most goodput, then attainment, then lower TTFT p90: tune plan's ranking)
The controller (gateway/ratio/controller.py) acts on it with hysteresis and logs the prediction next to what
it then measured. Pure computation (a few milliseconds per layout for a minute of traffic); the controller
runs it off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.telemetry.traffic import Arrival
from loadgen.summary import SLO
from loadgen.workload import RequestShape
from tuner.fits import StepModel
from tuner.metrics import LayoutScore, score
from tuner.simulator import Layout, SimConfig, simulate


@dataclass(frozen=True)
class Prediction:
    best: Layout
    scores: tuple[LayoutScore, ...]  # every candidate's, best first
    num_requests: int
    rate: float  # requests/s over the window

    def of(self, layout: Layout) -> LayoutScore | None:
        return next((s for s in self.scores if s.layout == layout), None)

    def summary(self) -> dict[str, object]:
        """What the decision log keeps: each layout's predicted goodput, attainment and latencies."""
        layouts = {s.layout.label(): {"goodput": round(float(s.goodput), 3),
                                      "attainment": round(float(s.attainment), 3),
                                      "ttft_p90_s": round(float(s.ttft_p90_s), 3),
                                      "itl_p99_s": round(float(s.itl_p99_s), 3)} for s in self.scores}
        return {"requests": self.num_requests, "rate": round(self.rate, 3), "best": self.best.label(),
                "layouts": layouts}


def rank(s: LayoutScore) -> tuple[float, float, float]:
    return (s.goodput, s.attainment, -s.ttft_p90_s if s.ttft_p90_s == s.ttft_p90_s else float("-inf"))


class LayoutPlanner:
    def __init__(self, model: StepModel, config: SimConfig, slo: SLO, candidates: list[Layout],
                 min_requests: int = 20) -> None:
        """Args:
        model: a worker's fitted step and transfer times (the profile's fits).
        config: the serving settings the simulation mirrors (the live workers' KV shape and budgets).
        candidates: the layouts the controller may move between.
        min_requests: fewer arrivals in the window than this: no prediction.
        """
        self.model = model
        self.config = config
        self.slo = slo
        self.candidates = candidates
        self.min_requests = min_requests

    def predict(self, arrivals: list[Arrival]) -> Prediction | None:
        if len(arrivals) < self.min_requests:
            return None
        start = arrivals[0].at
        span = max(arrivals[-1].at - start, 1e-3)
        requests = [RequestShape(i, a.at - start, max(1, a.prompt_tokens), max(1, a.output_tokens))
                    for i, a in enumerate(arrivals)]
        rate = (len(arrivals) - 1) / span if len(arrivals) > 1 else 0.0
        scores = sorted((score(simulate(layout, requests, self.config, self.model), self.slo, rate)
                         for layout in self.candidates), key=rank, reverse=True)
        return Prediction(scores[0].layout, tuple(scores), len(arrivals), rate)
