"""Concurrent clients against the servers, for real: ``hybrimoe serve --parallel N``, ``hybrimoe serve`` one request at
a time (``--parallel 1``), and upstream's own ``llama-server -np N`` (``--llama-server PATH``: built from the pinned
llama.cpp source), on one model, CPU only.

Per server and N: N clients each stream one completion at once (prompts of ``--pp`` words, different per client;
``--pp A-B``: lengths spread evenly from A to B words over the clients, one client the middle, so every N has the
same mean; the prompts' token counts are printed,
``--tg`` new tokens, greedy, the end of generation masked: hybrimoe by ``logit_bias``, llama-server by
``ignore_eos``); aggregate tokens/s = all new tokens over the wall time from the first request sent to the last
answer's end (prefills included); TPOT per request = the time between its first and last token event over the events
between, where the server sends one event per token; median and p95 over the requests. ``-r`` repetitions,
interleaved (per repetition every N, at each every server), the load average before each. The servers' flags beyond
these: ``--hybrimoe-args`` and ``--llama-server-args`` (placement, e.g. ``--moe-ram-cache auto``; upstream's
defaults otherwise, repacked CPU weights included).

A model larger than RAM: ``--limit 3GiB`` starts every server in a memory cgroup of that size (the model file
dropped from the page cache before each start), ``--read-ahead KB`` sets the model's block device's
``read_ahead_kb`` for the run (Linux's usual 128; put back at the end; the value in force printed), e.g.
``--hybrimoe-args "--moe-ram-cache auto" --llama-server-args "--no-repack"`` (upstream's mmap, as
``bench_ram_real.py`` runs it: repacking would copy the whole model into the cgroup's memory).

    python3 bench/bench_serve.py -m model.gguf --llama-server ~/llama.cpp/build/bin/llama-server --clients 1,4,8
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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
    ctx = str(n * (max(args.pp_words) * 6 + args.tg + 64))  # a word of the synthetic models' vocabularies is
    # several tokens
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
    err = tempfile.TemporaryFile("w+")
    env = None
    if kind == "upstream":  # a build copied out of its tree finds its shared libraries beside it
        binary = Path(shutil.which(args.llama_server) or args.llama_server).resolve()
        env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
            x for x in (str(binary.parent), os.environ.get("LD_LIBRARY_PATH")) if x))
    # cwd: not a checkout, whose source tree would shadow the installed package
    if args.cgroup is not None:  # a cold start: what the server reads, it reads from the disk
        from hybrimoe.runtime.disk_calibration import drop_from_page_cache

        drop_from_page_cache(args.model)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, cwd="/tmp",
                            env=env, preexec_fn=args.cgroup.enter if args.cgroup is not None else None)
    try:
        _wait_ready(port, proc)
    except Exception as e:
        proc.kill()
        err.seek(0)
        raise RuntimeError(f"{e}: {err.read()[-600:]}") from None
    proc.err = err  # the server's stderr, shown when a run fails
    return proc, port, extra


def stream(port: int, prompt: str, args, extra: dict, out: list) -> None:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    body = {"prompt": prompt, "max_tokens": args.tg, "temperature": 0.0, "stream": True, **extra}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        print(f"HTTP {resp.status}: {resp.read()[:300]!r}", file=sys.stderr)
    stamps, done = [], False
    for line in iter(resp.readline, b""):
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            done = True
            break
        ev = json.loads(data)
        # one event per token until the last (a token's text may be empty: part of a character, or held back)
        if ev.get("choices") and ev["choices"][0].get("finish_reason") is None:
            stamps.append(time.perf_counter())
    conn.close()
    out.append((t0, time.perf_counter(), stamps, done))


def words_range(text: str) -> tuple[int, int]:
    """``--pp``: ``"N"`` or ``"A-B"`` words, 1 <= A <= B. Raises ValueError naming the value."""
    a, sep, b = text.partition("-")
    try:
        lo, hi = int(a), int(b) if sep else int(a)
    except ValueError:
        raise ValueError(f"--pp {text!r}: give N or A-B words") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--pp {text!r}: need 1 <= A <= B")
    return lo, hi


def prompts_of(n: int, words: tuple[int, int]) -> list[str]:
    """``n`` different prompts, their lengths spread evenly over ``words`` (one prompt: the middle)."""
    lo, hi = words
    sizes = [(lo + hi) // 2] if n == 1 else [lo + round((hi - lo) * c / (n - 1)) for c in range(n)]
    return [" ".join(WORDS[(c + i) % len(WORDS)] for i in range(w)) for c, w in enumerate(sizes)]


def one_run(kind: str, args, n: int) -> dict:
    proc, port, extra = start(kind, args, n)
    try:
        prompts = prompts_of(n, args.pp_words)
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
    # a stream that ended with [DONE] answered, even with no token event (llama-cpp-python's stream holds back a
    # random model's text while it is not whole characters)
    if len(outs) != n or not all(d for *_, d in outs):
        proc.err.seek(0)
        tail = proc.err.read()[-800:]
        raise RuntimeError(f"{sum(1 for *_, d in outs if d)} of {n} streams answered; the server's stderr ends: "
                           f"{tail}")
    # every request makes --tg tokens (the end of generation masked): the throughput is theirs over the wall time
    # from the first request sent to the last answer ended (prefills included); TPOT from the token events, where
    # the server sends one per token (llama-cpp-python's own stream, hybrimoe at --parallel 1, holds back text that
    # is not yet a whole character and may send fewer)
    tokens = n * args.tg
    wall = max(e for _, e, _, _ in outs) - min(s for s, _, _, _ in outs)
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for _, _, s, _ in outs if len(s) >= args.tg - 1]
    row = {"server": kind, "n": n, "tokens": tokens, "tps": tokens / wall}
    if len(tpot) == n:
        row.update(tpot_p50_s=statistics.median(tpot),
                   tpot_p95_s=sorted(tpot)[min(len(tpot) - 1, math.ceil(0.95 * len(tpot)) - 1)])
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--llama-server", default=None, help="upstream's llama-server binary (left out without it)")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--pp", default="64", help="words per prompt, N or A-B (spread over the clients); a word of "
                                               "the synthetic models' vocabularies is about 5.6 tokens")
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=1)
    ap.add_argument("--hybrimoe-args", default="")
    ap.add_argument("--llama-server-args", default="")
    ap.add_argument("--limit", default=None, help="memory cgroup limit of every server (a model larger than RAM)")
    ap.add_argument("--read-ahead", type=int, default=None, help="read_ahead_kb of the model's disk during the run")
    ap.add_argument("--servers", default="hybrimoe-parallel,hybrimoe-one-at-a-time,upstream",
                    help="which servers to run (upstream needs --llama-server)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        args.pp_words = words_range(args.pp)
    except ValueError as e:
        ap.error(str(e))
    try:
        clients = [int(x) for x in args.clients.split(",")]
    except ValueError:
        ap.error(f"--clients {args.clients!r}: comma-separated client counts")
    if not all(n >= 1 for n in clients) or args.tg < 1 or args.reps < 1:
        ap.error("--clients, --tg and -r must be at least 1")
    args.model = Path(args.model)
    # a SIGTERM (a timeout, a kill) still restores the read-ahead and removes the cgroup (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.cgroup = ra = None
    if args.limit is not None:
        from hybrimoe.policy.budget import parse_budget
        from hybrimoe.runtime.cgroup import MemoryCgroup

        args.cgroup = MemoryCgroup(int(parse_budget(args.limit, 1.0, 0.0)))
    if args.read_ahead is not None:
        from hybrimoe.runtime.readahead import ReadAhead

        ra = ReadAhead(args.model)
        print(f"read_ahead_kb {ra.set(args.read_ahead)} in force (found {ra.original})", file=sys.stderr)
    try:
        return _run(args)
    finally:
        if ra is not None:
            ra.close()
        if args.cgroup is not None:
            args.cgroup.close()


def _run(args) -> int:
    from hybrimoe import Llama
    from hybrimoe._lib import llama_cpp_module

    lc = llama_cpp_module().llama_cpp
    llm = Llama(str(args.model), vocab_only=True, verbose=False)
    args.eog_bias = {str(t): -100.0 for t in range(llm.n_vocab()) if lc.llama_vocab_is_eog(llm._model.vocab, t)}
    lengths = {n: [len(llm.tokenize(p.encode(), add_bos=True, special=True)) for p in prompts_of(n, args.pp_words)]
               for n in {int(x) for x in args.clients.split(",")}}
    llm.close()
    kinds = [k for k in args.servers.split(",") if k and (k != "upstream" or args.llama_server)]
    unknown = set(kinds) - {"hybrimoe-parallel", "hybrimoe-one-at-a-time", "upstream"}
    if unknown:
        print(f"--servers: unknown {sorted(unknown)} (hybrimoe-parallel, hybrimoe-one-at-a-time, upstream)",
              file=sys.stderr)
        return 2
    rows = []
    for rep in range(args.reps):
        for n in [int(x) for x in args.clients.split(",")]:
            for kind in kinds:
                load = os.getloadavg()[0]
                print(f"{kind} N={n} (rep {rep + 1}, load {load:.2f})...", file=sys.stderr, flush=True)
                try:
                    row = one_run(kind, args, n)
                except Exception as e:  # a server that did not start: recorded, the others go on
                    row = {"server": kind, "n": n, "error": re.sub(r"\s+", " ", str(e))[:1200]}
                row.update(rep=rep, loadavg=load)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    every = [t for ts in lengths.values() for t in ts]  # the mean in words is the same at every N
    print(f"model {args.model.name}; {args.threads} threads, CPU only; {args.pp}-word prompts ({min(every)}-"
          f"{max(every)} tokens), {args.tg} new tokens; "
          f"{args.reps} repetition(s), median (min..max)"
          + (f"; memory cgroup {args.limit}" if args.limit else "")
          + (f"; read_ahead_kb {args.read_ahead}" if args.read_ahead is not None else ""))
    print("| server | N | tokens/s (aggregate, prefills included) | TPOT p50 ms | TPOT p95 ms |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        for n in [int(x) for x in args.clients.split(",")]:
            rs = [r for r in rows if r["server"] == kind and r["n"] == n and "error" not in r]
            if not rs:
                print(f"| {kind} | {n} | error |")
                continue
            tps = [r["tps"] for r in rs]
            t50 = [r["tpot_p50_s"] for r in rs if "tpot_p50_s" in r]
            t95 = [r["tpot_p95_s"] for r in rs if "tpot_p95_s" in r]
            print(f"| {kind} | {n} | {statistics.median(tps):.2f} ({min(tps):.2f}..{max(tps):.2f}) | "
                  f"{f'{1e3 * statistics.median(t50):.0f}' if t50 else '-'} | "
                  f"{f'{1e3 * statistics.median(t95):.0f}' if t95 else '-'} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(args.model), "limit": args.limit,
                                               "read_ahead_kb": args.read_ahead, "rows": rows}, indent=2))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
