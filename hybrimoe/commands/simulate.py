"""``hybrimoe simulate``: trace-driven comparison of whole policy presets (:mod:`hybrimoe.sim.simulator` says how a
run is modelled and which assumptions every report states)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from hybrimoe import _core
from hybrimoe.commands.args import COUNT, FRACTION, POSITIVE, SEED, float_in, int_in, tensor_split
from hybrimoe.envs import PREFETCH_LAYERS, progress_on
from hybrimoe.model.facts import MODEL_FACTS, ModelFacts, facts_from_gguf
from hybrimoe.outputs import check_output, write_text
from hybrimoe.policy.budget import parse_budget
from hybrimoe.policy.cost_model import load_cost_model
from hybrimoe.policy.hardware import disk_names, hardware_names, load_disk, load_hardware
from hybrimoe.policy.presets import RAM_PRESETS, SYSTEM_PRESETS, ram_preset, system_preset
from hybrimoe.sim.plots import PLOT_FILES, write_plots
from hybrimoe.sim.simulator import DEFAULT_DISK, TS_NCMOE, Setup, cache_hit_rates, format_table
from hybrimoe.sim.speculative import MAX_DRAFT
from hybrimoe.traces.format import RoutingTrace, default_trace_path, load_trace

HELP = "trace-driven comparison of expert placement policies"
#: cache sizes (fractions of all routed-expert bytes) of the hit-rate plot
PLOT_CACHE_FRACTIONS = (0.1, 0.25, 0.5, 0.75)
DEFAULT_POLICIES = ("hybrimoe", "hybrimoe-lru", "ktransformers", "hot-set", "upstream-ncmoe", "gpu-on-demand",
                    "belady", "oracle")
#: the GPU-tier presets --moe-ram-cache compares the RAM presets under when --policies is not given
DEFAULT_RAM_TIER_POLICIES = ("hybrimoe",)


def presets_help() -> str:
    """One line per system preset (name: what it does; source), for ``--policies``' help."""
    return "; ".join(f"{n}: {s['about']}" for n, s in SYSTEM_PRESETS.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``simulate`` options to ``parser``."""
    parser.add_argument("--trace", default=None, help="routing trace .npz (default: $HYBRIMOE_TRACE or "
                                                      "../shared/traces/dsv2lite_dev.npz)")
    parser.add_argument("-m", "--model", default=None, metavar="MODEL.gguf",
                        help="the traced model's GGUF file: model facts (expert bytes per layer, non-expert sizes) "
                             "from its tensors; its MoE layers, experts and top-k must match the trace's")
    parser.add_argument("--model-facts", default=None, metavar="NAME",
                        help=f"built-in model facts ({', '.join(sorted(MODEL_FACTS))}) instead of a GGUF or the "
                             "facts a trace carries")
    parser.add_argument("--drop-incomplete", action="store_true",
                        help="leave out tokens with an id outside 0..E-1 (e.g. -1: a layer the recorder did not "
                             "reach), a repeated id or a score that is not finite, and print how many")
    parser.add_argument("--hardware", default="paper-a6000",
                        help=f"hardware preset name ({', '.join(hardware_names())}) or a preset .json path")
    parser.add_argument("--cost-model", default=None, help="a calibrated cost-model JSON (overrides the preset's "
                                                           "derived planner costs)")
    parser.add_argument("--moe-cache", default="25%", help="GPU expert-cache budget: '25%%' of all routed-expert "
                                                           "bytes, bytes, or e.g. '3GiB'")
    parser.add_argument("--devices", type=POSITIVE, default=None, metavar="N",
                        help="GPUs, each with its own expert cache and the layers llama.cpp's layer split gives it "
                             "(default: the hardware's gpu_count, else 1); --moe-cache is then each GPU's budget "
                             f"('25%%': of its layers' experts); policy {TS_NCMOE}: upstream -ts with the best "
                             "--n-cpu-moe")
    parser.add_argument("--streams", type=POSITIVE, default=1, metavar="N",
                        help="decode N requests at once in one batch per step (continuous batching, llama-server's "
                             "-np N): tokens/s is the aggregate, TPOT each stream's (decode only; default 1)")
    parser.add_argument("--draft", type=int_in(0, MAX_DRAFT), default=0, metavar="K",
                        help="speculative decoding: each step verifies the last accepted token and K drafted ones in "
                             f"one ubatch (decode only; 0: none; at most {MAX_DRAFT}). tokens/s and TPOT count the "
                             "tokens emitted; --max-tokens and --max-prompts count the rows verified and the steps")
    parser.add_argument("--acceptance", default=None, metavar="A|FILE",
                        help="with --draft: the probability that the model accepts a draft (each in order until the "
                             "first rejection; default 0.7), or a file of a recorded run's accepted drafts per step "
                             "(integers; .npy or text)")
    parser.add_argument("--draft-cost-ms", type=float_in(0.0, 100000.0), default=0.0, metavar="MS",
                        help="with --draft: the drafter's milliseconds per drafted token, added to each step "
                             "(default 0: a multi-token-prediction head counted as free)")
    parser.add_argument("--tensor-split", type=tensor_split, default=None, metavar="N0,N1,...",
                        help="proportions of the layers per GPU, as llama.cpp's -ts (default: equal)")
    parser.add_argument("--moe-ram-cache", default=None, metavar="BUDGET",
                        help="host RAM for routed experts, for a model larger than RAM: '25%%' of all routed-expert "
                             "bytes, '12GiB' or bytes (as run's --moe-ram-cache); the experts in neither cache are "
                             "read from disk (--disk). Unset: every expert in RAM")
    parser.add_argument("--disk", default=None, metavar="NAME|FILE",
                        help=f"the disk under the RAM tier: {', '.join(disk_names())} or a disk JSON file "
                             f"(default {DEFAULT_DISK}; only with --moe-ram-cache)")
    parser.add_argument("--ram-policies", default=",".join(RAM_PRESETS),
                        help="RAM-tier presets to compare with --moe-ram-cache, each with every --policies preset: "
                             + "; ".join(f"{n}: {s['about']}" for n, s in RAM_PRESETS.items()))
    parser.add_argument("--stage", choices=("decode", "prefill"), default="decode",
                        help="decode: one token per step (the trace's decode-phase tokens, or all of them); prefill: "
                             "each prompt in ubatches of --ubatch tokens (default: decode)")
    parser.add_argument("--policies", default=None,
                        help=f"comma-separated system presets (default: {','.join(DEFAULT_POLICIES)}; with "
                             f"--moe-ram-cache {','.join(DEFAULT_RAM_TIER_POLICIES)}). " +
                             presets_help().replace("%", "%%") +
                             ". Presets and sources: hybrimoe.policy.presets.SYSTEM_PRESETS")
    parser.add_argument("--json", default=None, help="write the records to this JSON file")
    parser.add_argument("--plot", default=None, help="write PNG plots to this directory")
    parser.add_argument("--force", action="store_true", help="replace an existing --json file and existing plots")
    parser.add_argument("--max-tokens", type=COUNT, default=20000,
                        help="stop each run after about this many tokens (0 = all; prefill stops at a prompt end)")
    parser.add_argument("--max-prompts", type=COUNT, default=0, help="use at most this many evaluation prompts")
    parser.add_argument("--ubatch", type=POSITIVE, default=512, help="prefill ubatch size, tokens")
    parser.add_argument("--prefetch-depth", type=COUNT, default=PREFETCH_LAYERS,
                        help="D, MoE layers predicted ahead (default %(default)s)")
    parser.add_argument("--recall", default=",".join(map(str, _core.DEFAULT_PREDICTOR_RECALL)),
                        help="predictor recall per distance 1..D")
    parser.add_argument("--profile-fraction", type=FRACTION, default=0.2,
                        help="leading fraction of prompts used only to profile expert frequencies")
    parser.add_argument("--seed", type=SEED, default=1, help="seed of the truth model and the predictor")
    parser.add_argument("--hit-rates", action="store_true",
                        help="also replay the cache policies alone (mrs, lru, lfu, reuse, belady) and print hit "
                             "rates")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _positive_recall(text: str, depth: int) -> list[float]:
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ValueError(f"--recall must be comma-separated numbers, got {text!r}") from e
    if any(not (0.0 <= v <= 1.0) for v in vals):
        raise ValueError(f"--recall values must be within 0..1, got {text!r}")
    if len(vals) < depth:
        raise ValueError(f"--recall needs {depth} values (one per distance up to --prefetch-depth), got {len(vals)}")
    return vals


def _trace_arg(args):
    """The command's trace: ``--trace``, else :func:`hybrimoe.traces.format.default_trace_path`. FileNotFoundError
    naming
    ``--trace`` and ``$HYBRIMOE_TRACE`` when no trace was given and the default is not there (it is looked up from
    the current directory, so an installed package run elsewhere does not find the checkout's)."""
    if args.trace:
        return args.trace
    path = default_trace_path()
    if not path.exists():
        raise FileNotFoundError(f"no routing trace given, and the default {path} is not there: pass --trace "
                                "FILE.npz or set HYBRIMOE_TRACE (the default is shared/traces/dsv2lite_dev.npz "
                                "looked up from the current directory and its parents)")
    return path


def _check_outputs(json_path, plot_dir, force: bool = False, inputs=()) -> None:
    """Fail before a long run, not after it, when an output cannot be written.

    Args:
        json_path, plot_dir: the ``--json`` file and the ``--plot`` directory (None: not asked for).
        force: replace existing outputs. inputs: ``(option, path)`` pairs of the command's input files.

    Raises:
        ValueError: the JSON file or a plot file is an input, exists without ``force`` or cannot be written
            (:func:`hybrimoe.outputs.check_output`); the plot path is an existing file or cannot be created.
    """
    if json_path:
        check_output(json_path, "--json", force=force, inputs=inputs)
    if plot_dir:
        d = Path(plot_dir)
        if d.exists() and not d.is_dir():
            raise ValueError(f"--plot {d}: exists and is not a directory")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--plot {d}: cannot create the directory: {e.strerror}") from None
        if not os.access(d, os.W_OK):
            raise ValueError(f"--plot {d}: cannot write there")
        for name in PLOT_FILES:
            check_output(d / name, "--plot", force=force, inputs=list(inputs) + [("--json", json_path)])


def load_inputs(args) -> tuple[RoutingTrace, Optional[ModelFacts], str, int, list]:
    """(trace, model facts or None for the trace's own, where the facts came from, incomplete tokens dropped,
    notes to print) from the command's ``--trace``, ``-m``, ``--model-facts`` and ``--drop-incomplete``.

    With ``-m`` the GGUF's (MoE layers, experts, top-k) must be the trace's, and its expert bytes per layer replace
    the trace's (the model named is the one simulated; a note says when they differ).

    Raises:
        FileNotFoundError: a missing trace or GGUF.
        ValueError: both ``-m`` and ``--model-facts``; an unknown facts name; a bad GGUF or trace; a GGUF of another
            shape (both shapes given); an incomplete token without ``--drop-incomplete``; no token left with it.
    """
    gguf_path, name = args.model, args.model_facts
    if gguf_path and name:
        raise ValueError("give -m MODEL.gguf or --model-facts NAME, not both")
    if name is not None and name not in MODEL_FACTS:
        raise ValueError(f"unknown model facts '{name}' (known: {', '.join(sorted(MODEL_FACTS))})")
    facts, source = None, ""
    if gguf_path:
        if gguf_path in MODEL_FACTS and not Path(gguf_path).exists():
            raise ValueError(f"-m/--model takes the model's GGUF file; for built-in facts give --model-facts "
                             f"{gguf_path}")
        facts, source = facts_from_gguf(gguf_path), f"read from {gguf_path} (-m)"
    elif name:
        facts, source = MODEL_FACTS[name], f"built-in model facts '{name}' (--model-facts)"
    trace = load_trace(_trace_arg(args), model=name, facts=facts if gguf_path else None,
                       check_tokens=not args.drop_incomplete)
    notes = []
    if name:
        trace.check_shape(MODEL_FACTS[name], f"the built-in model facts '{name}'")
    if gguf_path:
        trace.check_shape(facts, f"the model {gguf_path}")
        own = facts.per_layer_expert_bytes()
        if not np.allclose(trace.expert_bytes, own, rtol=1e-9, atol=0.0):
            notes.append(f"expert bytes per layer from {gguf_path}, mean {own.mean():.0f}; the trace's differ (mean "
                         f"{np.mean(trace.expert_bytes):.0f}: recorded with another quant?)")
        trace = dataclasses.replace(trace, expert_bytes=own)
    n_dropped = 0
    if args.drop_incomplete:
        trace, n_dropped = trace.drop_incomplete()
        notes.append(f"dropped {n_dropped} incomplete token(s) (ids outside 0..{trace.num_experts - 1}, repeated "
                     f"ids or scores not finite); {trace.n_tokens} left")
        if trace.n_tokens == 0:
            raise ValueError(f"--drop-incomplete left no tokens of the {n_dropped} in {trace.path or 'the trace'}")
    return trace, facts, source, n_dropped, notes


def _ram_names(args) -> list:
    """The RAM-tier presets of ``--ram-policies`` (checked), or [] without ``--moe-ram-cache``.

    Raises:
        ValueError: an empty list or an unknown preset, or ``--ram-policies`` given without ``--moe-ram-cache``.
    """
    names = [p.strip() for p in str(args.ram_policies).split(",") if p.strip()]
    if args.moe_ram_cache is None:
        if args.ram_policies != ",".join(RAM_PRESETS):
            raise ValueError("--ram-policies needs --moe-ram-cache (without a RAM budget every expert is in RAM)")
        return []
    if not names:
        raise ValueError("--ram-policies is empty")
    for n in names:
        ram_preset(n)
    return names


def _setup_maker(args, names: list):
    """Checks the flags, then the inputs (the flags first: a typo in ``--hardware`` is named even where the trace is
    missing), and returns ``(make_setup(budget) -> Setup, the first Setup, notes to print)``.

    Raises:
        ValueError, FileNotFoundError: naming the flag or input at fault.
    """
    if not names:
        raise ValueError("--policies is empty")
    for n in names:
        if n != TS_NCMOE:
            system_preset(n)
    if args.streams > 1 and args.stage != "decode":
        raise ValueError(f"--streams {args.streams}: streams are concurrent decode streams; give --stage decode")
    acceptance = _acceptance(args)
    if "," in str(args.moe_cache):
        raise ValueError(f"--moe-cache {args.moe_cache}: simulate gives every GPU the same budget (a share of its "
                         "own layers' experts, or a size each); a list per GPU is run's and serve's")
    ram_names = _ram_names(args)
    recall = _positive_recall(args.recall, args.prefetch_depth)
    hw = load_hardware(args.hardware)
    n_gpus = args.devices or int(hw.facts.get("gpu_count", 1))
    if TS_NCMOE in names and n_gpus < 2:
        raise ValueError(f"policy {TS_NCMOE} is upstream's layer split over several GPUs; {hw.name} has one: give "
                         f"--devices 2 or more, a hardware file with several (2x-rtx3090, 4x-rtx3090), or use "
                         "upstream-ncmoe")
    cm = load_cost_model(args.cost_model) if args.cost_model else None
    parse_budget(args.moe_cache, 1.0, 0.0)  # its syntax and range, before the trace gives the totals
    if args.moe_ram_cache is not None:
        parse_budget(args.moe_ram_cache, 1.0, 0.0)
        load_disk(args.disk or DEFAULT_DISK)
    elif args.disk is not None:
        raise ValueError("--disk needs --moe-ram-cache (without a RAM budget every expert is in RAM)")
    del ram_names
    _check_outputs(args.json, args.plot, args.force,
                   [("--trace", args.trace or default_trace_path()), ("-m", args.model),
                    ("--cost-model", args.cost_model),
                    ("--hardware", args.hardware if args.hardware and Path(args.hardware).is_file() else None)])
    trace, facts, source, n_dropped, notes = load_inputs(args)
    if args.devices and args.devices != int(hw.facts.get("gpu_count", 1)):
        notes.append(f"{args.devices} GPUs of {hw.name}'s kind (its file says {int(hw.facts.get('gpu_count', 1))}), "
                     "each with its own link" + (" (shared)" if hw.facts.get("gpus_per_link", 1) > 1 else ""))

    def make_setup(budget_spec) -> Setup:
        return Setup(trace, hw, budget_spec, args.stage, cost_model=cm, max_tokens=args.max_tokens,
                     max_prompts=args.max_prompts, ubatch=args.ubatch, prefetch_depth=args.prefetch_depth,
                     recall=recall, profile_fraction=args.profile_fraction, seed=args.seed, facts=facts,
                     facts_source=source, n_dropped=n_dropped, ram_cache=args.moe_ram_cache, disk=args.disk,
                     devices=args.devices, tensor_split=args.tensor_split, streams=args.streams,
                     draft=args.draft, acceptance=acceptance, draft_cost_s=args.draft_cost_ms / 1e3)

    return make_setup, make_setup(args.moe_cache), notes


def _acceptance(args):
    """``--acceptance`` as :class:`Setup` takes it (a probability, or a recorded run's counts), checked with
    ``--draft``; ValueError naming the flag."""
    from hybrimoe.sim.speculative import optional_counts

    if not args.draft:
        if args.draft_cost_ms or args.acceptance is not None:
            raise ValueError("--acceptance and --draft-cost-ms need --draft K (speculative decoding)")
        return 0.7
    if args.stage != "decode" or args.streams > 1:
        raise ValueError(f"--draft {args.draft}: speculative decoding verifies one stream's drafts; give --stage "
                         "decode and no --streams")
    if args.acceptance is None:
        return 0.7
    try:
        a = float(args.acceptance)
    except ValueError:
        if not Path(args.acceptance).is_file():
            raise ValueError(f"--acceptance {args.acceptance!r}: neither a probability nor a file of accepted-draft "
                             "counts") from None
        counts = optional_counts(args.acceptance)
        if counts.min() < 0 or counts.max() > args.draft:
            raise ValueError(f"--acceptance {args.acceptance}: accepted-draft counts must be in [0, --draft "
                             f"{args.draft}], got {int(counts.min())}..{int(counts.max())}")
        return counts
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"--acceptance {args.acceptance}: a probability must be in [0, 1]")
    return a


def _report(args, setup: Setup, records: list) -> None:
    """Prints the table, the assumptions and (``--hit-rates``) the cache-only hit rates."""
    ram = (f" | RAM {args.moe_ram_cache} ({setup.ram_budget / 1e9:.2f} GB), disk {setup.disk.name}"
           if setup.ram_budget is not None else "")
    per = "/".join(str(setup.layer_device.count(d)) for d in range(setup.n_devices))
    gpus = f" | {setup.n_devices} GPUs, MoE layers {per}, cache {args.moe_cache} each" if setup.n_devices > 1 else ""
    if setup.streams > 1:
        gpus += f" | {setup.streams} streams per step (tokens/s in all, TPOT per stream)"
    if setup.draft:
        per = records[0]["tokens_per_step"] if records else 0.0
        gpus += f" | {setup.draft} drafts per step, {per:.2f} tokens emitted per step"
    print(f"hybrimoe simulate: {setup.trace.path or 'trace'} | {setup.hw.name}{gpus} | cache {args.moe_cache} "
          f"({setup.budget / 1e9:.2f} GB in all){ram} | {args.stage} | "
          f"{'steps' if setup.streams > 1 or setup.draft else 'prompts'} {setup.first}..{setup.end} | "
          f"{records[0]['tokens'] if records else 0} tokens")
    print(format_table(records))
    a = setup.assumptions(records[0]["policy"])
    print(f"assumptions: predictor recall {setup.recall} (oracle: 1.0); router scores: {a['router_scores']}; "
          f"truth: {a['truth_model']}; {a['stage_model']}; model facts {a['model_facts']}"
          + (f"; partial trace: {a['partial_trace']}" if setup.trace.partial else ""))
    if args.hit_rates:
        hr = cache_hit_rates(setup)
        print("cache-only replay hit rates: " + ", ".join(f"{k} {v['hit_rate']:.3f}" for k, v in hr.items()))
        for r in records:
            r["cache_replay_hit_rates"] = hr


def _plots(args, make_setup, setup: Setup, records: list, names: list) -> None:
    """``--plot``: hit rates and whole simulations of every policy asked for at each plotted cache size."""
    rates = {f: cache_hit_rates(setup, budget=f * setup.total_bytes) for f in PLOT_CACHE_FRACTIONS}
    speeds = {}
    for f in PLOT_CACHE_FRACTIONS:
        at = make_setup(f"{100 * f:g}%")
        speeds[f] = {n: at.run(n)["tokens_per_s"] for n in names}
    out = write_plots(setup, records, Path(args.plot), rates, speeds)
    print("plots: " + ", ".join(str(p) for p in out))


def run(args: argparse.Namespace) -> int:
    """Runs ``hybrimoe simulate``; returns the exit status (0 ok, 2 bad input)."""
    default = DEFAULT_RAM_TIER_POLICIES if args.moe_ram_cache is not None else DEFAULT_POLICIES
    names = [p.strip() for p in str(args.policies or ",".join(default)).split(",") if p.strip()]
    try:
        make_setup, setup, notes = _setup_maker(args, names)
        ram_names = _ram_names(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"hybrimoe simulate: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"hybrimoe simulate: {note}")
    runs = [(n, r) for n in names for r in (ram_names or [None])]
    bar = tqdm(runs, desc=f"simulate {args.stage}", unit="run", file=sys.stderr,
               disable=args.no_progress or not progress_on())
    records = []
    for n, r in bar:
        bar.set_postfix_str(n if r is None else f"{n}/{r}")
        records.append(setup.run(n, ram=r))
    bar.close()
    _report(args, setup, records)
    if args.json:
        write_text(args.json, json.dumps(records, indent=1) + "\n")
    if args.plot:
        _plots(args, make_setup, setup, records, names)
    return 0
