"""The fused CPU share (``moe_cpu_fused``, src/runtime/fused_moe.h): one op per MoE layer with upstream's kernels.

Oracle: upstream llama.cpp with the same placement and its default CPU weights (repacked where this CPU repacks),
CPU only (``moe_cache=0`` against ``n_gpu_layers=0``), or on the RPC stand-in with whole layers' experts there
(``upstream-ncmoe`` against ``-ot`` putting those layers' experts on the stand-in): same greedy tokens and
bit-identical logits, at 1, 2 and 3 threads (3 leaves a remainder when the experts are shared out, so the op's
synchronised phases run as well as its whole-expert decode). Negative control: a fused share computing
silu(up) * gate. ``moe_cpu_fused="fast"`` (repacked gemm kernels that may round differently) is held to the same
greedy tokens and an NMSE bound.
"""
from __future__ import annotations

import numpy as np
import pytest

from hybrimoe.testing.fixtures import ENGINE_ARCHS, EXPERT_QUANTS
from hybrimoe.testing.upstream import decode_together, greedy_reference, greedy_run, nmse, prompt_tokens


def _cases():
    from allpairspy import AllPairs

    return [pytest.param(*c, id="-".join(str(x) for x in c))
            for c in AllPairs([list(ENGINE_ARCHS), list(EXPERT_QUANTS), [1, 7, 64], [1, 2, 3]])]


@pytest.mark.slow
@pytest.mark.parametrize("arch, quant, ub, threads", _cases())
def test_fused_cpu_share_is_upstreams(arch, quant, ub, threads, expert_quant_model):
    path = expert_quant_model(arch, quant)
    n_prompt = 3 * ub + 5
    common = dict(n_ctx=n_prompt + 64, n_batch=512, n_ubatch=ub, seed=0, verbose=False, n_threads=threads,
                  n_threads_batch=threads, n_gpu_layers=0)

    tokens, ref_out, ref_lg = greedy_reference(path, n_prompt, 16, **common)
    out, lg, st = greedy_run(path, tokens, 16, moe_cache=0, moe_cpu_fused=True, **common)
    fused = st["engine"]["fused"]
    assert st["engine"]["fused_mode"] == "exact"
    # it ran fused: every layer at this ubatch, or, from 8 tokens, the layers without plain K-quant matrices
    assert all(f == "any" or (f is not None and f >= ub) for f in fused) or (ub >= 8 and "any" in fused), fused
    assert out == ref_out and np.array_equal(lg, ref_lg), nmse(lg, ref_lg)


_BATCH_CASES = [(q, n, t, False) for q in ("Q8_0", "Q5_0", "Q4_K_M") for n, t in ((4, 1), (8, 3))] + [
    ("Q4_K_M", 4, 1, True), ("Q4_K_M", 6, 3, True)]


@pytest.mark.parametrize("quant, n, threads, no_repack", _BATCH_CASES)
def test_fused_batch_of_sequences_is_upstreams_batched_run(quant, n, threads, no_repack, expert_quant_model):
    """n sequences decoded together (an expert's several rows in each decode step: patch 0011's multi-row kernels on
    Q8_0, Q5_0 and repacked Q4_K; with ``no_repack`` on plain Q4_K and Q6_K, below the 8 rows where upstream's tiled
    K-quant kernel takes over), fused, against upstream's batched run of the same sequences with the same CPU
    weights: every step's logits bit for bit."""
    from hybrimoe import Llama
    from hybrimoe.runtime.batch import BatchGenerator

    path = expert_quant_model("qwen3moe", quant)
    common = dict(n_ctx=512, n_batch=256, n_ubatch=64, seed=0, verbose=False, n_threads=threads,
                  n_threads_batch=threads, n_gpu_layers=0, n_seq_max=n, no_repack=no_repack)
    ref = Llama(path, **common)
    try:
        base = prompt_tokens(ref, 40)
        prompts = [base[i: i + 5 + i % 4] for i in range(n)]
        want = decode_together(ref, prompts, 6)
    finally:
        ref.close()
    llm = Llama(path, moe_cache=0, moe_cpu_fused=True, **common)
    try:
        gen = BatchGenerator(llm, record_logits=True)
        gen.run(prompts, max_tokens=6, temperature=0.0)
        st = llm.moe_stats()["engine"]
    finally:
        llm.close()
    assert st["fused_mode"] == "exact" and any(f is not None for f in st["fused"]), st["fused"]
    steps = min(len(lg) for lg in gen.logits)
    assert steps >= 2
    for i in range(n):
        for k in range(steps):
            assert np.array_equal(gen.logits[i][k], want[k][i]), (i, k, nmse(gen.logits[i][k], want[k][i]))


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_K_M"])
def test_fused_with_a_gpu_share_of_whole_layers(quant, expert_quant_model, rpc_server):
    """The last MoE layer's experts on the stand-in, the first's fused on the CPU: upstream with that placement."""
    from hybrimoe.runtime.engine_facts import engine_facts

    path = expert_quant_model("qwen3moe", quant)
    facts = engine_facts(path)
    common = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=128, n_batch=512, n_ubatch=32, seed=0,
                  verbose=False)
    dev = f"RPC0[{rpc_server.endpoint}]"
    placement = [rf"blk\.{facts.moe_layers[-1]}\.ffn_.*_exps={dev}", "exps=CPU"]

    tokens, ref_out, ref_lg = greedy_reference(path, 40, 12, **common, tensor_buft_overrides=placement)
    out, lg, st = greedy_run(path, tokens, 12, moe_cache=facts.n_expert * facts.slot_bytes, moe_policy="upstream-ncmoe",
                       moe_cpu_fused=True, **common)
    e = st["engine"]
    assert e["gpu_experts"] > 0 and e["fused"][0] is not None
    assert out == ref_out and np.array_equal(lg, ref_lg), nmse(lg, ref_lg)


@pytest.mark.parametrize("ub", [1, 32])
def test_fused_with_a_mixed_split(ub, expert_quant_model, rpc_server, split_cost_model):
    """A split inside each layer (the GPU's pairs -1 in the fused op's ids), both sides in the file's layout (the
    stand-in's plain kernels then match upstream's CPU ones): upstream's numbers."""
    path = expert_quant_model("qwen2moe", "Q4_0")
    common = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=128, n_batch=512, n_ubatch=ub, seed=0,
                  verbose=False, no_repack=True)

    tokens, ref_out, ref_lg = greedy_reference(path, 40, 12, **common, tensor_buft_overrides="exps=CPU")
    out, lg, st = greedy_run(path, tokens, 12, moe_cache="50%", moe_cost_model=split_cost_model, moe_cpu_fused=True,
                       **common)
    e = st["engine"]
    assert e["gpu_experts"] > 0 and e["cpu_experts"] > 0 and all(f == "any" for f in e["fused"]), e
    assert out == ref_out and np.array_equal(lg, ref_lg), nmse(lg, ref_lg)


def test_negative_control_and_fast_mode(tmp_path):
    """The oracle notices a fused CPU share that computes the wrong thing (silu(up) * gate: the logits differ), and
    ``"fast"`` (the repacked gemm kernels wherever a layout has them, also where they round differently from the
    gemv of upstream's mul_mat_id: Q4_K on x86) stays within a small NMSE of upstream's logits with the same greedy
    tokens (a model 2048 wide: 8 K-quant blocks per row)."""
    from hybrimoe import Llama
    from hybrimoe.testing.upstream import last_logits
    from hybrimoe.tiny import fixture_set, make_tiny_model

    kw = dict(fixture_set()[("qwen3moe", "Q4_K_M")], n_embd=2048, n_ff_exp=512)
    path = str(make_tiny_model(tmp_path / "wide.gguf", **kw))
    common = dict(n_ctx=256, n_batch=512, n_ubatch=64, seed=0, verbose=False, n_gpu_layers=0)
    tokens, ref_out, ref_lg = greedy_reference(path, 100, 8, **common)
    llm = Llama(path, moe_cache=0, moe_cpu_fused=True, **common)
    try:
        llm.moe_engine.set_fused_swap(True)
        llm.eval(tokens)
        bad = last_logits(llm)
    finally:
        llm.close()
    assert nmse(bad, ref_lg) > 1e-4
    out, lg, st = greedy_run(path, tokens, 8, moe_cache=0, moe_cpu_fused="fast", **common)
    assert st["engine"]["fused"][0] == "any" and st["engine"]["fused_mode"] == "fast"
    assert out == ref_out and nmse(lg, ref_lg) <= 1e-6, nmse(lg, ref_lg)


def test_unsupported_experts_keep_upstreams_ops(tiny_model):
    """gpt-oss's experts (biases, SwiGLU-OAI) are not fused: every layer says so (-1), and the numbers stay
    upstream's."""
    path = str(tiny_model("gpt-oss", "Q8_0"))
    common = dict(n_ctx=128, n_batch=64, n_ubatch=16, seed=0, verbose=False, n_gpu_layers=0)

    tokens, ref_out, ref_lg = greedy_reference(path, 20, 8, **common)
    out, lg, st = greedy_run(path, tokens, 8, moe_cache=0, moe_cpu_fused=True, **common)
    assert st["engine"]["fused"] and all(f is None for f in st["engine"]["fused"])
    assert out == ref_out and np.array_equal(lg, ref_lg)


@pytest.mark.parametrize("kw, match", [(dict(moe_cpu_fused=True), "moe_cpu_fused set without moe_cache"),
                                       (dict(moe_cache=0, moe_cpu_fused="yes"), "moe_cpu_fused must be"),
                                       (dict(moe_cpu_fused="yes"), "moe_cpu_fused must be")])
def test_bad_fused_option(kw, match, tiny_model):
    from hybrimoe import Llama

    with pytest.raises(ValueError, match=match):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), verbose=False, **kw)


def test_fused_off_without_the_engine_is_no_request(tiny_model):
    """``moe_cpu_fused="off"`` (the CLI's default word) asks the engine for nothing: no error without moe_cache."""
    from hybrimoe import Llama

    llm = Llama(str(tiny_model("qwen3moe", "Q8_0")), verbose=False, moe_cpu_fused="off")
    try:
        assert "engine" not in llm.moe_stats()
    finally:
        llm.close()
