"""The hybrid engine against its oracle (docs/design.md §12): upstream llama.cpp with the same placement
(non-expert weights on the device, routed experts in host memory, no repacking: ``-ngl 99 -ot exps=CPU
--no-repack``), on the RPC stand-in device. The pairwise matrix is in test_engine_matrix.py (slow)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hybrimoe.testing.upstream import greedy_with_logits, last_logits, nmse, prompt_tokens
from hybrimoe.testing.fixtures import ENGINE_ARCHS

ARCHS = list(ENGINE_ARCHS)


# both sides in the file's layout (no_repack): the stand-in computes the GPU share with the plain CPU kernels, and
# upstream's repacked ones may round differently (tests/runtime/test_engine_repack.py covers repacked weights)
def _common(rpc_server, **kw):
    d = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=512, n_batch=512, n_ubatch=32, seed=0,
             verbose=False,
             no_repack=True)
    d.update(kw)
    return d


def _reference(path, rpc_server, tokens, n=32, **kw):
    from hybrimoe import Llama

    ref = Llama(str(path), tensor_buft_overrides="exps=CPU", **_common(rpc_server, **kw))
    try:
        return greedy_with_logits(ref, tokens, n)
    finally:
        ref.close()


def _slots(path, n):
    from hybrimoe.runtime.engine_facts import slot_bytes

    return n * slot_bytes(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_matches_upstream_same_placement(arch, tiny_model, rpc_server, split_cost_model):
    """Mixed CPU/GPU splits give upstream's greedy tokens and logits (bit for bit on the CPU stand-in), and the
    engine really ran experts on both sides and copied experts."""
    from hybrimoe import Llama

    path = tiny_model(arch, "Q8_0")
    llm = Llama(str(path), moe_cache=_slots(path, 6), moe_cost_model=split_cost_model, **_common(rpc_server))
    try:
        tokens = prompt_tokens(llm, 40)
        out, lg = greedy_with_logits(llm, tokens)
        st = llm.moe_stats()
    finally:
        llm.close()
    ref_out, ref_lg = _reference(path, rpc_server, tokens)
    assert out == ref_out
    assert nmse(lg, ref_lg) <= 1e-6
    assert np.array_equal(lg, ref_lg)  # reachable on the stand-in: same kernels, upstream's summation order
    e = st["engine"]
    assert e["gpu_experts"] > 0 and e["cpu_experts"] > 0, e
    assert e["bytes_copied"] > 0 and 0 < e["hit_rate"] < 1, e
    assert sum(s["gpu_launches"] for s in e["layers"]) >= sum(s["gpu_runs"] for s in e["layers"]) > 0
    assert not st["engine_skipped"] and not st["unsupported"]


@pytest.mark.parametrize("policy", ["gpu-on-demand", "hybrimoe"])
def test_two_launches_resident_then_loaded(policy, tiny_model, rpc_server, split_cost_model):
    """Ubatches whose GPU share has both resident experts (launch 1) and experts loaded for it (launch 2, after
    their copies) still give upstream's logits bit for bit."""
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q4_K_M")
    llm = Llama(str(path), moe_cache=_slots(path, 5), moe_policy=policy, moe_cost_model=split_cost_model,
                **_common(rpc_server, n_ubatch=8))
    try:
        tokens = prompt_tokens(llm, 45)
        out, lg = greedy_with_logits(llm, tokens)
        layers = llm.moe_stats()["engine"]["layers"]
    finally:
        llm.close()
    assert sum(s["gpu_launches"] for s in layers) > sum(s["gpu_runs"] for s in layers) > 0
    ref_out, ref_lg = _reference(path, rpc_server, tokens, n_ubatch=8)
    assert out == ref_out and np.array_equal(lg, ref_lg)


def test_negative_control_dropping_the_gpu_share_fails(tiny_model, rpc_server, split_cost_model):
    """The check above can fail: zeroing the GPU share's outputs changes the logits."""
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), moe_cache=_slots(path, 6), moe_cost_model=split_cost_model, **_common(rpc_server))
    try:
        llm.moe_engine.set_drop_gpu_share(True)
        tokens = prompt_tokens(llm, 40)
        out, lg = greedy_with_logits(llm, tokens, 8)
        assert llm.moe_stats()["engine"]["gpu_experts"] > 0
    finally:
        llm.close()
    ref_out, ref_lg = _reference(path, rpc_server, tokens, 8)
    assert nmse(lg, ref_lg) > 1e-6


# Costs under which a prefill ubatch is much cheaper on the GPU, copies included (a slow CPU, a fast link), and the
# reverse (a fast CPU, a slow link); seconds and bytes/s, schema hybrimoe.cost_model/1.
GPU_WINS = {"cpu_a_s": 1e-3, "cpu_b_s": 1e-3, "gpu_a_s": 1e-6, "gpu_b_s": 1e-8, "h2d_bandwidth_Bps": 1e13,
            "h2d_latency_s": 1e-7}
CPU_WINS = {"cpu_a_s": 1e-7, "cpu_b_s": 1e-9, "gpu_a_s": 1e-3, "gpu_b_s": 1e-4, "h2d_bandwidth_Bps": 1e6,
            "h2d_latency_s": 1e-2}


@pytest.mark.parametrize("costs", ["gpu-wins", "cpu-wins"])
def test_big_prefill_ubatch_loads_by_cost(costs, tiny_model, rpc_server, split_cost_model, tmp_path):
    """A prefill ubatch whose experts are cheaper loaded and run on the GPU: the scheduler loads them, more in one
    ubatch than the cache holds (later layers evict earlier ones by the cache's rules, after those ran), never more
    slots than the budget, with upstream's tokens and logits. The cost model decides: with a fast CPU and a slow
    link the same ubatch loads nothing."""
    import json

    from hybrimoe import Llama

    with open(split_cost_model) as f:
        base = json.load(f)
    cost = dict(base, cpu_startup_s=0.0, act_a_s=0.0, act_b_s=0.0, **(GPU_WINS if costs == "gpu-wins"
                                                                            else CPU_WINS))
    cm = tmp_path / "cost.json"
    cm.write_text(json.dumps(cost))
    path = tiny_model("qwen3moe", "Q8_0", n_layer=4)
    n_slots = 3
    llm = Llama(str(path), moe_cache=_slots(path, n_slots), moe_cost_model=str(cm), moe_prefetch_layers=0,
                moe_policy={"scheduler": "hybrimoe", "cache": "mrs", "prefetch": "none", "fill": False},
                **_common(rpc_server, n_ubatch=64))
    try:
        llm.moe_log()
        tokens = prompt_tokens(llm, 64)
        out, lg = greedy_with_logits(llm, tokens, 4)
        log = llm.moe_take_log()
        eng = llm.moe_engine
        assert eng.slots_in_use() <= n_slots
        assert llm.moe_setup.policies.cache.n_resident <= n_slots
    finally:
        llm.close()
    # the prompt's ubatch (its last MoE layer computes only the token whose logits are wanted)
    prefill = [r for r in log if r["ubatch"] == 0 and r["n_tokens"] == 64]
    assert len(prefill) == 3
    loaded = sum(len(r["loaded"]) for r in prefill)
    if costs == "gpu-wins":
        assert loaded > n_slots, [r["loaded"] for r in prefill]  # more than ever fit at once, 0 resident before
        assert all(len(r["loaded"]) <= n_slots for r in prefill)
        assert sum(len(r["evicted"]) for r in prefill) >= loaded - n_slots
        assert all(any(r["on_gpu"]) for r in prefill)
    else:
        assert loaded == 0 and not any(any(r["on_gpu"]) for r in prefill)
    ref_out, ref_lg = _reference(path, rpc_server, tokens, 4, n_ubatch=64)
    assert out == ref_out and np.array_equal(lg, ref_lg)


def test_engine_nothing_cached_equals_upstream_cpu_only(tiny_model):
    """moe_cache=0 without any device: every expert on the CPU through the engine == upstream CPU-only, both with
    upstream's default CPU weights (the Q4_K experts repacked where this CPU repacks them)."""
    from hybrimoe import Llama

    path = tiny_model("deepseek2", "Q4_K_M")
    kw = dict(n_ctx=256, n_batch=256, n_ubatch=16, seed=0, verbose=False)
    llm = Llama(str(path), moe_cache=0, **kw)
    try:
        tokens = prompt_tokens(llm, 37)
        out, lg = greedy_with_logits(llm, tokens, 16)
        assert llm.moe_stats()["engine"]["gpu_experts"] == 0
    finally:
        llm.close()
    ref = Llama(str(path), **kw)
    try:
        ref_out, ref_lg = greedy_with_logits(ref, tokens, 16)
    finally:
        ref.close()
    assert out == ref_out and np.array_equal(lg, ref_lg)


def test_repeated_runs_with_prefetch_are_identical(tiny_model, rpc_server, split_cost_model):
    """Five runs with prefetch on (cache state carried over between them) give identical tokens; prefetches
    were issued and slot bookkeeping agrees with the cache; nothing stays pinned."""
    from hybrimoe import Llama

    path = tiny_model("qwen2moe", "Q4_K_M")
    llm = Llama(str(path), moe_cache=_slots(path, 8), moe_cost_model=split_cost_model, moe_prefetch_layers=2,
                **_common(rpc_server))
    try:
        tokens = prompt_tokens(llm, 20)
        runs = [greedy_with_logits(llm, tokens, 24)[0] for _ in range(5)]
        e = llm.moe_stats()["engine"]
        eng = llm.moe_engine
        assert eng.slots_in_use() == llm.moe_setup.policies.cache.n_resident
        assert eng.pinned_count() == 0  # every layer ran in the last decode step: its pins were released
    finally:
        llm.close()
    assert all(r == runs[0] for r in runs)
    assert e["bytes_prefetch"] > 0, e
    ref_out, _ = _reference(path, rpc_server, tokens, 24)
    assert runs[0] == ref_out


def test_parallel_sequences_match_single_runs(tiny_model, rpc_server, split_cost_model):
    """n_seq = 4 sequences decoded together give the same greedy tokens as four single runs."""
    from hybrimoe import Llama
    from hybrimoe._lib import llama_cpp_module

    lc = llama_cpp_module().llama_cpp
    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), moe_cache=_slots(path, 6), moe_cost_model=split_cost_model, n_seq_max=4,
                **_common(rpc_server, n_ctx=1024))
    ctx = llm.ctx
    n_vocab = llm.n_vocab()
    texts = ["Once upon a time", "The harbour was quiet", "Every morning the robot", "Boats have names"]
    prompts = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in texts]

    def decode(seqs: list[int], steps: int) -> dict:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        batch = lc.llama_batch_init(512, 0, 4)
        out = {s: [] for s in seqs}
        try:
            pos = {s: 0 for s in seqs}
            cur = {s: list(prompts[s]) for s in seqs}
            for _ in range(steps):
                batch.n_tokens = 0
                last = {}
                for s in seqs:
                    for i, tok in enumerate(cur[s]):
                        j = batch.n_tokens
                        batch.token[j] = tok
                        batch.pos[j] = pos[s] + i
                        batch.n_seq_id[j] = 1
                        batch.seq_id[j][0] = s
                        batch.logits[j] = i == len(cur[s]) - 1
                        batch.n_tokens += 1
                    last[s] = batch.n_tokens - 1
                    pos[s] += len(cur[s])
                assert lc.llama_decode(ctx, batch) == 0
                for s in seqs:
                    row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, last[s]), shape=(n_vocab,))
                    tok = int(np.argmax(row))
                    out[s].append(tok)
                    cur[s] = [tok]
        finally:
            lc.llama_batch_free(batch)
        return out

    try:
        together = decode([0, 1, 2, 3], 12)
        single = {s: decode([s], 12)[s] for s in range(4)}
        assert llm.moe_stats()["engine"]["gpu_experts"] > 0
    finally:
        llm.close()
    assert together == single


def test_two_turn_chat_reusing_the_kv_cache(tiny_model, rpc_server, split_cost_model):
    """Turn 2 evaluates only its new tokens (KV cache of turn 1 reused): same tokens as a fresh run of the whole
    conversation, and the same logits as upstream doing the same two turns."""
    from hybrimoe import Llama

    path = tiny_model("olmoe", "Q8_0")

    def two_turns(llm):
        t1 = prompt_tokens(llm, 17)
        out1, _ = greedy_with_logits(llm, t1, 8)
        t2 = t1 + out1 + llm.tokenize(b" And then the robot", add_bos=False, special=False)
        before = llm.n_tokens
        out2 = []
        for tok in llm.generate(t2, temp=0.0, reset=False):  # llama-cpp-python reuses the matching prefix
            out2.append(int(tok))
            if len(out2) == 8:
                break
        return t2, out2, last_logits(llm), before

    llm = Llama(str(path), moe_cache=_slots(path, 6), moe_cost_model=split_cost_model, **_common(rpc_server))
    try:
        t2, out2, lg2, before = two_turns(llm)
        assert before > 0
    finally:
        llm.close()
    ref = Llama(str(path), tensor_buft_overrides="exps=CPU", **_common(rpc_server))
    try:
        _, ref_out2, ref_lg2, _ = two_turns(ref)
    finally:
        ref.close()
    assert out2 == ref_out2 and nmse(lg2, ref_lg2) <= 1e-6
    fresh = Llama(str(path), moe_cache=_slots(path, 6), moe_cost_model=split_cost_model, **_common(rpc_server))
    try:
        fresh_out, _ = greedy_with_logits(fresh, t2, 8)
    finally:
        fresh.close()
    assert fresh_out == out2


def test_gpt_oss_experts_run_on_the_engine(tiny_model, rpc_server, split_cost_model):
    """gpt-oss experts (F32 matrices, biases, SwiGLU-OAI): the engine runs them (no layer left to upstream's
    path), with upstream's tokens (tests/runtime/test_gpt_oss_engine.py has the quantized cases and the logits)."""
    from hybrimoe import Llama

    path = tiny_model("gpt-oss", None)
    llm = Llama(str(path), moe_cache=_slots(path, 2), moe_cost_model=split_cost_model, **_common(rpc_server))
    try:
        tokens = prompt_tokens(llm, 12)
        out, lg = greedy_with_logits(llm, tokens, 8)
        st = llm.moe_stats()
    finally:
        llm.close()
    assert not st["unsupported"] and sum(st["runs"]) > 0
    assert st["engine"]["gpu_experts"] > 0 and st["engine"]["cpu_experts"] > 0, st["engine"]
    ref_out, ref_lg = _reference(path, rpc_server, tokens, 8)
    assert out == ref_out
    assert np.array_equal(lg, ref_lg)


def test_cli_run_with_the_engine(tiny_model, rpc_server, split_cost_model, tmp_path):
    path = tiny_model("qwen3moe", "Q8_0")
    base = [sys.executable, "-m", "hybrimoe", "run", "-m", str(path), "-p", "Once upon a time", "-n", "12",
            "--temp", "0", "--rpc", rpc_server.endpoint, "-ngl", "99", "--output-format", "json"]
    # (cwd outside the checkout: the installed package is the one under test)
    ref = subprocess.run(base + ["-ot", "exps=CPU", "--no-repack"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    eng = subprocess.run(base + ["--moe-cache", str(_slots(path, 4)), "--moe-cost-model", split_cost_model,
                                 "--moe-stats"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert ref.returncode == 0 and eng.returncode == 0, ref.stderr + eng.stderr
    import json

    assert json.loads(eng.stdout)["tokens"] == json.loads(ref.stdout)["tokens"]
    assert "hit rate" in eng.stderr and "experts CPU" in eng.stderr
    assert f"cost model: {split_cost_model}" in eng.stderr


# ---- bad input ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget, match", [
    ("-1", "negative"), (-5, "negative"), ("150%", "within 0..100"), ("lots", "cannot parse"),
    (1, "smaller than one expert"),
])
def test_bad_cache_budget(budget, match, tiny_model, rpc_server):
    from hybrimoe import Llama

    with pytest.raises(ValueError, match=match):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), moe_cache=budget, **_common(rpc_server))


def test_cache_larger_than_free_device_memory(tiny_model, rpc_server, monkeypatch):
    """(The stand-in's free memory is the host's: the device is made to report 1 MB free.)"""
    from hybrimoe import Llama, _ggml

    real = _ggml.device_memory
    monkeypatch.setattr(_ggml, "device_memory", lambda ptr: (10**6, real(ptr)[1]))
    with pytest.raises(ValueError, match="more than the 1000000 bytes free on the device"):
        Llama(str(tiny_model("qwen2moe", "Q4_K_M")), moe_cache="100%", **_common(rpc_server))


def test_budget_is_capped_at_one_slot_per_expert(tiny_model):
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.setup import cache_slots

    f = engine_facts(tiny_model("qwen2moe", "Q4_K_M"))  # Q4_K_M: layers differ in their down matrix type
    n_all = len(f.moe_layers) * f.n_expert
    assert cache_slots("100%", f) == n_all and cache_slots("4000GiB", f) == n_all
    assert cache_slots("50%", f) == n_all // 2 and cache_slots(0, f) == 0


def test_override_sending_experts_to_the_device_is_refused(tiny_model, rpc_server):
    from hybrimoe import Llama

    dev = f"RPC0[{rpc_server.endpoint}]"
    with pytest.raises(ValueError, match="puts routed experts on a device"):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), moe_cache="50%", tensor_buft_overrides=f"exps={dev}",
              **_common(rpc_server))


def test_cache_without_a_device(tiny_model):
    from hybrimoe import Llama

    with pytest.raises(ValueError, match="needs an accelerator"):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), moe_cache="50%", verbose=False)


@pytest.mark.parametrize("policy, match", [("foo", "unknown moe_policy 'foo'"), ("belady", "clairvoyant"),
                                           (42, "must be a preset name"), ({"cache": "nope"}, "nope")])
def test_bad_policy(policy, match, tiny_model, rpc_server):
    from hybrimoe import Llama

    with pytest.raises(ValueError, match=match):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), moe_cache=0, moe_policy=policy, **_common(rpc_server))


def test_bad_cost_model_and_prefetch(tiny_model, rpc_server, tmp_path):
    from hybrimoe import Llama

    path = str(tiny_model("qwen3moe", "Q8_0"))
    with pytest.raises(ValueError, match="no-such-preset"):
        Llama(path, moe_cache=0, moe_cost_model="no-such-preset", **_common(rpc_server))
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "hybrimoe.cost_model/1", "cpu_a_s": -1}')
    with pytest.raises(ValueError, match="bad.json"):
        Llama(path, moe_cache=0, moe_cost_model=str(bad), **_common(rpc_server))
    with pytest.raises(ValueError, match="moe_prefetch_layers"):
        Llama(path, moe_cache=0, moe_prefetch_layers=-1, **_common(rpc_server))
    with pytest.raises(ValueError, match="moe_prefetch_layers"):
        Llama(path, moe_cache=0, moe_prefetch_layers=True, **_common(rpc_server))
    with pytest.raises(ValueError, match="moe_cost_model must be"):
        Llama(path, moe_cache=0, moe_cost_model=123, **_common(rpc_server))


def test_python_policy_that_raises(tiny_model, rpc_server, split_cost_model):
    """A Python SchedulePolicy that raises: RuntimeError naming it from the decode; the layers ran on the CPU, the
    process lives, and a later call with a working policy state runs again."""
    from hybrimoe import Llama, SchedulePolicy

    class Flaky(SchedulePolicy):
        broken = True

        def name(self):
            return "flaky"

        def split(self, layer_input, cost):
            if Flaky.broken:
                raise KeyError("no split today")
            return [1] * len(layer_input.experts)

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), moe_cache=_slots(path, 6), moe_policy=Flaky(), moe_cost_model=split_cost_model,
                **_common(rpc_server))
    try:
        tokens = prompt_tokens(llm, 10)
        with pytest.raises(RuntimeError, match="Flaky.*split.*KeyError.*no split today"):
            greedy_with_logits(llm, tokens, 4)
        Flaky.broken = False
        out, _ = greedy_with_logits(llm, tokens, 8)
        assert llm.moe_stats()["engine"]["gpu_experts"] > 0
    finally:
        llm.close()
    ref_out, _ = _reference(path, rpc_server, tokens, 8)
    assert out == ref_out


def test_rpc_server_dies_mid_run_with_the_engine(tiny_model, tmp_path):
    """kill -9 of the device's server during generation: RuntimeError, no abort (patch 0003)."""
    code = textwrap.dedent("""
        import sys
        from hybrimoe import Llama
        from hybrimoe.runtime.engine_facts import slot_bytes
        from hybrimoe.runtime.rpc import RPCServer
        with RPCServer(threads=1) as srv:
            llm = Llama(sys.argv[1], rpc_servers=srv.endpoint, n_gpu_layers=-1, n_ctx=256, verbose=False,
                        moe_cache=4 * slot_bytes(sys.argv[1]), moe_policy="gpu-on-demand")
            llm("Once upon a time", max_tokens=2, temperature=0)
            srv.proc.kill()
            srv.proc.wait()
            errors = 0
            for i in range(2):
                try:
                    llm("Hello there", max_tokens=2, temperature=0)
                except RuntimeError as e:
                    errors += 1
                    print("ERROR", e)
            llm.close()
        print("ALIVE", errors)
    """)
    r = subprocess.run([sys.executable, "-c", code, str(tiny_model("qwen3moe", "Q8_0"))], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "HYBRIMOE_RPC_TIMEOUT_S": "2"}, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1].split()
    assert last[0] == "ALIVE" and int(last[1]) >= 1, r.stdout


def _rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.slow
def test_long_generation_keeps_memory_flat(tiny_model, rpc_server, split_cost_model):
    """2,000 generated tokens: host memory (this process) and device memory (the RPC server's process) stay flat
    between token 200 and token 2,000; no slot or pin leaks."""
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    srv = rpc_server  # (a server of its own would stay registered in ggml, dead, after the test)
    llm = Llama(str(path), rpc_servers=srv.endpoint, n_gpu_layers=-1, n_ctx=2304, n_batch=64, n_ubatch=64,
                seed=0, verbose=False, moe_cache=_slots(path, 6), moe_cost_model=split_cost_model)
    try:
        tokens = prompt_tokens(llm, 20)
        n = 0
        marks = {}
        for _ in llm.generate(tokens, temp=0.0, reset=True):
            n += 1
            if n in (200, 2000):
                marks[n] = (_rss_bytes(), _rss_bytes(srv.proc.pid))
            if n == 2000:
                break
        e = llm.moe_stats()["engine"]
        eng = llm.moe_engine
        assert eng.pinned_count() == 0
        assert eng.slots_in_use() == llm.moe_setup.policies.cache.n_resident <= eng.n_slots
    finally:
        llm.close()
    assert n == 2000
    assert e["gpu_experts"] > 0 and e["bytes_copied"] > 0
    host_growth = marks[2000][0] - marks[200][0]
    device_growth = marks[2000][1] - marks[200][1]
    assert host_growth < 16 * 2**20, host_growth
    assert device_growth < 16 * 2**20, device_growth


def test_no_further_from_cpu_only_than_upstreams_same_placement(tiny_model, rpc_server, split_cost_model):
    """Against a CPU-only run (long prompt), hybrimoe is no further off than upstream's same-placement run."""
    from hybrimoe import Llama

    path = tiny_model("deepseek2", "Q4_K_M")
    kw = dict(n_ctx=512, n_batch=512, n_ubatch=64, seed=0, verbose=False)
    cpu = Llama(str(path), **kw)
    try:
        tokens = prompt_tokens(cpu, 300)
        _, cpu_lg = greedy_with_logits(cpu, tokens, 8)
    finally:
        cpu.close()
    _, ref_lg = _reference(path, rpc_server, tokens, 8, n_ubatch=64)
    llm = Llama(str(path), moe_cache=_slots(path, 6), moe_cost_model=split_cost_model,
                **_common(rpc_server, n_ubatch=64))
    try:
        _, lg = greedy_with_logits(llm, tokens, 8)
    finally:
        llm.close()
    assert nmse(lg, cpu_lg) <= nmse(ref_lg, cpu_lg) * (1 + 1e-6) + 1e-12


def test_slot_strides_are_whole_blocks(tiny_model):
    """Every region's per-slot stride is a multiple of each block size used there (CUDA's kernels index an expert
    as stride / block size), also when layers mix types (Q4_K_M puts Q4_K and Q6_K down matrices together)."""
    import gguf

    from hybrimoe import _engine
    from hybrimoe.runtime.engine_facts import engine_facts

    for quant in ("Q4_K_M", "mix", "Q8_0"):
        f = engine_facts(tiny_model("qwen2moe", quant))
        strides = _engine.Engine.region_strides([tuple(b) for b in f.expert_bytes],
                                                [tuple(t) for t in f.expert_types])
        for i in range(3):
            assert strides[i] >= max(b[i] for b in f.expert_bytes)
            for t in {t[i] for t in f.expert_types}:
                size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)][1]
                assert strides[i] % size == 0, (quant, i, t, strides[i])
    # a Q4_K / Q6_K mix in one region (sizes as in a 2048 x 1408 expert)
    s = _engine.Engine.region_strides([(1_622_016, 1_622_016, 1_622_016), (1_622_016, 1_622_016, 2_365_440)],
                                      [(12, 12, 12), (12, 12, 14)])
    assert s[2] % 144 == 0 and s[2] % 210 == 0 and s[2] >= 2_365_440



def test_ram_slot_strides_pad_only_the_kinds_read_in_place():
    """RAM slots (``direct_align``): a matrix kind stored in whole 4 KiB pages in some layer gets the largest matrix
    plus 4 KiB, rounded up to 4 KiB (an aligned direct read at its file offset's phase fits, and every slot starts
    aligned); a kind never stored so (read through staging) keeps the GPU slot's stride."""
    from hybrimoe import _engine

    E = _engine.Engine
    eb = [(1_622_016, 1_622_016, 2_365_440), (1_622_016, 1_622_016, 2_365_440)]  # Q4_K gate/up, Q6_K down
    et = [(12, 12, 14), (12, 12, 14)]
    gpu = E.region_strides(eb, et)
    ram = E.region_strides(eb, et, direct_align=E.ram_direct_align)
    assert E.ram_direct_align == 4096
    assert ram[0] == ram[1] == 1_622_016 + 4096 and ram[0] % 4096 == 0
    assert 2_365_440 % 4096 != 0 and ram[2] == gpu[2]
    assert E.slot_bytes_for(eb, et, direct_align=4096) == sum(ram)
    with pytest.raises(ValueError, match="multiple of 256"):
        E.region_strides(eb, et, direct_align=100)


@pytest.mark.slow
def test_many_ubatch_sizes_keep_upstreams_numbers(tiny_model, rpc_server):
    """More ubatch sizes than the engine keeps GPU graphs for (it starts over between layers, never while a
    launch is pending): every prompt length still gives upstream's logits."""
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    kw = _common(rpc_server, n_ubatch=64)
    ref = Llama(str(path), tensor_buft_overrides="exps=CPU", **kw)
    llm = Llama(str(path), moe_cache=_slots(path, 5), moe_policy="gpu-on-demand", **kw)
    try:
        tokens = prompt_tokens(llm, 64)
        for n in range(2, 64):
            for m in (ref, llm):
                m.reset()
                m.eval(tokens[:n])
            assert np.array_equal(last_logits(llm), last_logits(ref)), n
        layers = llm.moe_stats()["engine"]["layers"]
        assert sum(s["gpu_launches"] for s in layers) > sum(s["gpu_runs"] for s in layers)
    finally:
        llm.close()
        ref.close()


def test_decision_log_matches_what_ran(tiny_model, rpc_server, split_cost_model):
    """The engine's decision records (what the simulator replays in test_decision_replay.py) agree with what ran:
    one record per MoE layer and ubatch with the routed ids the layer saw, GPU experts summing to the engine's
    counters, every split consistent (a planned GPU expert either ran there or was declined by the cache), evicted
    experts gone."""
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q4_K_M")
    llm = Llama(str(path), moe_cache=_slots(path, 3), moe_cost_model=split_cost_model, **_common(rpc_server))
    try:
        eng = llm.moe_engine
        eng.set_logging(True)
        llm.moe_hook.set_recording(True)
        tokens = prompt_tokens(llm, 20)
        greedy_with_logits(llm, tokens, 8)
        log = eng.take_log()
        st = llm.moe_stats()["engine"]
        cache = llm.moe_setup.policies.cache
        for layer in (0, 1):
            recs = [r for r in log if r["layer"] == layer]
            assert len(recs) == st["layers"][layer]["runs"]
            seen = np.concatenate([r["ids"] for r in recs])
            assert np.array_equal(seen, llm.moe_hook.recorded(layer))
        assert sum(sum(r["on_gpu"]) for r in log) == st["gpu_experts"] > 0
        for r in log:
            assert r["scores"].shape == (r["n_tokens"], 8) and np.allclose(r["scores"].sum(1), 1, atol=1e-4)
            for e, planned, ran in zip(r["experts"], r["planned_gpu"], r["on_gpu"]):
                assert ran <= planned and (ran == planned or e in r["declined"])
            assert sorted(r["experts"]) == sorted(set(r["ids"].ravel().tolist()))
        last_evicted = {}
        for i, r in enumerate(log):
            for key in r["evicted"]:
                last_evicted[key] = i
        for key, i in last_evicted.items():
            readmitted = any(r["layer"] * 8 + e == key for r in log[i + 1:] for e in r["loaded"] + r["filled"]) or \
                any(j * 8 + e == key for r in log[i + 1:] for j, e in r["prefetched"])
            assert readmitted or not cache.resident(key // 8, key % 8)
        eng.set_logging(False)
    finally:
        llm.close()


def test_kv_override_of_top_k_reaches_the_engine(tiny_model, rpc_server, split_cost_model):
    """kv_overrides "<arch>.expert_used_count" changes llama.cpp's top-k; the engine plans with the same k (it
    used to see a k other than the file's and leave every layer to the CPU) and still matches upstream."""
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    over = {"qwen3moe.expert_used_count": 1}
    llm = Llama(str(path), moe_cache=_slots(path, 6), moe_cost_model=split_cost_model, kv_overrides=over,
                **_common(rpc_server))
    try:
        tokens = prompt_tokens(llm, 24)
        out, lg = greedy_with_logits(llm, tokens, 8)
        e = llm.moe_stats()["engine"]
    finally:
        llm.close()
    ref_out, ref_lg = _reference(path, rpc_server, tokens, n=8, kv_overrides=over)
    assert out == ref_out and np.array_equal(lg, ref_lg)
    assert e["gpu_experts"] > 0 and sum(s["runs"] for s in e["layers"]) > 0
    with pytest.raises(ValueError, match="expert_used_count must be an integer in 1..8"):
        Llama(str(path), moe_cache=0, kv_overrides={"qwen3moe.expert_used_count": 99}, **_common(rpc_server))


def test_engine_refuses_a_ggml_cpu_that_does_not_skip_pairs(tiny_model, tmp_path):
    """The engine writes -1 for the pairs the GPU computes; llama-cpp-python's own ggml-cpu would write out of bounds
    on them. A process that loaded that one first (before hybrimoe's) gets a clear error from Llama(moe_cache=...),
    no crash; in a normal process hybrimoe's is the one loaded."""
    from hybrimoe.runtime.engine_facts import engine_module  # loads llama_cpp on hybrimoe's ggml-cpu first

    assert engine_module().cpu_backend_skips_negative_ids()
    code = textwrap.dedent("""
        import ctypes, importlib.util, sys
        from pathlib import Path
        lib = Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib"
        ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(lib / "libggml-cpu.so.0"), mode=ctypes.RTLD_GLOBAL)  # the stock one, first
        from hybrimoe import Llama, _engine
        assert not _engine.cpu_backend_skips_negative_ids()
        try:
            Llama(sys.argv[1], moe_cache=0, verbose=False)
        except RuntimeError as e:
            print("refused:", e)
        else:
            print("ran")
    """)
    r = subprocess.run([sys.executable, "-c", code, str(tiny_model("qwen3moe", "Q8_0"))], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused:" in r.stdout and "not hybrimoe's ggml-cpu" in r.stdout, r.stdout + r.stderr[-2000:]


def test_hook_nodes_stay_where_patch_0001_pins_them_with_op_offload_on(tiny_model, split_cost_model, tmp_path):
    """With op offload on (llama-cpp-python's default, which the engine keeps), the scheduler's assignment
    (GGML_SCHED_DEBUG=2) puts the engine's custom ops and every node after them, the CPU share's mul_mat_id and GLU
    among them, on the CPU, and the packed routing tensor on the device where the routing is computed (one
    transfer). On CUDA op offload would otherwise move the CPU share's host-weight nodes of big ubatches to the
    GPU; the RPC stand-in never offloads, so this checks the placement rule itself."""
    code = textwrap.dedent("""
        import ctypes, re, sys
        from hybrimoe import Llama
        from hybrimoe._lib import llama_cpp_module
        from hybrimoe.runtime.rpc import RPCServer
        lc = llama_cpp_module().llama_cpp
        lines = []
        @lc.llama_log_callback
        def cb(level, text, ud):
            lines.append(text.decode(errors="replace"))
        lc.llama_log_set(cb, ctypes.c_void_p(0))
        with RPCServer(threads=1) as srv:
            llm = Llama(sys.argv[1], rpc_servers=srv.endpoint, n_gpu_layers=99, n_ctx=128, n_batch=64, n_ubatch=64,
                        verbose=True, op_offload=True, moe_cache="50%", moe_cost_model=sys.argv[2])
            lines.clear()  # the graphs reserved before the engine was attached are upstream's
            llm.eval(llm.tokenize(b"Once upon a time there was a robot", add_bos=True))
            assert llm.moe_stats()["engine"]["gpu_experts"] > 0
            llm.close()
        text = "".join(lines)
        where = {}
        for m in re.finditer(r"node #\\s*\\d+ \\(\\s*[^)]*\\):\\s+(\\S+) \\([^)]*\\) \\[\\s*(\\S+)", text):
            where.setdefault(m.group(1), set()).add(m.group(2))
        print("WHERE", {k: sorted(v) for k, v in where.items() if k.startswith(("hybrimoe", "ffn_moe_out"))})
    """)
    r = subprocess.run([sys.executable, "-c", code, str(tiny_model("qwen3moe", "Q8_0")), split_cost_model],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "GGML_SCHED_DEBUG": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    import ast

    where = ast.literal_eval(r.stdout.split("WHERE ", 1)[1].strip())
    # per MoE layer: plan, the CPU share's up/gate/activation/down, wait, and the combine (named ffn_moe_out by llama)
    cpu_side = [n for n in where if re.match(r"(hybrimoe_(plan|wait|cpu_(up|gate|act|down))|ffn_moe_out)-\d+$", n)]
    assert len(cpu_side) == 7 * 2, where  # 2 MoE layers
    for n in cpu_side:
        assert where[n] == ["CPU"], (n, where[n])
    routing = [n for n in where if n.startswith("hybrimoe_routing-")]
    assert routing and all(where[n] != ["CPU"] for n in routing), where
