"""The reuse cache tuned on one half of the development trace's prompts, measured on the other (held back).

The trace's prompts are split by parity (``bench_preset_vs.prompt_half``: by prompt, not by token). On the tuning
half every (horizon, rate) of the grid runs as ``hybrimoe-reuse`` (the reuse policy with priority admission) beside
the ``hybrimoe`` preset (MRS), in full simulated runs (decode, ``--cache``, up to ``--max-tokens`` tokens) on each
hardware file; the pair with the highest mean tokens/s over MRS is chosen. On the held-back half the chosen pair,
the shipped default (``ReusePolicy()``: ``kDefaultHorizon``, ``kDefaultRate``) and MRS run once each; the table gives
hit rate, tokens/s and the ratio over MRS on both halves. The recent-transition decay (``kRecentDecay``) is a
constant of the build, not swept.

    python3 bench/bench_reuse_heldback.py --tune-on even
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_preset_vs import prompt_half  # noqa: E402

from hybrimoe import _core  # noqa: E402
from hybrimoe import policy as pol  # noqa: E402
from hybrimoe.policy.presets import STREAMING_FRACTION, build_preset  # noqa: E402
from hybrimoe.sim.simulator import Setup  # noqa: E402


def run_reuse(s: Setup, n_experts: int, horizon: int, rate: float) -> dict:
    """One full simulated run of the reuse cache at (horizon, rate), hybrimoe-reuse's other components."""
    spec = dict(scheduler="hybrimoe", cache=_core.ReusePolicy(horizon=horizon, rate=rate), prefetch="impact",
                fill=True, admission="priority", streaming=STREAMING_FRACTION)
    ps = build_preset(spec, s.expert_bytes, n_experts, s.budget, hot_keys=s.hot_keys, profile=s.profile.ravel())
    cfg = _core.SimConfig()
    for f in ("stage", "ubatch", "prompt_tokens", "prefetch_depth", "recall", "predictor_seed", "max_tokens"):
        setattr(cfg, f, getattr(s.cfg, f))
    cfg.fill_on_miss = ps.fill_on_miss
    return s.run("hybrimoe-reuse", ps.cache, ps.scheduler, ps.prefetcher, cfg)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=None, help="routing trace (default: the development trace)")
    ap.add_argument("--tune-on", choices=("even", "odd"), default="even", help="the half the choice is made on")
    ap.add_argument("--hardware", default="paper-a6000,rtx4090-desktop,h200", help="hardware files, comma-separated")
    ap.add_argument("--cache", default="25%", help="GPU expert cache budget (as hybrimoe simulate --moe-cache)")
    ap.add_argument("--max-tokens", type=int, default=8000, help="decode tokens per run, at least 1")
    ap.add_argument("--horizons", default="1,2,4,8", help="horizons to try, comma-separated (1..1024 visits)")
    ap.add_argument("--rates", default="0.01,0.003,0.001,0.0003", help="SGD rates to try, comma-separated, in (0, 1]")
    ap.add_argument("--json", default=None, help="write the choice and every row here")
    args = ap.parse_args()
    from hybrimoe.policy.budget import parse_budget
    from hybrimoe.traces.format import default_trace_path, load_trace

    def numbers(flag, text, cast, ok):
        try:
            vals = [cast(x) for x in text.split(",")]
        except ValueError:
            ap.error(f"{flag} {text!r}: comma-separated numbers")
        if not vals or not all(ok(v) for v in vals):
            ap.error(f"{flag} {text!r}: out of range")
        return vals

    horizons = numbers("--horizons", args.horizons, int, lambda h: 1 <= h <= 1024)  # ReusePolicy::kMaxHorizon
    rates = numbers("--rates", args.rates, float, lambda r: 0.0 < r <= 1.0)
    if args.max_tokens < 1:
        ap.error("--max-tokens must be at least 1")
    try:
        parse_budget(args.cache, 100.0, 0.0)
        hws = {hw: pol.load_hardware(hw) for hw in args.hardware.split(",")}
        tr = load_trace(args.trace or default_trace_path())
    except (ValueError, OSError) as e:
        ap.error(str(e))
    grid = [(h, r) for h in horizons for r in rates]
    tune = 0 if args.tune_on == "even" else 1
    halves = {tune: prompt_half(tr, tune), 1 - tune: prompt_half(tr, 1 - tune)}
    rows = []

    def record(half, hw, what, r, mrs_tps):
        row = dict(half="even" if half == 0 else "odd", hardware=hw, policy=what, hit_rate=r["hit_rate"],
                   tokens_per_s=r["tokens_per_s"], over_mrs=r["tokens_per_s"] / mrs_tps)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        return row

    def setups(half):
        return {hw: Setup(halves[half], h, args.cache, "decode", max_tokens=args.max_tokens) for hw, h in hws.items()}

    ratios: dict = {}
    for hw, s in setups(tune).items():
        mrs = s.run("hybrimoe")
        record(tune, hw, "mrs", mrs, mrs["tokens_per_s"])
        for h, rate in grid:
            row = record(tune, hw, f"reuse H={h} rate={rate:g}", run_reuse(s, tr.num_experts, h, rate),
                         mrs["tokens_per_s"])
            ratios.setdefault((h, rate), []).append(row["over_mrs"])
    best = max(ratios, key=lambda k: statistics.mean(ratios[k]))
    default = (_core.ReusePolicy().horizon, _core.ReusePolicy().rate)
    print(f"chosen on the {args.tune_on} half: horizon {best[0]}, rate {best[1]:g} (mean "
          f"{statistics.mean(ratios[best]):.4f}x MRS); the default: horizon {default[0]}, rate {default[1]:g} (mean "
          f"{statistics.mean(ratios[default]) if default in ratios else float('nan'):.4f}x)")
    for hw, s in setups(1 - tune).items():
        mrs = s.run("hybrimoe")
        record(1 - tune, hw, "mrs", mrs, mrs["tokens_per_s"])
        for h, rate in dict.fromkeys([best, default]):
            record(1 - tune, hw, f"reuse H={h} rate={rate:g}", run_reuse(s, tr.num_experts, h, rate),
                   mrs["tokens_per_s"])
    keep = {"mrs", f"reuse H={best[0]} rate={best[1]:g}", f"reuse H={default[0]} rate={default[1]:g}"}
    print("| half | hardware | policy | hit rate | tokens/s | over MRS |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["policy"] in keep:
            tag = " (held back)" if r["half"] != args.tune_on else ""
            print(f"| {r['half']}{tag} | {r['hardware']} | {r['policy']} | {r['hit_rate']:.3f} | "
                  f"{r['tokens_per_s']:.1f} | {r['over_mrs']:.3f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"chosen": best, "default": default, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
