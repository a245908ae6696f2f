"""The RPC server's command tally (patch 0004, ``RPCServer(stats_path=...)``, ``hybrimoe.runtime.rpc.read_stats``):
transfers counted at the device side.

The counting runs in child processes (one server each), so that this test process does not register servers
that are gone afterwards. Upstream offloading with ``-ngl 99 -ot exps=CPU`` is the reference: every layer on the
device except the routed experts, so per MoE layer and decode the hidden state comes to the host for the CPU
experts and their output goes back.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest


def _has_patch_0004() -> bool:
    from hybrimoe.runtime.rpc import SERVER_BIN

    try:
        return b"HYBRIMOE_RPC_STATS" in SERVER_BIN.read_bytes() or \
            b"HYBRIMOE_RPC_STATS" in (SERVER_BIN.parent / "libggml-rpc.so").read_bytes()
    except OSError:
        return False


needs_patch_0004 = pytest.mark.skipif(not _has_patch_0004(),
                                      reason="the RPC server lacks hybrimoe patch 0004 (rebuild the package)")

# decode calls per run: the prompt, then one token at a time
N_TOKENS = (0, 4, 12)  # 0: load the model only, no decode

_CHILD = textwrap.dedent("""
    import json, os, sys
    from hybrimoe import Llama
    from hybrimoe.runtime.rpc import RPCServer, read_stats

    model, stats, n_tokens = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    with RPCServer(threads=1, stats_path=stats or None) as srv:
        for n in n_tokens:
            llm = Llama(model, rpc_servers=srv.endpoint, n_gpu_layers=99, tensor_buft_overrides="exps=CPU",
                        n_ctx=256, verbose=False)
            if n:
                llm.eval(llm.tokenize(b"Once upon a time", add_bos=True))
                for i in range(n):
                    llm.eval([5 + i])
            llm.close()
        recs = srv.wait_stats() if stats else None
        print("LOG " + json.dumps(srv.log()))
    print("RECORDS " + json.dumps(recs))
""")


def run_child(model, stats: str, n_tokens=N_TOKENS, env=None) -> tuple[list | None, str]:
    import tempfile

    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, "-c", _CHILD, str(model), stats, ",".join(map(str, n_tokens))],
                           capture_output=True, text=True, timeout=300, cwd=cwd, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    recs = json.loads(next(ln for ln in lines if ln.startswith("RECORDS "))[len("RECORDS "):])
    log = json.loads(next(ln for ln in lines if ln.startswith("LOG "))[len("LOG "):])
    return recs, log


def _facts(path):
    """(device weight bytes and tensor count with -ngl 99 -ot exps=CPU, smallest expert tensor, MoE layers,
    n_embd, n_vocab). llama keeps token_embd on the CPU whatever -ngl says."""
    import gguf

    from hybrimoe.model.reader import describe

    r = gguf.GGUFReader(str(path))
    dev = [t for t in r.tensors if "_exps" not in t.name and t.name != "token_embd.weight"]
    exps = [int(t.n_bytes) for t in r.tensors if "_exps" in t.name]
    d = describe(path)
    n_vocab = next(int(t.shape[1]) for t in r.tensors if t.name == "output.weight")
    return sum(int(t.n_bytes) for t in dev), len(dev), min(exps), len(d["moe_layers"]), int(d["n_embd"]), n_vocab


def _cmd(rec, name, key="count"):
    return rec["commands"].get(name, {}).get(key, 0)


@needs_patch_0004
def test_tally_of_upstream_expert_offload(tiny_model, tmp_path):
    path = tiny_model("qwen3moe", "Q8_0")
    dev_bytes, dev_tensors, min_expert, n_moe, n_embd, n_vocab = _facts(path)
    recs, log = run_child(path, str(tmp_path / "stats.jsonl"))
    assert "command tally" in log and str(tmp_path / "stats.jsonl") in log
    assert [r["connection"] for r in recs] == list(range(1, len(recs) + 1))
    for r in recs:  # each record is consistent in itself
        assert r["graph_computes"] == _cmd(r, "GRAPH_COMPUTE") + _cmd(r, "GRAPH_RECOMPUTE")
        assert r["d2h_bytes"] == _cmd(r, "GET_TENSOR", "bytes_out")
        assert r["h2d_bytes"] <= _cmd(r, "SET_TENSOR", "bytes_in")
        assert _cmd(r, "HELLO") == 1
    runs = [r for r in recs if "ALLOC_BUFFER" in r["commands"]]  # the connections that held the model
    assert len(runs) == len(N_TOKENS), recs
    load, small, big = runs

    # loading writes exactly the device's weights, tensor by tensor: the experts stay on the host
    assert load["graph_computes"] == 0 and _cmd(load, "GET_TENSOR") == 0
    assert load["h2d_bytes"] == dev_bytes
    assert _cmd(load, "SET_TENSOR") == dev_tensors

    # each decode (the prompt's or a token's) sends the same commands: beyond the load, counts are linear in the
    # decode calls; bytes per decoded token come from the difference of the two runs (the prompt's decode
    # moves the rows of all its tokens)
    def value(rec, key):
        return rec[key] if key in rec else _cmd(rec, key)

    d_small, d_big = N_TOKENS[1] + 1, N_TOKENS[2] + 1
    per = {}
    for key in ("GET_TENSOR", "SET_TENSOR", "graph_computes", "d2h_bytes", "h2d_bytes"):
        n_small, n_big = value(small, key) - value(load, key), value(big, key) - value(load, key)
        per[key] = (n_big - n_small) / (d_big - d_small)
        if not key.endswith("_bytes"):
            assert n_small == per[key] * d_small, (key, n_small, n_big)
    # per MoE layer and decode the CPU experts need the hidden state on the host (and the logits come back)
    assert per["GET_TENSOR"] >= n_moe, per
    assert per["graph_computes"] >= n_moe, per
    assert n_moe * n_embd * 4 + n_vocab * 4 <= per["d2h_bytes"] <= 4 * (n_moe * n_embd * 4 + n_vocab * 4), per
    # ... and the CPU experts' output goes back; no expert weights move per token
    assert per["SET_TENSOR"] >= n_moe, per
    assert n_moe * n_embd * 4 <= per["h2d_bytes"] < min_expert, (per, min_expert)


@needs_patch_0004
def test_tally_off_writes_nothing(tiny_model, tmp_path):
    """No stats_path: no tally, even with HYBRIMOE_RPC_STATS set in the environment (RPCServer decides)."""
    target = tmp_path / "would-be.jsonl"
    recs, log = run_child(tiny_model("qwen3moe", "Q8_0"), "", n_tokens=(2,),
                          env={"HYBRIMOE_RPC_STATS": str(target)})
    assert recs is None
    assert not target.exists()
    assert "command tally" not in log


@needs_patch_0004
def test_server_binary_reads_the_variable(tmp_path):
    """The interface is the server's environment: ggml-rpc-server with HYBRIMOE_RPC_STATS set writes a record per
    connection (here a handshake only)."""
    from hybrimoe import _ggml
    from hybrimoe.runtime.rpc import SERVER_BIN, free_port, read_stats

    stats = tmp_path / "raw.jsonl"
    port = free_port()
    proc = subprocess.Popen([str(SERVER_BIN), "--device", "CPU", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, "HYBRIMOE_RPC_STATS": str(stats)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        import time

        deadline = time.monotonic() + 30
        while True:
            try:
                _ggml.check_rpc_server(f"127.0.0.1:{port}", "127.0.0.1", port, timeout=5)
                break
            except RuntimeError:  # not listening yet
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        _ggml.check_rpc_server(f"127.0.0.1:{port}", "127.0.0.1", port, timeout=5)  # a barrier for the first
        recs = read_stats(stats)
    finally:
        proc.terminate()
        proc.wait()
    assert len(recs) >= 1
    assert recs[0]["commands"] == {"HELLO": {"count": 1, "bytes_in": 24, "bytes_out": 28}}
    assert recs[0]["h2d_bytes"] == recs[0]["d2h_bytes"] == recs[0]["graph_computes"] == 0


def test_read_stats_input(tmp_path):
    from hybrimoe.runtime.rpc import read_stats

    assert read_stats(tmp_path / "missing.jsonl") == []
    rec = {"schema": "hybrimoe.rpc_stats/1", "connection": 1, "commands": {}}
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps(rec) + "\n" + json.dumps(rec)[:10])  # a record being written is left out
    assert read_stats(f) == [rec]
    f.write_text(json.dumps(rec) + "\nnot json\n")
    with pytest.raises(ValueError, match=r"s\.jsonl:2: not a JSON record"):
        read_stats(f)
    f.write_text(json.dumps({"schema": "other/1"}) + "\n")
    with pytest.raises(ValueError, match=r"s\.jsonl:1: not a hybrimoe\.rpc_stats/1 record"):
        read_stats(f)


def test_stats_path_checked(tmp_path):
    from hybrimoe.runtime.rpc import RPCServer

    with pytest.raises(ValueError, match="is a directory"):
        RPCServer(stats_path=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        RPCServer(stats_path=tmp_path / "no" / "such.jsonl")
    with pytest.raises(ValueError, match="without stats_path"):
        RPCServer().wait_stats()
