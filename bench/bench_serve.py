"""Concurrent clients against the servers, for real: ``hybrimoe serve --parallel N``, ``hybrimoe serve`` one request at
a time (``--parallel 1``), and upstream's own ``llama-server -np N`` (``--llama-server PATH``: built from the pinned
llama.cpp source), on one model, CPU only.

Per server and N: N clients each stream one completion at once (prompts of ``--pp`` tokens' worth of text, different
per client, ``--tg`` new tokens, greedy, the end of generation masked: hybrimoe by ``logit_bias``, llama-server by
``ignore_eos``); aggregate decode tokens/s = all new tokens over the wall time from the first client's first token to
the last client's last; TPOT per request = the time between its first and last token over the tokens between;
median and p95 over the requests. ``-r`` repetitions, interleaved (per repetition every N, at each every server),
the load average before each. The servers' flags beyond these: ``--hybrimoe-args`` and ``--llama-server-args``
(placement, e.g. ``--moe-ram-cache auto``; upstream's defaults otherwise, repacked CPU weights included).

    python3 bench/bench_serve.py -m model.gguf --llama-server ~/llama.cpp/build/bin/llama-server --clients 1,4,8
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

WORDS = ("harbour boat morning robot quiet river stone window garden letter winter bridge lantern orchard market "
         "candle").split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not answer /health")


def start(kind: str, args, n: int):
    """(process, port, extra request fields) of one server."""
    port = _free_port()
    ctx = str(n * (args.pp * 2 + args.tg + 64))
    if kind == "upstream":
        cmd = [args.llama_server, "-m", str(args.model), "-np", str(n), "-c", ctx, "-t", str(args.threads),
               "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.llama_server_args)]
        extra = {"ignore_eos": True}
    else:
        par = n if kind == "hybrimoe-parallel" else 1
        cmd = [sys.executable, "-m", "hybrimoe", "serve", "-m", str(args.model), "--parallel", str(par), "-c",
               str(int(ctx) if par > 1 else int(ctx) // n), "-t", str(args.threads), "--host", "127.0.0.1", "--port",
               str(port), *shlex.split(args.hybrimoe_args)]
        extra = {"logit_bias": args.eog_bias}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    _wait_ready(port, proc)
    return proc, port, extra


def stream(port: int, prompt: str, args, extra: dict, out: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    body = {"prompt": prompt, "max_tokens": args.tg, "temperature": 0.0, "stream": True, **extra}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    stamps = []
    for line in iter(resp.readline, b""):
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("choices") and ev["choices"][0].get("text"):
            stamps.append(time.perf_counter())
    conn.close()
    out.append(stamps)


def one_run(kind: str, args, n: int) -> dict:
    proc, port, extra = start(kind, args, n)
    try:
        prompts = [" ".join(WORDS[(c + i) % len(WORDS)] for i in range(args.pp)) for c in range(n)]
        stream(port, "warm up", args, extra, [])
        outs: list = []
        threads = [threading.Thread(target=stream, args=(port, p, args, extra, outs)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        proc.terminate()
        proc.wait(60)
    first = min(s[0] for s in outs if s)
    last = max(s[-1] for s in outs if s)
    tokens = sum(len(s) for s in outs)
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in outs if len(s) > 1]
    return {"server": kind, "n": n, "tokens": tokens, "decode_tps": tokens / max(last - first, 1e-9),
            "tpot_p50_s": statistics.median(tpot), "tpot_p95_s": sorted(tpot)[max(0, int(0.95 * len(tpot)) - 1)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--llama-server", default=None, help="upstream's llama-server binary (left out without it)")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--pp", type=int, default=64, help="words per prompt (about as many tokens)")
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=1)
    ap.add_argument("--hybrimoe-args", default="")
    ap.add_argument("--llama-server-args", default="")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.model = Path(args.model)
    from hybrimoe import Llama
    from hybrimoe._lib import llama_cpp_module

    lc = llama_cpp_module().llama_cpp
    llm = Llama(str(args.model), vocab_only=True, verbose=False)
    args.eog_bias = {str(t): -100.0 for t in range(llm.n_vocab()) if lc.llama_vocab_is_eog(llm._model.vocab, t)}
    llm.close()
    kinds = ["hybrimoe-parallel", "hybrimoe-one-at-a-time"] + (["upstream"] if args.llama_server else [])
    rows = []
    for rep in range(args.reps):
        for n in [int(x) for x in args.clients.split(",")]:
            for kind in kinds:
                load = os.getloadavg()[0]
                print(f"{kind} N={n} (rep {rep + 1}, load {load:.2f})...", file=sys.stderr, flush=True)
                try:
                    row = one_run(kind, args, n)
                except Exception as e:  # a server that did not start: recorded, the others go on
                    row = {"server": kind, "n": n, "error": re.sub(r"\s+", " ", str(e))[:300]}
                row.update(rep=rep, loadavg=load)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"model {args.model.name}; {args.threads} threads, CPU only; {args.pp}-word prompts, {args.tg} new tokens; "
          f"{args.reps} repetition(s), median (min..max)")
    print("| server | N | decode t/s (aggregate) | TPOT p50 ms | TPOT p95 ms |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        for n in [int(x) for x in args.clients.split(",")]:
            rs = [r for r in rows if r["server"] == kind and r["n"] == n and "error" not in r]
            if not rs:
                print(f"| {kind} | {n} | error |")
                continue
            tps = [r["decode_tps"] for r in rs]
            print(f"| {kind} | {n} | {statistics.median(tps):.2f} ({min(tps):.2f}..{max(tps):.2f}) | "
                  f"{1e3 * statistics.median(r['tpot_p50_s'] for r in rs):.0f} | "
                  f"{1e3 * statistics.median(r['tpot_p95_s'] for r in rs):.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(args.model), "rows": rows}, indent=2))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
