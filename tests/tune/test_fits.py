"""Least-squares fits recover known coefficients, refuse negative ones, and survive profile.json."""

from __future__ import annotations

import random

import pytest

from tuner.fits import StepModel, StepPoint, TransferPoint, fit_linear, fit_step_model


def test_fit_recovers_known_coefficients_with_noise() -> None:
    rng = random.Random(0)
    truth = (0.002, 4e-5, 1e-8)
    rows = [(1.0, t, t * t) for t in range(16, 1024, 16)]
    seconds = [sum(c * v for c, v in zip(truth, row, strict=True)) * (1 + rng.gauss(0, 0.01)) for row in rows]

    fit = fit_linear(("1", "prefill_tokens", "prefill_pairs"), rows, seconds)

    for got, want in zip(fit.coefficients, truth, strict=True):
        assert got == pytest.approx(want, rel=0.1)
    assert fit.rmse_s < 0.02 * max(seconds)


def test_a_negative_coefficient_is_dropped_and_the_rest_refitted() -> None:
    # time falls slightly with context: noise that would make bigger batches faster
    rows = [(1.0, b, c) for b in (1, 2, 4, 8, 16) for c in (64, 512)]
    seconds = [0.01 + 0.002 * b - 1e-7 * c for _, b, c in rows]

    fit = fit_linear(("1", "batch", "context"), rows, seconds)

    assert fit.coefficient("context") == 0.0
    assert all(c >= 0 for c in fit.coefficients)
    assert fit.coefficient("batch") == pytest.approx(0.002, rel=0.05)


def test_too_few_points_name_the_fit() -> None:
    steps = [StepPoint(0.01, 1, 10, 0, 0), StepPoint(0.02, 2, 20, 0, 0)]
    with pytest.raises(ValueError, match=r"prefill steps: .*at least 3 points"):
        fit_step_model(steps, [TransferPoint(0.001, 1), TransferPoint(0.002, 2)])


def test_step_model_picks_the_fit_by_the_forward_and_round_trips() -> None:
    steps = [StepPoint(0.001 + 1e-5 * t, 0, 0, t, t * t) for t in (16, 64, 256, 512)]
    steps += [StepPoint(0.004 + 0.001 * b + 1e-6 * b * c, b, b * c, 0, 0)
              for b in (1, 4, 16) for c in (64, 256)]
    steps += [StepPoint(0.004 + 0.001 * b + 1e-6 * b * 64 + 1e-5 * t, b, b * 64, t, t * t)
              for b in (1, 8) for t in (32, 128)]
    transfers = [TransferPoint(1e-4 + n * 1e-9, n) for n in (1 << 10, 1 << 20, 1 << 24)]

    model = fit_step_model(steps, transfers)

    assert model.step_s(0, 0, 100, 10_000) == pytest.approx(0.001 + 1e-3, rel=0.01)
    assert model.step_s(4, 400, 0, 0) == pytest.approx(0.004 + 0.004 + 4e-4, rel=0.01)
    assert model.transfer_s(1 << 22) == pytest.approx(1e-4 + (1 << 22) * 1e-9, rel=0.01)
    assert StepModel.from_dict(model.to_dict()) == model
