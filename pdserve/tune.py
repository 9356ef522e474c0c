"""`pdserve tune {profile, plan, validate}`: the tuner's command line (the tuner/ package does the work).
Part of the command line, the composition root, so it may read the gateway's serving defaults, which the
simulator must mirror and must not copy.

    profile  --model DIR → profile.json + profile.png
    plan     --profile P (--trace T | --input-len/--output-len) (--rate R | --rates a,b,c) --workers N
             → plan.json + plan.png; --apply URL sets the recommended layout on a live gateway
    validate --url U --plan P → bench each layout at each rate, predicted vs measured
A bad flag ends the command through argparse's error (exit status 2, the flag named in the message).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

PROGRESS = {"file": sys.stderr, "dynamic_ncols": True}


def _fail(args: argparse.Namespace, message: str) -> None:
    args.tune_parser.error(message)  # exits with status 2


def _serving_defaults() -> dict[str, float]:
    """The gateway's own defaults of what the simulator mirrors (one place for each, theirs)."""
    from gateway.config import ServeConfig
    from gateway.fleet.config import DeploymentConfig
    from gateway.requests.router import LocalPrefillPolicy
    from llm_engine.config import EngineConfig

    return {"watermark": DeploymentConfig.watermark,
            "max_waiting": ServeConfig.model_fields["max_waiting"].default,
            "queue_timeout_s": ServeConfig.model_fields["queue_timeout_s"].default,
            "max_prefill_s_beside_decode": EngineConfig.max_prefill_s_beside_decode,
            "isolate_prompts_from_tokens": LocalPrefillPolicy.isolate_prompts_from_tokens,
            "move_streams_from_tokens": LocalPrefillPolicy.move_streams_from_tokens}


def run_profile(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from llm_engine.config import EngineConfig
    from llm_engine.default_model import prepare_default_model
    from llm_engine.model_files import ModelNotFoundError, check_model_name, resolve_model, served_name
    from tuner.measure import QUICK_GRID, ProfileGrid, profile_engine
    from tuner.plots import plot_profile

    if args.model is None:
        model_dir = str(prepare_default_model())
    else:
        try:
            check_model_name(args.model)
            model_dir = str(resolve_model(args.model, args.revision, weights=True))
        except (ValueError, ModelNotFoundError) as error:
            _fail(args, f"--model: {error}")
    torch.set_num_threads(args.threads)  # as a worker: its own threads only
    overrides = {"dtype": args.dtype, "device": args.device, "block_size": args.block_size,
                 "kv_cache_bytes": None if args.kv_cache_mib is None else args.kv_cache_mib << 20,
                 "max_num_batched_tokens": args.max_num_batched_tokens}
    try:
        config = EngineConfig(model_dir, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as error:
        _fail(args, f"engine settings: {error}")
    grid = QUICK_GRID if args.quick else ProfileGrid()
    if args.repeats is not None:
        if args.repeats < 1:
            _fail(args, f"--repeats: must be >= 1, got {args.repeats}")
        grid = dataclasses.replace(grid, repeats=args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tqdm(total=grid.num_measurements() + 1, desc="profile", disable=args.no_progress,
              **PROGRESS) as bar:
        profile = profile_engine(model_dir, config, grid, lambda: bar.update(1),
                                 model_name=served_name(args.model, model_dir))
    profile.save(out / "profile.json")
    plot_profile(profile, out / "profile.png")
    print(f"profiled {profile.model} ({profile.dtype}, {profile.hardware}); transfers: "
          f"{profile.transfer_method}")
    for name in ("prefill", "decode", "mixed", "transfer"):
        fit = getattr(profile.fits, name)
        terms = " + ".join(f"{c:.3g}·{f}" for f, c in zip(fit.features, fit.coefficients, strict=True))
        print(f"  {name:8} s = {terms}   (rmse {1000 * fit.rmse_s:.2f} ms, {fit.num_points} points)")
    print(f"wrote {out / 'profile.json'} and {out / 'profile.png'}")
    return 0


def _parse_rates(args: argparse.Namespace) -> tuple[float | None, ...]:
    if args.rate is not None and args.rates is not None:
        _fail(args, "--rate/--rates: give one of them")
    if args.rates is not None:
        try:
            rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
        except ValueError:
            _fail(args, f"--rates: expected numbers separated by commas, got {args.rates!r}")
        if not rates:
            _fail(args, "--rates: no rate given")
    elif args.rate is not None:
        rates = (args.rate,)
    elif args.trace is not None:
        return (None,)  # replay the trace's own arrival times
    else:
        _fail(args, "--rate: give --rate or --rates, or --trace to replay its timestamps")
    if any(r <= 0 for r in rates):
        _fail(args, f"--rates: every rate must be > 0, got {', '.join(f'{r:g}' for r in rates)}")
    return rates


def run_plan(args: argparse.Namespace) -> int:
    import json

    from loadgen.summary import SLO
    from loadgen.workload import read_trace
    from tuner.planner import Workload, make_plan
    from tuner.plots import plot_goodput_heatmap
    from tuner.profile import load_profile
    from tuner.simulator import SimConfig
    from tuner.table import print_plan

    positive = (("--workers", args.workers), ("--ttft-slo-s", args.ttft_slo_s),
                ("--itl-slo-s", args.itl_slo_s),
                ("--num-requests", args.num_requests), ("--length-scale", args.length_scale),
                ("--burstiness", args.burstiness), ("--speed", args.speed))
    for flag, value in positive:
        if value <= 0:
            _fail(args, f"{flag}: must be > 0, got {value:g}")
    if args.target_rate is not None and args.target_rate <= 0:
        _fail(args, f"--target-rate: must be > 0, got {args.target_rate:g}")
    rates = _parse_rates(args)
    try:
        profile = load_profile(args.profile)
    except (FileNotFoundError, ValueError) as error:
        _fail(args, f"--profile: {error}")
    trace = None
    if args.trace is not None:
        try:
            trace = tuple(read_trace(args.trace))
        except (FileNotFoundError, ValueError) as error:
            _fail(args, f"--trace: {error} (formats: Azure CSV TIMESTAMP,ContextTokens,GeneratedTokens or "
                        "Mooncake JSONL)")
    elif args.input_len is None or args.output_len is None:
        _fail(args, "--input-len/--output-len: both are needed without --trace")
    elif min(args.input_len, args.output_len) < 1:
        _fail(args, "--input-len/--output-len: must be >= 1")
    workload = Workload(args.num_requests, args.seed, args.burstiness, trace,
                        str(Path(args.trace).resolve()) if args.trace else None, args.speed, args.input_len,
                        args.output_len, args.length_scale)
    access = None
    if args.apply is not None:
        import httpx

        from tuner.apply import ServerAccess, ServerError, check_model

        access = ServerAccess(args.apply.rstrip("/"), args.api_key or os.environ.get("PDSERVE_API_KEY"),
                              args.admin_key or os.environ.get("PDSERVE_ADMIN_KEY"))
        try:  # before minutes of planning: is this profile of the server's model?
            check_model(access, profile.model)
        except ValueError as error:
            _fail(args, f"--profile: {error}")
        except (httpx.HTTPError, ServerError) as error:
            _fail(args, f"--apply: {access.url}: {type(error).__name__}: {error}")
    defaults = _serving_defaults()
    config = SimConfig(profile.shape, float(defaults["watermark"]), int(defaults["max_waiting"]),
                       float(defaults["queue_timeout_s"]), hop_s=args.hop_ms / 1000.0,
                       max_prefill_s_beside_decode=float(defaults["max_prefill_s_beside_decode"]),
                       isolate_prompts_from_tokens=int(defaults["isolate_prompts_from_tokens"]),
                       move_streams_from_tokens=int(defaults["move_streams_from_tokens"]))
    total = len(rates) * _num_layouts(args.workers) + (
        sum(_num_layouts(n) for n in range(1, args.workers + 1)) if args.target_rate else 0)
    with tqdm(total=total, desc="simulate", disable=args.no_progress, **PROGRESS) as bar:
        plan = make_plan(profile, config, workload, rates, SLO(args.ttft_slo_s, args.itl_slo_s), args.workers,
                         args.target_rate, lambda: bar.update(1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan.to_dict(profile), indent=1))
    plot_goodput_heatmap(plan, out / "plan.png")
    print_plan(plan, profile)
    print(f"wrote {out / 'plan.json'} and {out / 'plan.png'} ({plan.seconds:.1f} s of simulation)")
    if access is not None:
        from tuner.apply import apply_layout

        answer = apply_layout(access, plan.recommended.to_dict())
        done = answer.get("done")
        moves = ", ".join(str(move) for move in done) if isinstance(done, list) and done else "no change"
        print(f"applied {plan.recommended.label()} on {access.url}: {moves}")
    return 0


def _num_layouts(num_workers: int) -> int:
    from tuner.planner import layouts_of

    return len(layouts_of(num_workers))


def run_validate(args: argparse.Namespace) -> int:
    import httpx

    from tuner.apply import ServerAccess, ServerError
    from tuner.validate import load_plan, report, validate

    try:
        plan = load_plan(args.plan)
    except (FileNotFoundError, ValueError) as error:
        _fail(args, f"--plan: {error}")
    access = ServerAccess(args.url.rstrip("/"), args.api_key or os.environ.get("PDSERVE_API_KEY"),
                          args.admin_key or os.environ.get("PDSERVE_ADMIN_KEY"))
    labels = [label.strip() for label in args.layouts.split(",")] if args.layouts else None
    try:
        comparisons = validate(plan, access, Path(args.out), labels, show_progress=not args.no_progress)
    except ValueError as error:
        _fail(args, f"--plan: {error}")
    except (httpx.HTTPError, ServerError) as error:
        _fail(args, f"--url: {access.url}: {type(error).__name__}: {error}")
    print(report(comparisons))
    return 0


def add_tune_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `tune` and its subcommands to a CLI's subparsers; each sets `handler` (args → exit status)."""
    from loadgen.summary import DEFAULT_ITL_SLO_S, DEFAULT_TTFT_SLO_S
    from pdserve.settings_cli import env_defaults
    from tuner.simulator import DEFAULT_HOP_S

    tune = subparsers.add_parser("tune", help="profile, simulate and choose the prefill:decode layout")
    commands = tune.add_subparsers(dest="tune_command", required=True)

    profile = commands.add_parser("profile", help="time the engine's forwards and KV transfers; fit them")
    profile.add_argument("--model", default=None, help="a Hugging Face model id or model directory, as "
                                                       "`serve` (default: the default model)")
    profile.add_argument("--revision", default=None, help="branch, tag or commit of a model id")
    profile.add_argument("--dtype", default=None,
                         help="auto, float32, bfloat16 or float16 (default: auto, as `serve`)")
    profile.add_argument("--device", default=None, help="cpu or cuda (default: the engine's)")
    profile.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    profile.add_argument("--kv-cache-mib", type=int, default=None, help="KV cache per worker, MiB")
    profile.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per forward")
    profile.add_argument("--threads", type=int, default=1,
                         help="torch threads, as --threads-per-worker of the servers planned for (default 1: "
                              "a 2-core machine's cores split over 2 workers)")
    profile.add_argument("--quick", action="store_true", help="a small grid (seconds; for smoke tests)")
    profile.add_argument("--repeats", type=int, default=None, help="timings per point (median kept)")
    profile.add_argument("--out", default=".", help="directory for profile.json and profile.png")
    profile.add_argument("--no-progress", action="store_true")
    profile.set_defaults(handler=run_profile, tune_parser=profile)

    plan = commands.add_parser("plan", help="simulate every layout of N workers and recommend one")
    plan.add_argument("--profile", required=True, help="profile.json from `pdserve tune profile`")
    plan.add_argument("--trace", default=None, help="Azure CSV or Mooncake JSONL trace (lengths, times)")
    plan.add_argument("--length-scale", type=float, default=1.0, help="multiply trace lengths by this")
    plan.add_argument("--input-len", type=int, default=None, help="fixed prompt tokens (without --trace)")
    plan.add_argument("--output-len", type=int, default=None, help="fixed output tokens (without --trace)")
    plan.add_argument("--rate", type=float, default=None, help="requests/s (Poisson)")
    plan.add_argument("--rates", default=None, help="several rates, comma-separated: a,b,c")
    plan.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    plan.add_argument("--speed", type=float, default=1.0, help="trace replay speed-up (no --rate)")
    plan.add_argument("--num-requests", type=int, default=300, help="requests per simulated run")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--ttft-slo-s", type=float, default=DEFAULT_TTFT_SLO_S,
                      help="TTFT SLO, seconds (the name and default serve and bench use)")
    plan.add_argument("--itl-slo-s", type=float, default=DEFAULT_ITL_SLO_S, help="TPOT/ITL SLO, seconds")
    for old, dest in (("--ttft-slo", "ttft_slo_s"), ("--itl-slo", "itl_slo_s")):  # the old names still work
        plan.add_argument(old, dest=dest, type=float, help=argparse.SUPPRESS)
    plan.add_argument("--workers", type=int, required=True, help="N: layouts of N workers are compared")
    plan.add_argument("--target-rate", type=float, default=None,
                      help="find the fewest workers (1..N) that hold this rate at 90%% SLO attainment")
    plan.add_argument("--hop-ms", type=float, default=1000.0 * DEFAULT_HOP_S,
                      help="latency of each hop between gateway and workers, ms")
    plan.add_argument("--apply", default=None, metavar="URL",
                      help="set the recommended layout on this gateway")
    plan.add_argument("--api-key", default=None, help="the gateway's API key (or PDSERVE_API_KEY)")
    plan.add_argument("--admin-key", default=None, help="its admin key (or PDSERVE_ADMIN_KEY)")
    plan.add_argument("--out", default=".", help="directory for plan.json and plan.png")
    plan.add_argument("--no-progress", action="store_true")
    plan.set_defaults(handler=run_plan, tune_parser=plan)

    check = commands.add_parser("validate",
                                help="measure each planned layout on a server: predicted vs measured")
    check.add_argument("--url", required=True, help="the gateway's base URL")
    check.add_argument("--plan", required=True, help="plan.json from `pdserve tune plan`")
    check.add_argument("--layouts", default=None, help="only these, comma-separated (e.g. 1P+1D,2M)")
    check.add_argument("--api-key", default=None, help="the gateway's API key (or PDSERVE_API_KEY)")
    check.add_argument("--admin-key", default=None, help="its admin key (or PDSERVE_ADMIN_KEY)")
    check.add_argument("--out", default="tune-validate", help="directory for the bench outputs")
    check.add_argument("--no-progress", action="store_true")
    check.set_defaults(handler=run_validate, tune_parser=check)
    for command, parser in (("profile", profile), ("plan", plan), ("validate", check)):
        env_defaults(parser, f"PDSERVE_TUNE_{command.upper()}_")
        parser.epilog = (f"Every flag is also an environment variable PDSERVE_TUNE_{command.upper()}_<FLAG "
                         "NAME>. Precedence: flags > environment > defaults.")
    return tune
