"""``hybrimoe make-tiny-model``: the command line of :func:`hybrimoe.tiny.make_tiny_model`."""
from __future__ import annotations

import argparse
import sys

from hybrimoe.commands.args import COUNT, POSITIVE, SEED, float_in
from hybrimoe.outputs import check_output
from hybrimoe.tiny.tiny_model import ARCHS, DEFAULT_N_EMBD, DEFAULT_N_FF_EXP, make_tiny_model
from hybrimoe.tiny.tokenizers import TOKENIZERS

HELP = "write a tiny synthetic MoE GGUF (tests, demos)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``make-tiny-model`` arguments to ``parser``."""
    parser.add_argument("out", metavar="OUT.gguf", help="output GGUF file")
    parser.add_argument("--arch", default="qwen3moe", help=f"architecture: {', '.join(ARCHS)}")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the random weights")
    parser.add_argument("--layers", type=POSITIVE, default=None, help="transformer blocks (default 2; llama4 4)")
    # widths left out (None) are chosen by make_tiny_model to fit the quant's blocks (default_widths)
    parser.add_argument("--n-embd", type=POSITIVE, default=None,
                        help=f"hidden size (default {DEFAULT_N_EMBD}; 256 with K-quants and mix, whose blocks "
                             "are 256 wide)")
    parser.add_argument("--n-expert", type=POSITIVE, default=None, help="routed experts per MoE layer (default 8)")
    parser.add_argument("--n-expert-used", type=POSITIVE, default=None,
                        help="experts per token, top-k (default 2; llama4 1)")
    parser.add_argument("--n-ff-exp", type=POSITIVE, default=None,
                        help=f"expert FFN width (default {DEFAULT_N_FF_EXP}; 256 with K-quants and mix)")
    parser.add_argument("--n-shared", type=COUNT, default=None,
                        help="shared experts (qwen2moe, deepseek2; llama4 and step35 have one; default: 1 in "
                             "those four, 0 in the others)")
    parser.add_argument("--n-head", type=POSITIVE, default=4)
    parser.add_argument("--n-dense-lead", type=COUNT, default=1, help="deepseek2: leading dense layers")
    parser.add_argument("--quant", default=None,
                        help="F32 (default), F16, Q8_0, Q4_K_M, ... or mix (gate Q4_K, up Q8_0, down Q6_K)")
    parser.add_argument("--expert-quant", default=None, metavar="TYPE",
                        help="ggml type of the routed-expert matrices (e.g. MXFP4, IQ2_XXS, Q3_K), the rest --quant "
                             "(Q8_0 when --quant is not given with it; without --expert-quant the experts take --quant "
                             "too); IQ types that need an importance matrix get a synthetic one")
    parser.add_argument("--tokenizer", default="spm", choices=TOKENIZERS)
    parser.add_argument("--router-margin", type=float_in(0.0, lo_open=True), default=4.0,
                        help="designed top-k router logit gap")
    parser.add_argument("--fused-gate-up", action="store_true", help="deepseek2: fused ffn_gate_up_exps experts")
    parser.add_argument("--expert-scales", action="store_true",
                        help="qwen3moe, llama: per-expert scales ffn_*_exps.scale")
    parser.add_argument("--no-gate", dest="gated_experts", action="store_false",
                        help="grok: ungated GELU experts (no ffn_gate_exps)")
    parser.add_argument("--swiglu-clamp", type=float_in(0.0), default=0.0,
                        help="step35: swiglu_clamp_exp of the experts")
    parser.add_argument("-f", "--force", action="store_true", help="replace OUT.gguf if it exists")


def run(args: argparse.Namespace) -> int:
    """Run ``make-tiny-model``; returns 0, or 2 with a one-line error on stderr for bad input (an existing OUT
    without ``--force``, a missing output folder: the command creates neither folders nor replaces files unasked)."""
    problem = None
    try:
        check_output(args.out, "OUT", force=args.force)
    except ValueError as e:
        problem = str(e)
    if problem:
        print(f"hybrimoe make-tiny-model: error: {problem}", file=sys.stderr)
        return 2
    quant = args.quant
    if args.expert_quant:
        # the Python API's dict form: {tensor pattern: ggml type}, the rest the base file type
        quant = {"base": args.quant or "Q8_0", r"ffn_(gate|up|down|gate_up)_exps": args.expert_quant}
    try:
        p = make_tiny_model(args.out, args.arch, seed=args.seed, n_layer=args.layers, n_embd=args.n_embd,
                            n_expert=args.n_expert, n_expert_used=args.n_expert_used, n_ff_exp=args.n_ff_exp,
                            n_shared=args.n_shared, n_head=args.n_head, n_dense_lead=args.n_dense_lead,
                            quant=quant, tokenizer=args.tokenizer, router_margin=args.router_margin,
                            fused_gate_up=args.fused_gate_up, expert_scales=args.expert_scales,
                            gated_experts=args.gated_experts, swiglu_clamp=args.swiglu_clamp)
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        print(f"hybrimoe make-tiny-model: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {p} ({p.stat().st_size} bytes)")
    return 0
