"""Step-time models fitted by least squares: how long one forward (or one KV transfer) takes.

What the simulator asks, and the form of each answer (linear in named features, coefficients >= 0):
    prefill step   a + b·t + c·q                         t: prompt tokens in the forward,
                                                         q: attention pairs Σ t_i·(start_i + t_i) over its
                                                            chunks (t² for a whole prompt in one chunk)
    decode step    a + b·batch + c·context               context: Σ tokens each decoding request attends to
    mixed step     a + b·batch + c·context + d·t + e·q   fitted over every forward measured, so a decode batch
                                                         plus a prefill chunk is priced by one model
    transfer       a + b·bytes
Least squares on relative error (each point weighted by 1/seconds): forwards span 1 ms to seconds, and an
absolute fit would spend its intercept on the longest prompts and misprice every short step. A coefficient
that comes out negative (noise on a small term) is dropped and the rest refitted: a negative cost per token
would make a bigger batch faster, and the simulator would exploit it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PREFILL_FEATURES = ("1", "prefill_tokens", "prefill_pairs")
DECODE_FEATURES = ("1", "batch", "context")
MIXED_FEATURES = ("1", "batch", "context", "prefill_tokens", "prefill_pairs")
TRANSFER_FEATURES = ("1", "bytes")


@dataclass(frozen=True)
class StepPoint:
    """One measured forward."""

    seconds: float  # median wall time of the forward
    batch: int  # decoding requests in it (one token each)
    context: int  # Σ tokens the decoding requests attend to (their new token included)
    prefill_tokens: int  # prompt tokens in it (chunks)
    prefill_pairs: int  # Σ over chunks of chunk tokens × (chunk start + chunk tokens)

    @property
    def kind(self) -> str:
        if self.prefill_tokens and self.batch:
            return "mixed"
        return "prefill" if self.prefill_tokens else "decode"

    def features(self, names: Sequence[str]) -> list[float]:
        values = {"1": 1.0, "batch": self.batch, "context": self.context,
                  "prefill_tokens": self.prefill_tokens, "prefill_pairs": self.prefill_pairs}
        return [float(values[name]) for name in names]


@dataclass(frozen=True)
class TransferPoint:
    """One measured KV transfer."""

    seconds: float  # median time from start_pull to the receiver seeing it done
    bytes: int  # KV bytes moved


@dataclass(frozen=True)
class LinearFit:
    """seconds ≈ Σ coefficient × feature."""

    features: tuple[str, ...]  # names, "1" for the intercept
    coefficients: tuple[float, ...]  # one per feature, each >= 0
    rmse_s: float  # root mean square error over the points it was fitted on
    num_points: int

    def predict(self, values: Sequence[float]) -> float:
        return sum(c * v for c, v in zip(self.coefficients, values, strict=True))

    def coefficient(self, name: str) -> float:
        return self.coefficients[self.features.index(name)]

    def to_dict(self) -> dict[str, object]:
        return {"features": list(self.features), "coefficients": list(self.coefficients),
                "rmse_s": self.rmse_s, "num_points": self.num_points}

    @staticmethod
    def from_dict(data: dict[str, object]) -> LinearFit:
        features = tuple(str(f) for f in data["features"])  # type: ignore[attr-defined]
        coefficients = tuple(float(c) for c in data["coefficients"])  # type: ignore[attr-defined]
        if len(features) != len(coefficients):
            raise ValueError(f"a fit has {len(features)} features but {len(coefficients)} coefficients")
        return LinearFit(features, coefficients, float(data["rmse_s"]),  # type: ignore[arg-type]
                         int(data["num_points"]))  # type: ignore[call-overload]


def fit_linear(features: Sequence[str], rows: Sequence[Sequence[float]], seconds: Sequence[float]
               ) -> LinearFit:
    """Least squares of relative error with non-negative coefficients (drop the most negative, refit, until
    none is).

    Raises:
        ValueError: no points, or fewer points than features.
    """
    if len(rows) < len(features):
        raise ValueError(f"fitting {', '.join(features)} needs at least {len(features)} points, "
                         f"got {len(rows)}")
    x = np.asarray(rows, dtype=np.float64)  # [points, features]
    y = np.asarray(seconds, dtype=np.float64)  # [points]
    weight = 1.0 / np.maximum(y, 1e-12)  # [points]: relative error
    # Columns differ by orders of magnitude (1 vs bytes): scale them so lstsq's rank cut-off is fair.
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    active = list(range(len(features)))
    coefficients = np.zeros(len(features))
    while active:
        scaled = x[:, active] / scale[active] * weight[:, None]
        solution, *_ = np.linalg.lstsq(scaled, y * weight, rcond=None)
        solution = solution / scale[active]
        if (solution >= 0).all():
            coefficients[:] = 0.0
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    residual = y - x @ coefficients
    return LinearFit(tuple(features), tuple(float(c) for c in coefficients),
                     float(np.sqrt(np.mean(residual**2))), len(rows))


@dataclass(frozen=True)
class StepModel:
    """The four fits the simulator prices its events with."""

    prefill: LinearFit  # PREFILL_FEATURES
    decode: LinearFit  # DECODE_FEATURES
    mixed: LinearFit  # MIXED_FEATURES
    transfer: LinearFit  # TRANSFER_FEATURES

    def step_s(self, batch: int, context: int, prefill_tokens: int, prefill_pairs: int) -> float:
        """One forward of `batch` decode tokens over `context` tokens plus `prefill_tokens` prompt tokens."""
        if not prefill_tokens:
            return self.decode.predict((1.0, batch, context))
        if not batch:
            return self.prefill.predict((1.0, prefill_tokens, prefill_pairs))
        return self.mixed.predict((1.0, batch, context, prefill_tokens, prefill_pairs))

    def transfer_s(self, num_bytes: int) -> float:
        return self.transfer.predict((1.0, num_bytes))

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name).to_dict() for name in ("prefill", "decode", "mixed", "transfer")}

    @staticmethod
    def from_dict(data: dict[str, dict[str, object]]) -> StepModel:
        expected = {"prefill": PREFILL_FEATURES, "decode": DECODE_FEATURES, "mixed": MIXED_FEATURES,
                    "transfer": TRANSFER_FEATURES}
        fits = {}
        for name, features in expected.items():
            if name not in data:
                raise ValueError(f"no {name!r} fit")
            fits[name] = LinearFit.from_dict(data[name])
            if fits[name].features != features:
                raise ValueError(f"the {name!r} fit has features {fits[name].features}, expected {features}")
        return StepModel(**fits)


def fit_step_model(steps: Sequence[StepPoint], transfers: Sequence[TransferPoint]) -> StepModel:
    """Fit all four models; the mixed one over every forward, the others over their own kind.

    Raises:
        ValueError: too few points of some kind (the message names it).
    """
    def fit(kind: str, features: tuple[str, ...], points: Sequence[StepPoint]) -> LinearFit:
        try:
            return fit_linear(features, [p.features(features) for p in points], [p.seconds for p in points])
        except ValueError as error:
            raise ValueError(f"{kind} steps: {error}") from None

    prefills = [p for p in steps if p.kind == "prefill"]
    decodes = [p for p in steps if p.kind == "decode"]
    try:
        transfer = fit_linear(TRANSFER_FEATURES, [(1.0, p.bytes) for p in transfers],
                              [p.seconds for p in transfers])
    except ValueError as error:
        raise ValueError(f"transfers: {error}") from None
    return StepModel(fit("prefill", PREFILL_FEATURES, prefills), fit("decode", DECODE_FEATURES, decodes),
                     fit("mixed", MIXED_FEATURES, steps), transfer)
