"""``hybrimoe trace``: record a model's own routing into a trace file (:mod:`hybrimoe.traces.format`), with the
model run as ``hybrimoe run`` would run it (:mod:`hybrimoe.runtime.recording` says what is recorded and how).

Prompts: ``-p TEXT`` (repeatable), ``-f FILE`` (repeatable): a ``.jsonl`` file holds one JSON value per line, a
string (the prompt) or an object with ``"prompt"`` or ``"messages"``; any other file holds one prompt per non-empty
line. The file is written atomically; an existing ``-o`` file is kept unless ``--force``. Ctrl-C stops the
recording: the tokens recorded so far are written, flagged ``partial``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hybrimoe.commands.args import COUNT
from hybrimoe.commands.llama_args import add_llama_arguments, load_llama, model_argument
from hybrimoe.envs import progress_on
from hybrimoe.outputs import check_output
from hybrimoe.runtime.recording import Recorder, read_prompts

HELP = ("record a model's routing (expert ids and router scores per token and MoE layer) into a trace file for "
        "simulate and --replay-trace")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``trace`` options: llama.cpp's model, placement and sampling flags (as ``run``) and the recording's."""
    p.add_argument("-p", "--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("-f", "--file", action="append", default=[], metavar="FILE",
                   help="prompts: one per non-empty line, or a .jsonl file of strings / {\"prompt\"} / "
                        "{\"messages\"} (repeatable)")
    p.add_argument("-n", "--n-predict", type=COUNT, default=32,
                   help="tokens to generate after each prompt (decode phase; default: %(default)s)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to plain prompts")
    p.add_argument("-o", "--output", required=True, metavar="TRACE.npz", help="the trace file to write")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    add_llama_arguments(p)
    p.set_defaults(temp=0.0)


def _check_output(path: Path, args) -> str:
    """The problem with the output file (:func:`hybrimoe.outputs.check_output`), or ""."""
    inputs = [("-m", getattr(args, "model", None)), ("--replay-trace", getattr(args, "replay_trace", None)),
              ("--moe-profile", getattr(args, "moe_profile", None)),
              ("--moe-cost-model", getattr(args, "moe_cost_model", None))]
    inputs += [("-f", f) for f in getattr(args, "file", None) or []]
    try:
        check_output(path, "-o", force=args.force, inputs=inputs)
    except ValueError as e:
        return str(e)
    return ""


def run(args) -> int:
    """Runs ``hybrimoe trace``; returns the exit status (0 ok, 1 failed, 2 bad input, 130 interrupted; an
    interrupted run still writes what it recorded)."""
    prog = "hybrimoe trace"
    out = Path(args.output)
    bad = _check_output(out, args)
    if bad:
        print(f"{prog}: error: {bad}", file=sys.stderr)
        return 2
    try:
        prompts = read_prompts(args.prompt, args.file)
    except (FileNotFoundError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    model = model_argument(args, prog)
    if model is None:
        return 1
    llm = load_llama(args, model, prog, record_routing=True)
    if llm is None:
        return 1
    bar = tqdm(total=len(prompts), desc="trace", unit="prompt", file=sys.stderr,
               disable=not progress_on())
    tokens = [0]

    def on_token(n: int) -> None:
        tokens[0] += n
        bar.set_postfix_str(f"{tokens[0]} tokens")

    status = 0
    try:
        rec = Recorder(llm, on_token=on_token, on_prompt=lambda: bar.update(1))
        try:
            rec.record(prompts, args.n_predict, chat=args.chat, temp=args.temp, top_k=args.top_k, top_p=args.top_p)
        except (ValueError, RuntimeError) as e:
            print(f"\n{prog}: error: {e}", file=sys.stderr)
            status = 1
        if rec.interrupted:
            status = 130
        if rec.rows.n == 0:
            print(f"{prog}: nothing recorded; {out} not written", file=sys.stderr)
            return status or 1
        tr = rec.trace(model)
        if status:
            tr.partial = True
        try:
            tr.save(out)
        except OSError as e:
            print(f"{prog}: error: cannot write {out}: {e.strerror or e}", file=sys.stderr)
            return 1
    except (ValueError, RuntimeError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    finally:
        bar.close()
        llm.close()
    n_dec = int(np.sum(tr.phases == 1))
    print(f"{prog}: wrote {out}: {tr.n_tokens} tokens ({tr.n_tokens - n_dec} prefill, {n_dec} decode) of "
          f"{tr.n_prompts} prompt(s), {tr.n_layers} MoE layers, {tr.num_experts} experts, top-{tr.top_k}, gating "
          f"{tr.gating or 'unknown'}" + (" (partial: interrupted or failed)" if tr.partial else ""), file=sys.stderr)
    return status
