"""``hybrimoe synth``: write a synthetic routing trace of a model shape whose statistics (popularity skew, temporal
and cross-layer locality) are knobs (:mod:`hybrimoe.traces.synthetic`)."""
from __future__ import annotations

import argparse
import sys

from hybrimoe.commands.args import FRACTION, POSITIVE, SEED, float_in, int_in
from hybrimoe.outputs import check_output
from hybrimoe.traces.stats import PERSIST_LAG, routing_stats
from hybrimoe.traces.synthetic import (
    DEFAULT_PROMPT_TOKENS,
    DEFAULT_TOPK_MASS,
    LOCALITY,
    SHAPES,
    default_prompts,
    synthetic_trace,
)

HELP = ("write a synthetic routing trace of a model shape whose statistics (popularity skew, temporal and "
        "cross-layer locality) are knobs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``hybrimoe synth``."""
    parser.add_argument("--shape", required=True, help=f"model shape: {', '.join(SHAPES)}")
    parser.add_argument("--locality", default="high",
                        help=f"knob preset: {', '.join(LOCALITY)} (high: fitted to the DeepSeek-V2-Lite trace; low: "
                             "no temporal locality)")
    parser.add_argument("-n", "--n-tokens", type=int_in(2), default=2000, help="tokens (default: %(default)s)")
    parser.add_argument("--prompts", type=POSITIVE, default=None,
                        help=f"prompts (equal lengths; default: tokens / {DEFAULT_PROMPT_TOKENS}, the real trace's "
                             "mean prompt length)")
    parser.add_argument("--seed", type=SEED, default=0, help="seed (default: %(default)s)")
    for knob, what in (("skew", "share of the hottest 25%% of experts"), ("overlap", "lag-1 temporal lift"),
                       ("persistence", f"lag-{PERSIST_LAG} temporal lift"),
                       ("cross-layer", "adjacent-layer lift")):
        parser.add_argument(f"--{knob}", type=FRACTION, default=None, help=f"knob: {what} (default: the preset's)")
    parser.add_argument("--topk-mass", type=float_in(0.0, 1.0, lo_open=True, hi_open=True), default=DEFAULT_TOPK_MASS,
                        help="mean softmax mass of the routed experts in the generated scores (an assumption; "
                             "default: %(default)s)")
    parser.add_argument("--no-scores", action="store_true", help="write no router scores")
    parser.add_argument("--stats", action="store_true", help="measure the written trace's statistics and print them")
    parser.add_argument("-o", "--output", required=True, help="trace file to write (.npz)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")


def run(args: argparse.Namespace) -> int:
    """Runs ``hybrimoe synth``; returns the exit status (0 ok, 2 bad input or an unwritable file)."""
    prog = "hybrimoe synth"
    try:
        check_output(args.output, "-o", force=args.force)
        n_prompts = args.prompts
        if n_prompts is None:
            n_prompts = default_prompts(args.n_tokens)
        tr = synthetic_trace(args.shape, args.n_tokens, locality=args.locality, skew=args.skew, overlap=args.overlap,
                             persistence=args.persistence, cross_layer=args.cross_layer, n_prompts=n_prompts,
                             seed=args.seed, topk_mass=args.topk_mass, scores=not args.no_scores)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        tr.save(args.output)
    except (OSError, ValueError) as e:
        print(f"{prog}: error: cannot write {args.output}: {e}", file=sys.stderr)
        return 2
    syn = tr.synthetic
    knobs = ", ".join(f"{k} {v:g}" for k, v in syn["knobs"].items())
    print(f"{prog}: wrote {args.output}: {args.shape}, {tr.n_tokens} tokens in {tr.n_prompts} prompts, "
          f"{tr.n_layers} MoE layers x {tr.num_experts} experts, top-{tr.top_k}; seed {args.seed}; locality "
          f"{syn['locality']}: {knobs}")
    print(f"router scores: {syn['score_model']}")
    if args.stats:
        s = routing_stats(tr)
        print("measured: " + ", ".join(f"{k} {s[k]:.4f}" for k in ("skew", "overlap", "persistence", "cross_layer"))
              + " (short traces: skew biased up, cross_layer down)")
    return 0
