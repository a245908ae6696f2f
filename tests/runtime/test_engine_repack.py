"""The engine's CPU share on upstream's repacked CPU weights (docs/design.md §8, "Repacked CPU weights").

Upstream llama.cpp puts CPU weights into its CPU_REPACK buffer by default (ggml-cpu/repack.cpp interleaves the rows
of the types it has kernels for on this CPU) and runs mul_mat_id on them with its repacked kernels. The engine
computes its CPU share from those same tensors, and copies the file's bytes (not the repacked ones) to the GPU.

Oracle: upstream with the same placement and its default repacking. On the RPC stand-in, ``-ngl 99 -ot exps=CPU``
for a CPU-only share (``moe_cache=0``) and for mixed splits; for a GPU share of whole layers (the
``upstream-ncmoe`` preset) upstream with those layers' experts on the stand-in and the others repacked on the CPU,
which is the same placement exactly: same greedy tokens and bit-identical logits. A mixed split inside a layer has
no upstream placement (upstream computes a layer's experts on one device): its GPU pairs get the stand-in's plain
kernels, its CPU pairs the repacked ones. Where those two kernels round alike on this CPU (checked here by
comparing upstream's repacked and ``--no-repack`` runs), the mixed split is bit-identical to upstream's repacked
run too; where they differ (IQ4_NL on x86) its oracle is the same greedy tokens and an NMSE below that of upstream's
own repacked-against-plain difference times 4 (the GPU pairs' share of it).
"""
from __future__ import annotations

import numpy as np
import pytest

from hybrimoe._lib import llama_cpp_module
from hybrimoe.testing.fixtures import ENGINE_ARCHS
from hybrimoe.testing.upstream import (decode_together, greedy_reference, greedy_run, last_logits,
                                       nmse, prompt_tokens)

QUANTS = ["Q4_0", "Q4_K_M", "IQ4_NL", "MXFP4"]
UBATCHES = [1, 7, 64]
SHARES = ["cpu", "layers", "mixed"]


def _common(rpc_server, n_prompt: int, ub: int) -> dict:
    return dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=n_prompt + 64, n_batch=512, n_ubatch=ub,
                seed=0, verbose=False)


def last_logits_of_prompt(path: str, tokens, common: dict) -> np.ndarray:
    """Upstream's logits of the last prompt token with every expert on the stand-in (``-ngl 99``, no override)."""
    from hybrimoe import Llama

    llm = Llama(path, **common)
    try:
        llm.eval(tokens)
        return last_logits(llm)
    finally:
        llm.close()


def _cases():
    from allpairspy import AllPairs

    return [pytest.param(*c, id="-".join(str(x) for x in c))
            for c in AllPairs([list(ENGINE_ARCHS), QUANTS, UBATCHES, SHARES])]


def test_this_cpu_repacks_what_upstream_lists():
    """The types listed as repacked here are the ones ggml-cpu's repack buffer gives kernels to; on x86 with AVX2
    upstream's rules (ggml_repack_get_optimal_repack_type) give Q4_0, Q4_K, IQ4_NL and MXFP4, not Q8_0."""
    from hybrimoe._lib import llama_cpp_module
    from hybrimoe.runtime.engine_facts import cpu_repacked_types, engine_module

    llama_cpp_module()
    m = engine_module()
    got = cpu_repacked_types()
    assert set(got) <= {"Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "IQ4_NL", "MXFP4", "Q8_0"}
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if "avx2" in flags:
        assert {"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"} <= set(got) and "Q8_0" not in got, got
    # a row count that no interleave divides is never repacked
    import gguf

    assert not m.cpu_repacks(int(gguf.GGMLQuantizationType.Q4_0), 256, 3)
    with pytest.raises(ValueError, match="unknown ggml type"):
        m.cpu_repacks(9999, 256, 8)


@pytest.mark.slow
@pytest.mark.parametrize("arch, quant, ub, share", _cases())
def test_engine_on_repacked_experts(arch, quant, ub, share, expert_quant_model, rpc_server, split_cost_model):
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import cpu_repacked_types, engine_facts

    path = expert_quant_model(arch, quant)
    facts = engine_facts(path)
    n_prompt = 3 * ub + 7
    common = _common(rpc_server, n_prompt, ub)
    probe = Llama(path, **common, tensor_buft_overrides="exps=CPU")
    try:
        tokens = prompt_tokens(probe, n_prompt)
    finally:
        probe.close()
    if share == "cpu":
        engine = dict(moe_cache=0)
    elif share == "layers":
        # the last MoE layers' experts resident and computed on the stand-in, the first layer's on the CPU
        n_gpu_layers = max(1, len(facts.moe_layers) - 1)
        engine = dict(moe_cache=n_gpu_layers * facts.n_expert * facts.slot_bytes, moe_policy="upstream-ncmoe")
    else:
        engine = dict(moe_cache="50%", moe_cost_model=split_cost_model)
    out, lg, st = greedy_run(path, tokens, 24, **common, **engine)
    e = st["engine"]
    layers = e["layers"]
    # the CPU share really ran on repacked experts wherever this CPU repacks the expert types
    types = {t for row in facts.expert_types for t in row}
    import gguf

    repackable = {int(gguf.GGMLQuantizationType[n]) for n in cpu_repacked_types()}
    assert any(any(r) for r in e["repacked"]) == bool(types & repackable), (e["repacked"], types)

    if share == "layers":
        gpu_layers = [facts.moe_layers[i] for i, ls in enumerate(layers) if ls["gpu_pairs"] > 0]
        assert gpu_layers and all(layers[i]["cpu_pairs"] == 0 for i, ls in enumerate(layers) if ls["gpu_pairs"]), \
            layers
        dev = f"RPC0[{rpc_server.endpoint}]"
        placement = [rf"blk\.{il}\.ffn_.*_exps={dev}" for il in gpu_layers] + ["exps=CPU"]
        ref_out, ref_lg, _ = greedy_run(path, tokens, 24, **common, tensor_buft_overrides=placement)
        assert out == ref_out and np.array_equal(lg, ref_lg), nmse(lg, ref_lg)
        return
    ref_out, ref_lg, _ = greedy_run(path, tokens, 24, **common, tensor_buft_overrides="exps=CPU")
    assert out == ref_out
    if share == "cpu" or e["gpu_experts"] == 0:
        assert e["gpu_experts"] == 0
        assert np.array_equal(lg, ref_lg), nmse(lg, ref_lg)
        return
    # a mixed split: bit-exact where upstream's repacked and plain kernels round alike on this CPU
    _, plain_lg, _ = greedy_run(path, tokens, 24, **common, tensor_buft_overrides="exps=CPU", no_repack=True)
    if np.array_equal(plain_lg, ref_lg):
        assert np.array_equal(lg, ref_lg), nmse(lg, ref_lg)
    else:
        assert nmse(lg, ref_lg) <= 4 * nmse(plain_lg, ref_lg), (nmse(lg, ref_lg), nmse(plain_lg, ref_lg))


@pytest.mark.parametrize("quant", QUANTS)
def test_gpu_copies_take_the_file_layout(quant, expert_quant_model, rpc_server):
    """Every expert computed on the stand-in from slots copied from the file's bytes: upstream's numbers with every
    expert on the stand-in (``-ngl 99``, no override: the same kernels on the same bytes); the negative control
    copies the repacked host bytes instead, and the logits then differ."""
    from hybrimoe import Llama

    path = expert_quant_model("qwen3moe", quant)
    common = _common(rpc_server, 40, 64)
    kw = dict(moe_cache="100%", moe_policy="gpu-on-demand")
    tokens, ref_out, ref_lg = greedy_reference(path, 40, 8, **common)
    out, lg, st = greedy_run(path, tokens, 8, **common, **kw)
    assert st["engine"]["cpu_experts"] == 0 and st["engine"]["gpu_experts"] > 0
    assert any(any(r) for r in st["engine"]["repacked"])
    assert out == ref_out and np.array_equal(lg, ref_lg), nmse(lg, ref_lg)
    llm = Llama(path, **common, **kw)
    try:
        llm.moe_engine.set_repacked_copies(True)
        llm.eval(tokens)
        bad = np.ctypeslib.as_array(llama_cpp_module().llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))
        # the repacked blocks read in the file's layout: wrong numbers, often not finite
        assert not np.isfinite(bad).all() or nmse(bad, last_logits_of_prompt(path, tokens, common)) > 1e-3
    finally:
        llm.close()


@pytest.mark.parametrize("share", ["cpu", "layers"])
def test_two_sequences_in_one_batch(share, expert_quant_model, rpc_server):
    """Two sequences decoded together (n_seq 2): each one's logits equal upstream's same batch with the same
    placement, repacked (the CPU share alone; the last MoE layer's experts on the stand-in)."""
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts

    path = expert_quant_model("qwen2moe", "Q4_0")
    facts = engine_facts(path)
    common = dict(_common(rpc_server, 64, 16), n_seq_max=2)
    dev = f"RPC0[{rpc_server.endpoint}]"
    if share == "cpu":
        kw, placement = dict(moe_cache=0), ["exps=CPU"]
    else:
        kw = dict(moe_cache=facts.n_expert * facts.slot_bytes, moe_policy="upstream-ncmoe")
        placement = [rf"blk\.{facts.moe_layers[-1]}\.ffn_.*_exps={dev}", "exps=CPU"]
    ref = Llama(path, **common, tensor_buft_overrides=placement)
    try:
        a = prompt_tokens(ref, 21)
        prompts = [a, a[3:] + a[:3]]
        want = decode_together(ref, prompts, 6)
    finally:
        ref.close()
    llm = Llama(path, **common, **kw)
    try:
        have = decode_together(llm, prompts, 6)
        st = llm.moe_stats()["engine"]
    finally:
        llm.close()
    assert any(any(r) for r in st["repacked"])
    assert (st["gpu_experts"] > 0) == (share == "layers")
    for step_want, step_have in zip(want, have):
        for w, h in zip(step_want, step_have):
            assert np.array_equal(w, h), nmse(h, w)


def test_ram_tier_under_a_gpu_cache_keeps_the_file_layout(expert_quant_model, rpc_server):
    """The RAM slots repack after each read (tests/runtime/test_ram_tier.py) unless a GPU cache above them copies
    from them: then they keep the file's layout, and the CPU share reads no repacked matrix."""
    from hybrimoe import Llama

    path = expert_quant_model("qwen3moe", "Q4_0")
    llm = Llama(path, n_ctx=128, moe_ram_cache="100%", moe_cache="50%", rpc_servers=rpc_server.endpoint,
                n_gpu_layers=-1, moe_cost_model="rtx4090-desktop", verbose=False)
    try:
        llm("Hello", max_tokens=2, temperature=0)
        st = llm.moe_stats()["engine"]
    finally:
        llm.close()
    assert st["repacked"] and not any(any(r) for r in st["repacked"])
