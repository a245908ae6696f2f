"""CPU-side expert work of the hybrid engine against the GPU share it is given (prefill and decode).

Question: does the CPU do only the CPU share's work? The engine runs on the RPC stand-in (a ``ggml-rpc-server``
on 127.0.0.1: the "GPU" is another process on this CPU), so the client process's CPU time is the CPU share (plus
the engine's own plan/combine ops and the transfers), and everything the GPU share does is charged to the server.

Model: a DeepSeek-V2-Lite-shaped synthetic Q4_K_M GGUF at full width (``hybrimoe.tiny.make_synthetic_model``:
n_embd 2048, 64 experts of width 1408, top-6, 2 shared experts, MLA attention), ``--layers`` blocks (the first
dense), with routing replayed from the DeepSeek-V2-Lite development trace (a file given with ``--trace`` /
``$HYBRIMOE_TRACE``; its first ``layers - 1`` MoE layers): real activation patterns on random weights.

Configurations, on one RPC server, measured interleaved (each repetition measures each configuration once):

- ``upstream -ot exps=CPU``: attention etc. on the stand-in, every routed expert on the client CPU
  (``n_gpu_layers=99, tensor_buft_overrides="exps=CPU", no_repack=True``);
- ``hybrimoe share S`` for S in ``--shares``: the engine with a slot for every expert (``moe_cache="100%"``, no
  prefetch, no fills) and a test schedule policy that puts experts on the GPU, in expert-id order, until their
  pairs reach the share S of the layer's (token, rank) pairs; the rest runs on the CPU. The warm-up loads the
  GPU experts; measured repetitions find them resident.

Figures per configuration (median over repetitions, min..max): client CPU seconds (``time.process_time``: all
threads of the client) per MoE layer for one ``-p`` token prompt (pp, one ubatch) and per decoded token (tg,
``-n`` greedy tokens after it), the GPU share of pairs the policy assigned, and wall seconds.
The engine's figure is ``cpu_share_cpu_s``: the client process's CPU seconds (all threads) from its plan op's end to
its wait op's start, when only the CPU share's nodes run in the client (the stand-in's server is another process).
The JSON also has ``cpu_share_s`` (wall seconds over the same span; on the stand-in inflated by the server's work on
the same cores) and the user part of the client CPU time (the system part is mostly the socket copies of the
stand-in's transfers, which a GPU's DMA engine does). Targets: share 0 within 10 % of upstream (not slower); share S
within 10 % of (1 - S) x share 0.

The stand-in runs client and server on the same machine. Each gets half the cores by default (``--threads``): with
more, the server's GPU share preempts client threads while the others spin at ggml's barriers, which bills the CPU
share for time it spends waiting (2 cores, 2 threads each: share 0.75 measured 1.29x its target, with 1 thread each
1.05x). Even on separate cores the server's GPU share, running beside the CPU share, competes with it for the
shared cache and memory (1.05x to 1.35x at share 0.75 over three runs on 2 cores), which a real GPU does not: for the
CPU share's own cost run client and server on one core, ``taskset -c 0 python3 bench/bench_cpu_share.py --threads
1`` (they then take turns; share 0.75 measured 1.07x its target, min..max within 6%). OpenMP threads that spin
while they wait (the default wait policy) steal cores from the other process too; both run with
``OMP_WAIT_POLICY=PASSIVE`` here (set unless given).

Usage::

    python3 bench/bench_cpu_share.py [--layers 8] [-p 512] [-n 128] [--reps 8] [--threads N] [--json OUT]
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

import hybrimoe  # noqa: F401  (the installed package, before anything loads llama_cpp: one libllama per process)


def forced_share_policy(share: float):
    """A schedule policy (hybrimoe.SchedulePolicy) that puts experts on the GPU in expert-id order until their
    token loads reach ``share`` of the layer's pairs (the expert that crosses the target goes where the total
    lands closer to it). ``share`` is an attribute: one engine measures every share in turn."""
    from hybrimoe import _core

    class ForcedShare(_core.SchedulePolicy):
        pairs = [0, 0]  # (GPU, all) pairs assigned so far: the share run, also with engines that do not count it

        def name(self):
            return "forced-share"

        def split(self, layer_input, cost):
            loads = list(layer_input.loads)
            order = sorted(range(len(loads)), key=lambda i: layer_input.experts[i])
            target = self.share * sum(loads)
            flags = [0] * len(loads)
            acc = 0
            for i in order:
                if acc + loads[i] / 2.0 > target:
                    break
                flags[i] = 1
                acc += loads[i]
            self.pairs[0] += acc
            self.pairs[1] += sum(loads)
            return flags

    pol = ForcedShare()
    pol.share = share
    return pol


def model_and_table(args):
    """The synthetic model (written once to the cache) and its replay table from the trace."""
    from hybrimoe.traces.routing_replay import routing_replay_table
    from hybrimoe.tiny import make_synthetic_model
    from hybrimoe.traces.format import RoutingTrace, load_trace

    cache = Path(os.environ.get("HYBRIMOE_CACHE_DIR") or Path.home() / ".cache" / "hybrimoe") / "models"
    path = cache / f"synthetic-dsv2lite-q4km-{args.layers}.gguf"
    if not path.exists():
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        make_synthetic_model(path, quant="Q4_K_M", n_layer=args.layers)
    tr = load_trace(args.trace)
    n_moe = args.layers - 1
    cut = RoutingTrace(expert_ids=tr.expert_ids[:, :n_moe].copy(), prompt_offsets=tr.prompt_offsets,
                       num_experts=tr.num_experts, top_k=tr.top_k, expert_bytes=tr.expert_bytes[:n_moe].copy(),
                       n_dense_layers=1, model=tr.model)
    # a long prompt of the trace, so that one ubatch holds one prompt's real routing
    lengths = np.diff(tr.prompt_offsets)
    long = int(np.argmax(lengths >= args.n_prompt + args.n_gen)) if (lengths >= args.n_prompt + args.n_gen).any() \
        else int(np.argmax(lengths))
    start = int(tr.prompt_offsets[long])
    table = routing_replay_table(cut, path)[start:start + args.n_prompt + args.n_gen]
    return path, table


def measure_once(llm, prompt, n_gen, policy=None) -> dict:
    """One repetition: the prompt (pp, one ubatch) from an empty context, then ``n_gen`` decode steps (tg). Returns
    {"pp": {...}, "tg": {...}} of seconds (whole model; per step for tg) and the engine's figures."""
    from hybrimoe._lib import llama_cpp_module

    lc = llama_cpp_module().llama_cpp
    ctx = llm.ctx
    llm.reset()
    eng = llm.moe_engine
    if eng is not None:
        eng.reset_stats()
    if policy is not None:
        policy.pairs[:] = [0, 0]
    c0, w0, u0 = time.process_time(), time.perf_counter(), os.times().user
    llm.eval(prompt)
    lc.llama_synchronize(ctx)
    c1, w1, u1 = time.process_time(), time.perf_counter(), os.times().user
    pp = dict(cpu_s=c1 - c0, user_s=u1 - u0, wall_s=w1 - w0)
    if eng is not None:
        st = eng.layer_stats()
        if policy is not None:
            pp["gpu_share"] = policy.pairs[0] / max(1, policy.pairs[1])
        pp["engine_cpu_share_s"] = sum(s["cpu_share_s"] for s in st)
        pp["engine_cpu_share_cpu_s"] = sum(s["cpu_share_cpu_s"] for s in st)
        eng.reset_stats()
    tok = 0
    c2, w2 = time.process_time(), time.perf_counter()
    for _ in range(n_gen):
        llm.eval([tok])
        lc.llama_synchronize(ctx)
    c3, w3 = time.process_time(), time.perf_counter()
    tg = dict(cpu_s=(c3 - c2) / max(1, n_gen), wall_s=(w3 - w2) / max(1, n_gen))
    if eng is not None:
        st = eng.layer_stats()
        tg["engine_cpu_share_s"] = sum(s["cpu_share_s"] for s in st) / max(1, n_gen)
        tg["engine_cpu_share_cpu_s"] = sum(s["cpu_share_cpu_s"] for s in st) / max(1, n_gen)
    return dict(pp=pp, tg=tg)


def summarise(label, rows, n_moe) -> dict:
    """Median, min and max per MoE layer of each figure over the repetitions ``rows`` (of :func:`measure_once`)."""
    out = {"label": label}
    for phase in ("pp", "tg"):
        for key in ("cpu_s", "user_s", "wall_s", "engine_cpu_share_s", "engine_cpu_share_cpu_s", "gpu_share"):
            xs = [r[phase][key] for r in rows if key in r[phase]]
            if xs:
                per_layer = key != "gpu_share"
                ys = [x / n_moe for x in xs] if per_layer else xs
                out[f"{phase}_{key}{'_per_layer' if per_layer else ''}"] = dict(
                    median=statistics.median(ys), min=min(ys), max=max(ys))
    return out


def run_configs(args) -> list:
    """Measures upstream ``-ot exps=CPU`` and the engine at every share on one RPC server, interleaved: each
    repetition measures every configuration once (upstream, then the shares in order), so that a slow spell of a
    noisy machine falls on all of them alike. Both Llamas stay loaded; the engine has a slot for every expert
    (``moe_cache="100%"``, no prefetch, no fills) and one :func:`forced_share_policy` whose share is set before each
    measurement. Repetition 0 (paging in, graph allocation, the first copies of the GPU experts) is not kept."""
    from hybrimoe import Llama
    from hybrimoe.runtime.rpc import RPCServer

    path, table = model_and_table(args)
    n_moe = args.layers - 1
    common = dict(n_gpu_layers=99, n_ctx=args.n_prompt + args.n_gen + 16, n_batch=args.n_prompt,
                  n_ubatch=args.n_prompt, n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
                  moe_replay=table)
    prompt = [1 + i % 400 for i in range(args.n_prompt)]
    shares = [float(x) for x in args.shares.split(",")]
    policy = forced_share_policy(shares[0])
    labels = ([] if args.no_upstream else ["upstream -ot exps=CPU"]) + [f"hybrimoe share {s:g}" for s in shares]
    rows = {label: [] for label in labels}
    with RPCServer(threads=args.threads) as srv:
        common["rpc_servers"] = srv.endpoint
        up = None if args.no_upstream else Llama(str(path), **common, tensor_buft_overrides="exps=CPU",
                                                  no_repack=True)
        eng = Llama(str(path), **common, moe_cache="100%", moe_prefetch_layers=0, moe_cost_model="rtx4090-desktop",
                    moe_policy={"scheduler": policy, "fill": False})
        try:
            for rep in range(args.reps + 1):
                for label in labels:
                    if label.startswith("upstream"):
                        r = measure_once(up, prompt, args.n_gen)
                    else:
                        policy.share = shares[labels.index(label) - (0 if args.no_upstream else 1)]
                        r = measure_once(eng, prompt, args.n_gen, policy)
                    if rep > 0 or args.reps == 0:
                        rows[label].append(r)
                    print(f"  [{label}] rep {rep}/{args.reps}: pp cpu {r['pp']['cpu_s']:.3f} s, tg cpu "
                          f"{1e3 * r['tg']['cpu_s']:.2f} ms/token", file=sys.stderr, flush=True)
        finally:
            eng.close()
            if up is not None:
                up.close()
    return [summarise(label, rows[label], n_moe) for label in labels]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="blocks (1 dense + layers-1 MoE; default 8)")
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="threads of the client and of the server each (default: half the cores, so that the two "
                        "processes do not share cores)")
    p.add_argument("--shares", default="0,0.25,0.5,0.75,1")
    p.add_argument("--trace", default=os.environ.get("HYBRIMOE_TRACE") or
                   str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "dsv2lite_dev.npz"))
    p.add_argument("--no-upstream", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    os.environ.setdefault("HYBRIMOE_AUTO_CALIBRATE", "0")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    results = run_configs(args)
    n_moe = args.layers - 1
    base = next((r for r in results if r["label"] == "hybrimoe share 0"), None)
    up = next((r for r in results if r["label"].startswith("upstream")), None)
    print(f"\n{n_moe} MoE layers, pp{args.n_prompt} (one ubatch) and tg{args.n_gen}, {args.threads} threads; per MoE "
          f"layer, median (min..max) over {args.reps} reps. Client CPU: all CPU time of the client process (user + "
          "system; the system part is mostly the stand-in's socket copies). CPU share: the engine's process CPU "
          "seconds from its plan op's end to its wait op's start, i.e. the CPU share's nodes alone (upstream: its "
          "client CPU, all of which is its expert work and small transfers). Target: (1 - GPU share) x share 0.\n")
    print("| config | GPU pair share | pp client CPU ms | vs upstream | pp CPU-share CPU ms | vs share 0 | target "
          "| vs target | tg wall ms/token | tg vs upstream |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def med(r, key):
        return r.get(key, {}).get("median", float("nan")) if r else float("nan")

    base_share = med(base, "pp_engine_cpu_share_cpu_s_per_layer")
    for r in results:
        pp = r["pp_cpu_s_per_layer"]
        engine = r["label"].startswith("hybrimoe")
        share = med(r, "pp_gpu_share") if "pp_gpu_share" in r else 0.0
        cs = med(r, "pp_engine_cpu_share_cpu_s_per_layer") if engine else pp["median"]
        cs_lo = r["pp_engine_cpu_share_cpu_s_per_layer"]["min"] if engine else pp["min"]
        cs_hi = r["pp_engine_cpu_share_cpu_s_per_layer"]["max"] if engine else pp["max"]
        rel = cs / base_share
        target = (1 - share) if engine else float("nan")
        vs_target = rel / target if engine and target > 0 else float("nan")
        vs_up = pp["median"] / med(up, "pp_cpu_s_per_layer")
        tg_up = med(r, "tg_wall_s_per_layer") / med(up, "tg_wall_s_per_layer")
        print(f"| {r['label']} | {share:.3f} | {1e3 * pp['median']:.1f} ({1e3 * pp['min']:.1f}..{1e3 * pp['max']:.1f}) "
              f"| {vs_up:.3f} | {1e3 * cs:.1f} ({1e3 * cs_lo:.1f}..{1e3 * cs_hi:.1f}) | {rel:.3f} | "
              f"{'' if not engine else f'{target:.3f}'} | {'' if vs_target != vs_target else f'{vs_target:.3f}'} | "
              f"{1e3 * med(r, 'tg_wall_s_per_layer'):.2f} | {tg_up:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
