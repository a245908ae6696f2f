"""Overhead benchmark of the hybrid CPU+GPU MoE engine against upstream llama.cpp: two figures.

1. CPU-only overhead. Upstream CPU-only (``Llama(model, n_gpu_layers=0, no_repack=True)``) against the engine
   attached with nothing cached (``moe_cache=0``: every routed expert still runs on ggml's CPU kernels, through
   the engine's plan / wait / combine ops), same threads, same model. Figures: prompt tokens/s (one ubatch of
   ``--prompt`` tokens) and decode tokens/s (``--decode`` greedy tokens after it). Target: overhead < 5 %.
2. Per-layer plumbing cost with the RPC "GPU" stand-in (``hybrimoe.runtime.rpc.RPCServer``: a ggml-rpc-server on
   127.0.0.1 whose memory is reached only through RPC; ``n_gpu_layers=-1``). Upstream ``-ot exps=CPU``
   (attention on the device, experts in host memory, ``no_repack``) against the engine with
   (a) ``moe_cache=0``, (b) ``moe_cache="25%"`` with ``moe_policy="hybrimoe"``, (c) ``moe_cache="25%"`` with
   ``moe_policy="gpu-on-demand"``. Figure: decode ms/token and the difference to upstream converted to
   microseconds per MoE layer per token; plus the engine's own breakdown (``moe_stats()["engine"]["layers"]``:
   plan_s, wait_s, layer_s summed over the MoE layers and divided by the runs, i.e. mean us per MoE layer run),
   cache hit rate and bytes copied to the device per decode token. Each configuration gets its own RPC server
   (a server serves one client at a time), all with the same thread count.

Model: a synthetic tiny-but-not-trivial qwen3moe GGUF (``hybrimoe.tiny.make_tiny_model``: 6 layers, n_embd 512,
32 experts of width 512, top-4; routed experts are ~3/4 of the weights read per token) in Q8_0 and Q4_K_M,
written once to ``$HYBRIMOE_CACHE_DIR/models`` (default ``~/.cache/hybrimoe/models``).

Method. All configurations of a part are loaded side by side (own contexts), warmed up once (8 decode tokens, not
kept), then measured over ``--reps`` repetitions. In repetition i every configuration evaluates prompt i (seeded
random words; the order rotates between repetitions), then they decode greedily *token by token in turn*
(A B C A B C ...), so that drift and the other processes' load hit them alike at millisecond scale. Greedy
decoding (argmax of the logits) means every configuration should compute the same tokens (the "same tokens"
column checks this against upstream). Engine counters are reset after each prompt, so they cover decode only;
the expert cache itself stays warm across repetitions. Timings:
  - ``perf``: llama.cpp's own context timer (``llama_perf_context``: from the start of ``llama_decode`` to
    ``llama_synchronize``, which the benchmark calls after every ``Llama.eval``; graph compute only, no Python).
    This is the primary figure: it excludes llama-cpp-python's per-call Python work (the same for every
    configuration, but noise). Note that ``Llama.eval`` alone does not synchronise (llama-cpp-python no longer
    reads the logits there): without the explicit ``llama_synchronize`` each decode's compute would be timed
    as part of the next one (and the prompt's as part of the first decode).
  - ``wall``: ``time.perf_counter`` around ``Llama.eval`` (Python included), printed for comparison.
Ratios are taken per repetition and summarised by their median and min..max over repetitions; "token median"
columns use each repetition's median per-token time instead of the mean (robust to preemption spikes).

Reading it. Part 1: "decode x" is engine tokens/s / upstream tokens/s (1.00 = no overhead; overhead = 1 - x).
Part 2: "d us/layer" = (engine ms/token - upstream ms/token) / MoE layers, per token: the engine's cost (a) or
saving (negative) per MoE layer. On the RPC stand-in the "GPU" is one CPU thread behind a socket, so (b)/(c)
measure plumbing and transfer mechanics, not a real GPU's speed-up. Over RPC every tensor that crosses a
backend split is one synchronous socket round trip (~0.1 ms here), so (a)'s cost is dominated by how many
tensors the engine's CPU split reads from the device (``GGML_SCHED_DEBUG=1`` lists them) rather than by its
plan/wait ops (their own time is the "plan"/"wait" columns). The machine is shared and has 2 cores: compare
only within one run.

Usage::

    python3 bench/bench_engine.py [--quick] [--json OUT] [--threads N] [--reps N] [--part 1|2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import hybrimoe  # noqa: E402  (the installed package, before llama_cpp: one libllama per process)
from hybrimoe.runtime.benchmark import Config, interleave, med_spread, prompts  # noqa: E402,F401  (shared with hybrimoe bench)

MODEL = dict(arch="qwen3moe", n_layer=6, n_embd=512, n_ff_exp=512, n_expert=32, n_expert_used=4, n_head=8)
QUANTS = ("Q8_0", "Q4_K_M")
ENGINE_CONFIGS = (  # part 2: (label, Llama kwargs on top of rpc_servers / n_gpu_layers=-1)
    ("upstream -ot exps=CPU", dict(tensor_buft_overrides="exps=CPU", no_repack=True)),
    ("(a) engine moe_cache=0", dict(moe_cache=0)),
    ("(b) engine 25% hybrimoe", dict(moe_cache="25%", moe_policy="hybrimoe")),
    ("(c) engine 25% gpu-on-demand", dict(moe_cache="25%", moe_policy="gpu-on-demand")),
)


# ----------------------------------------------------------------------------------------------------------
# set-up
# ----------------------------------------------------------------------------------------------------------

def model_path(quant: str) -> Path:
    """The benchmark model for ``quant``, written on first use into the hybrimoe cache directory."""
    from hybrimoe.envs import cache_dir
    from hybrimoe.tiny import make_tiny_model

    m = MODEL
    name = (f"bench-engine-{m['arch']}-L{m['n_layer']}-D{m['n_embd']}-F{m['n_ff_exp']}-E{m['n_expert']}"
            f"-k{m['n_expert_used']}-{quant.lower()}.gguf")
    path = cache_dir() / "models" / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.gguf")
        try:
            print(f"writing {path} ...", file=sys.stderr, flush=True)
            make_tiny_model(tmp, seed=0, quant=quant, **m)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def same_tokens(c: Config, ref: Config) -> str:
    n = sum(a["tokens"] == b["tokens"] for a, b in zip(c.reps, ref.reps))
    return f"{n}/{len(c.reps)}"


def summarize_part1(quant: str, base: Config, eng: Config, clock: str) -> dict:
    out = {}
    for phase, ntok in (("prompt", "n_prompt"), ("decode", "n_decode")):
        key = f"{phase}_{clock}_s"
        tps_b = [r[ntok] / r[key] for r in base.reps]
        tps_e = [r[ntok] / r[key] for r in eng.reps]
        ratio = [e / b for e, b in zip(tps_e, tps_b)]
        out[phase] = dict(upstream_tps=tps_b, engine_tps=tps_e, ratio=ratio,
                          median_ratio=statistics.median(ratio),
                          overhead_pct=100.0 * (1.0 - statistics.median(ratio)))
    # robust to preemption spikes: per repetition, median per-token time upstream / engine
    tok = [statistics.median(b[f"step_{clock}_s"]) / statistics.median(e[f"step_{clock}_s"])
           for b, e in zip(base.reps, eng.reps)]
    out["decode"]["token_median_ratio"] = tok
    out["decode"]["token_median_overhead_pct"] = 100.0 * (1.0 - statistics.median(tok))
    return out


def part1(args) -> dict:
    res = {}
    print("\n## 1. CPU-only overhead: upstream CPU-only vs engine moe_cache=0 "
          f"(threads {args.threads}, prompt {args.prompt} tokens, decode {args.decode} tokens, {args.reps} reps)\n")
    rows = []
    for quant in args.quants:
        path = model_path(quant)
        n_ctx = args.prompt + args.decode + 16
        base = Config("upstream CPU-only", path, n_ctx, args.threads, n_gpu_layers=0, no_repack=True)
        eng = Config("engine moe_cache=0", path, n_ctx, args.threads, n_gpu_layers=0, moe_cache=0)
        try:
            if eng.skipped:
                print(f"WARNING: {quant}: layers not on the engine: {eng.skipped}", file=sys.stderr)
            interleave([base, eng], args.reps, args.prompt, args.decode, f"part 1 {quant}")
            q = {clock: summarize_part1(quant, base, eng, clock) for clock in ("perf", "wall")}
            q["same_tokens"] = same_tokens(eng, base)
            q["engine_counters"] = eng.engine_acc
            q["raw"] = {"upstream": base.reps, "engine": eng.reps}
            res[quant] = q
            for clock in ("perf", "wall"):
                s = q[clock]
                rows.append((quant, clock, med_spread(s["prompt"]["upstream_tps"], "{:.0f}"),
                             med_spread(s["prompt"]["engine_tps"], "{:.0f}"),
                             med_spread(s["prompt"]["ratio"], "{:.3f}"),
                             med_spread(s["decode"]["upstream_tps"]), med_spread(s["decode"]["engine_tps"]),
                             med_spread(s["decode"]["ratio"], "{:.3f}"),
                             f"{s['decode']['overhead_pct']:+.1f} %",
                             med_spread(s["decode"]["token_median_ratio"], "{:.3f}"),
                             f"{s['decode']['token_median_overhead_pct']:+.1f} %", q["same_tokens"]))
        finally:
            base.close()
            eng.close()
    print("| model | clock | prompt tok/s upstream | prompt tok/s engine | prompt x | decode tok/s upstream "
          "| decode tok/s engine | decode x | decode overhead | decode x (token median) | overhead (token median) "
          "| same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print("\nmedian (min..max) over repetitions; x = engine/upstream tokens/s per repetition; overhead = 1 - median x "
          "(target < 5 %); token median: per repetition, upstream/engine median per-token time. perf = llama_perf_context (decode compute only; primary), wall = perf_counter around "
          "Llama.eval.")
    return res


def part2(args) -> dict:
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.rpc import RPCServer

    # connect + handshake deadline of the RPC client (patch 0003, default 5 s): generous on a loaded 2-core machine
    os.environ.setdefault("HYBRIMOE_RPC_TIMEOUT_S", "30")
    res = {}
    print(f"\n## 2. Per-layer cost with the RPC stand-in (ggml-rpc-server threads {args.rpc_threads}, client threads "
          f"{args.threads}, -ngl -1, prompt {args.prompt}, decode {args.decode} tokens, {args.reps} reps)\n")
    print("| model | config | prompt ms (perf) | decode ms/token (perf) | (wall) | d us/MoE layer/token | "
          "(token median) | plan us/layer | wait us/layer | layer_s us/layer | hit rate | GPU expert share | MiB H2D/token | "
          "same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for quant in args.quants:
        rows = []
        path = model_path(quant)
        facts = engine_facts(path)
        n_moe = len(facts.moe_layers)
        n_ctx = args.prompt + args.decode + 16
        servers, configs = [], []
        try:
            for label, kw in ENGINE_CONFIGS:
                for attempt in (1, 2):  # a loaded machine can miss the RPC connect deadline: one retry
                    srv = RPCServer(threads=args.rpc_threads).start()
                    servers.append(srv)
                    try:
                        configs.append(Config(label, path, n_ctx, args.threads, rpc_servers=srv.endpoint,
                                              n_gpu_layers=-1, **kw))
                        break
                    except ValueError as e:
                        print(f"WARNING: {quant} {label}: load attempt {attempt} failed: {e}; server log tail: "
                              f"{srv.log()[-400:]!r}", file=sys.stderr)
                        srv.stop()
                        if attempt == 2:
                            raise
                if configs[-1].skipped:
                    print(f"WARNING: {quant} {label}: layers not on the engine: {configs[-1].skipped}",
                          file=sys.stderr)
            interleave(configs, args.reps, args.prompt, args.decode, f"part 2 {quant}")
            base = configs[0]
            q = {"n_moe_layers": n_moe, "configs": {}}
            ms_b = [1e3 * r["decode_perf_s"] / r["n_decode"] for r in base.reps]
            for c in configs:
                ms = [1e3 * r["decode_perf_s"] / r["n_decode"] for r in c.reps]
                ms_wall = [1e3 * r["decode_wall_s"] / r["n_decode"] for r in c.reps]
                d_us_layer = [1e3 * (m - b) / n_moe for m, b in zip(ms, ms_b)]
                d_us_tokmed = [1e6 * (statistics.median(r["step_perf_s"]) - statistics.median(rb["step_perf_s"]))
                               / n_moe for r, rb in zip(c.reps, base.reps)]
                pr_ms = [1e3 * r["prompt_perf_s"] for r in c.reps]
                entry = dict(decode_ms_per_token=ms, decode_wall_ms_per_token=ms_wall, prompt_ms=pr_ms,
                             delta_us_per_layer=d_us_layer, delta_us_per_layer_token_median=d_us_tokmed,
                             same_tokens=same_tokens(c, base), raw=c.reps,
                             kwargs={k: str(v) for k, v in c.kw.items()})
                eng_cols = ["-"] * 6
                e = c.engine_acc
                if e:
                    runs = max(1, e["runs"])
                    n_tok = sum(r["n_decode"] for r in c.reps)
                    entry["engine"] = dict(
                        e, plan_us_per_layer=1e6 * e["plan_s"] / runs, wait_us_per_layer=1e6 * e["wait_s"] / runs,
                        layer_us_per_layer=1e6 * e["layer_s"] / runs,
                        hit_rate=(e["hits"] / e["accesses"]) if e["accesses"] else float("nan"),
                        mib_copied_per_token=e["bytes"] / 2**20 / max(1, n_tok),
                        gpu_expert_share=e["gpu_experts"] / max(1, e["gpu_experts"] + e["cpu_experts"]),
                        n_slots=c.llm.moe_engine.n_slots)
                    en = entry["engine"]
                    eng_cols = [f"{en['plan_us_per_layer']:.0f}", f"{en['wait_us_per_layer']:.0f}",
                                f"{en['layer_us_per_layer']:.0f}", f"{en['hit_rate']:.3f}",
                                f"{en['gpu_expert_share']:.2f}", f"{en['mib_copied_per_token']:.2f}"]
                    if e.get("failed"):
                        eng_cols[0] += " FAILED"
                q["configs"][c.label] = entry
                rows.append([quant, c.label, med_spread(pr_ms, "{:.0f}"), med_spread(ms, "{:.2f}"),
                             med_spread(ms_wall, "{:.2f}"), "-" if c is base else med_spread(d_us_layer, "{:+.0f}"),
                             "-" if c is base else med_spread(d_us_tokmed, "{:+.0f}")] + eng_cols +
                            [entry["same_tokens"]])
            res[quant] = q
            for r in rows:
                print("| " + " | ".join(r) + " |", flush=True)
        finally:
            for c in configs:
                c.close()
            for s in servers:
                s.stop()
    print("\nmedian (min..max) over repetitions. d us/MoE layer/token = (config - upstream) decode ms/token / MoE "
          "layers, paired per repetition; token median: the same from each repetition's median per-token time. plan/wait/layer_s: the engine's own timers over the decode phase, summed "
          "over MoE layers / runs (= mean per MoE layer run); hit rate and bytes over the decode phase only (cache "
          "state carries over between repetitions, which use different prompts).")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and tokens, Q8_0 only (< 3 min)")
    ap.add_argument("--json", metavar="OUT", help="write all measurements (per repetition) to OUT")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp CPU threads (both configurations)")
    ap.add_argument("--rpc-threads", type=int, default=1, help="threads of each ggml-rpc-server")
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 15, quick 8)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (one ubatch)")
    ap.add_argument("--decode", type=int, default=None, help="greedy decode tokens (default 128, quick 64)")
    ap.add_argument("--part", choices=("1", "2", "all"), default="all")
    ap.add_argument("--quants", default=None, help=f"comma-separated (default {','.join(QUANTS)}; quick Q8_0)")
    args = ap.parse_args(argv)
    args.reps = args.reps or (8 if args.quick else 15)
    args.decode = args.decode or (64 if args.quick else 128)
    args.quants = args.quants.split(",") if args.quants else (["Q8_0"] if args.quick else list(QUANTS))
    t0 = time.perf_counter()
    print(f"# bench_engine: model {MODEL}, quants {args.quants}, load average "
          f"{os.getloadavg()[0]:.2f} at start")
    out = {"model": MODEL, "args": vars(args)}
    if args.part in ("1", "all"):
        out["part1"] = part1(args)
    if args.part in ("2", "all"):
        out["part2"] = part2(args)
    out["elapsed_s"] = time.perf_counter() - t0
    out["loadavg_end"] = os.getloadavg()
    print(f"\n(elapsed {out['elapsed_s']:.0f} s, load average {out['loadavg_end'][0]:.2f} at the end)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
