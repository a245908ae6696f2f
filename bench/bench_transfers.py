"""Host<->device transfers per MoE layer and ubatch, counted at the device: the RPC server's command tally.

For each configuration a child process loads the model on its own ``ggml-rpc-server`` (hybrimoe's, with the tally
on: ``HYBRIMOE_RPC_STATS``, patch 0004), and runs it a few times, each run its own connection and so its own
tally record: (a) load, warm-up prompt (the engine copies the experts it puts on the GPU), (b) the same plus one
measured prompt of ``-p`` tokens (one ubatch), (c)/(d) the same plus ``n1`` / ``n2`` decoded tokens. Differences
give the transfers of one prompt ubatch ((b) - (a)) and of one decoded token (((d) - (c)) / (n2 - n1)). The same
is done with every layer on the device (``-ngl 99``, no override: no MoE transfer at all), whose figures are
subtracted, and the rest is divided by the MoE layers: per MoE layer and ubatch, device-to-host (GET_TENSOR) and
host-to-device (SET_TENSOR) commands and tensor bytes, graph computes, and (engine) the bytes of expert copies it
queued in that ubatch, which the host-to-device bytes include (none in steady state: every GPU expert stays
resident).

Configurations: upstream ``-ot exps=CPU`` (the same placement as the engine's), and the engine with the forced
GPU share of ``bench_cpu_share.py`` (0 and 0.5 of the pairs, a slot for every expert). ``--python`` runs the
clients with another interpreter (e.g. an older hybrimoe install, for a before/after table); the server is always
this install's (it has the tally). Model as in ``bench_cpu_share.py``; the model's own (random) router decides,
unless ``--replay`` routes by the trace (the ids are then a host input: one device-to-host transfer fewer upstream).

Usage::

    python3 bench/bench_transfers.py [--layers 8] [-p 512] [--python PY] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The client process: argv[1] is bench_cpu_share.py, loaded by its path (its model, replay table and forced-share
# policy), argv[2] the configuration as JSON. hybrimoe is the interpreter's installed package, imported first.
_CHILD = textwrap.dedent("""
    import importlib.util, json, os, subprocess, sys, time
    os.environ.setdefault("HYBRIMOE_AUTO_CALIBRATE", "0")
    import hybrimoe
    from hybrimoe import Llama
    spec = importlib.util.spec_from_file_location("bench_cpu_share", sys.argv[1])
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    from hybrimoe.runtime.rpc import free_port

    cfg = json.loads(sys.argv[2])
    server, stats = cfg["server"], cfg["stats"]

    class A:
        layers = cfg["layers"]; n_prompt = cfg["n_prompt"]; n_gen = cfg["n2"]; trace = cfg["trace"]

    path, table = b.model_and_table(A)
    port = free_port()
    srv = subprocess.Popen([server, "--device", "CPU", "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                           env={**os.environ, "HYBRIMOE_RPC_STATS": stats}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        time.sleep(2)
        kw = dict(n_gpu_layers=99, n_ctx=cfg["n_prompt"] + cfg["n2"] + 16, n_batch=cfg["n_prompt"],
                  n_ubatch=cfg["n_prompt"], n_threads=2, verbose=False,
                  moe_replay=table if cfg["replay"] else None,
                  rpc_servers=f"127.0.0.1:{port}")
        if cfg["mode"] == "upstream":
            kw.update(tensor_buft_overrides="exps=CPU", no_repack=True)
        elif cfg["mode"] == "engine":
            kw.update(moe_cache="100%", moe_prefetch_layers=0, moe_cost_model="rtx4090-desktop",
                      moe_policy={"scheduler": b.forced_share_policy(cfg["share"]), "fill": False})
        prompt = [1 + i % 400 for i in range(cfg["n_prompt"])]
        copies = []
        for run in ("load", "prompt", "n1", "n2"):
            llm = Llama(str(path), **kw)
            llm.eval(prompt)  # warm-up: graphs allocated, the engine's GPU experts copied
            eng = llm.moe_engine
            if eng is not None:
                eng.reset_stats()
            if run != "load":
                llm.reset()
                llm.eval(prompt)
                n = {"prompt": 0, "n1": cfg["n1"], "n2": cfg["n2"]}[run]
                for i in range(n):
                    llm.eval([5 + i % 300])
            copies.append(0.0 if eng is None else sum(s["bytes_demand"] + s["bytes_prefetch"] + s["bytes_fill"]
                                                      for s in eng.layer_stats()))
            llm.close()
            time.sleep(0.5)  # the server writes a connection's record when it ends
    finally:
        time.sleep(1.0)
        srv.terminate()
        srv.wait()
    print("COPIES " + json.dumps(copies))
""")

KEYS = ("d2h_cmds", "d2h_bytes", "h2d_cmds", "h2d_bytes", "graph_computes")


def _tally(rec: dict) -> dict:
    cmds = rec.get("commands", {})
    return dict(d2h_cmds=cmds.get("GET_TENSOR", {}).get("count", 0), d2h_bytes=rec.get("d2h_bytes", 0),
                h2d_cmds=cmds.get("SET_TENSOR", {}).get("count", 0), h2d_bytes=rec.get("h2d_bytes", 0),
                graph_computes=rec.get("graph_computes", 0))


def run_config(args, mode: str, share: float = 0.0, python: str | None = None) -> dict:
    """Per-run tallies of one configuration: {run: {key: value}} plus the engine's expert-copy bytes."""
    from hybrimoe.runtime.rpc import SERVER_BIN, read_stats

    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.jsonl"
        cfg = dict(server=str(SERVER_BIN), stats=str(stats), layers=args.layers, n_prompt=args.n_prompt,
                   n1=args.n1, n2=args.n2, trace=args.trace, mode=mode, share=share, replay=args.replay)
        r = subprocess.run([python or sys.executable, "-c", _CHILD, str(HERE / "bench_cpu_share.py"), json.dumps(cfg)],
                           capture_output=True, text=True, cwd=tmp, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(f"{mode} {share}: child failed: {r.stderr[-3000:]}")
        copies = json.loads(r.stdout.split("COPIES ", 1)[1])
        # the model's connections are the ones that allocated buffers (short device queries get records too)
        recs = [x for x in read_stats(stats) if "ALLOC_BUFFER" in x.get("commands", {})]
    if len(recs) != 4:
        raise RuntimeError(f"{mode} {share}: expected 4 model connections in the tally, got {len(recs)}")
    return dict(runs={k: _tally(x) for k, x in zip(("load", "prompt", "n1", "n2"), recs)}, copies=copies)


def per_layer(c: dict, base: dict, args) -> dict:
    """Per MoE layer: the prompt ubatch and one decoded token, the all-on-device baseline subtracted."""
    n_moe = args.layers - 1
    out = {}
    for key in KEYS:
        def diff(d, a, b_, scale=1.0):
            return (d["runs"][b_][key] - d["runs"][a][key]) / scale
        pp = diff(c, "load", "prompt") - diff(base, "load", "prompt")
        tg = diff(c, "n1", "n2", args.n2 - args.n1) - diff(base, "n1", "n2", args.n2 - args.n1)
        out[f"pp_{key}"] = pp / n_moe
        out[f"tg_{key}"] = tg / n_moe
    out["pp_expert_copy_bytes"] = (c["copies"][1] - c["copies"][0]) / n_moe
    out["tg_expert_copy_bytes"] = (c["copies"][3] - c["copies"][2]) / (args.n2 - args.n1) / n_moe
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("--n1", type=int, default=4)
    p.add_argument("--n2", type=int, default=12)
    p.add_argument("--shares", default="0,0.5")
    p.add_argument("--replay", action="store_true", help="route by the trace (patch 0002): the routing ids are "
                   "then a host input, so upstream brings only the hidden state to the host")
    p.add_argument("--python", default=None, help="interpreter for the clients (another hybrimoe install)")
    p.add_argument("--trace", default=os.environ.get("HYBRIMOE_TRACE") or
                   str(HERE.parents[1] / "shared" / "traces" / "dsv2lite_dev.npz"))
    p.add_argument("--json")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    base = run_config(args, "device", python=args.python)
    rows = [("upstream -ot exps=CPU", run_config(args, "upstream", python=args.python))]
    for s in (float(x) for x in args.shares.split(",")):
        rows.append((f"hybrimoe share {s:g}", run_config(args, "engine", s, python=args.python)))
    print(f"\n{args.layers - 1} MoE layers; per MoE layer: one {args.n_prompt}-token prompt ubatch (pp) and one decoded "
          f"token (tg); counted by the RPC server, the all-on-device run subtracted\n")
    print("| config | pp D2H cmds | pp D2H KiB | pp H2D cmds | pp H2D KiB | pp graphs | tg D2H cmds | tg D2H KiB | "
          "tg H2D cmds | tg H2D KiB | tg graphs |")
    print("|---|" + "---|" * 10)
    results = []
    for label, c in rows:
        r = per_layer(c, base, args)
        results.append(dict(label=label, **r))
        cells = []
        for ph in ("pp", "tg"):
            cells += [f"{r[f'{ph}_d2h_cmds']:.2f}", f"{r[f'{ph}_d2h_bytes'] / 1024:.1f}", f"{r[f'{ph}_h2d_cmds']:.2f}",
                      f"{r[f'{ph}_h2d_bytes'] / 1024:.1f}", f"{r[f'{ph}_graph_computes']:.2f}"]
        print(f"| {label} | " + " | ".join(cells) + " |")
        if r["pp_expert_copy_bytes"] or r["tg_expert_copy_bytes"]:
            print(f"|   (of which expert copies, KiB) | | | | {r['pp_expert_copy_bytes'] / 1024:.1f} | | | | | "
                  f"{r['tg_expert_copy_bytes'] / 1024:.1f} | |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
