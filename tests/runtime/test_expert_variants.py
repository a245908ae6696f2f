"""The expert variants of upstream's build_moe_ffn on the engine (build_expert_ffn, CPU share and GPU share):
routing weights applied before the experts (Llama 4, with its shared expert), fused gate_up experts (deepseek2's
ffn_gate_up_exps), GELU experts gated and ungated (grok), gated ReLU experts (smallthinker), per-expert scales (ffn_*_exps.scale, which the slot pool
carries per slot), SiLU-GLU clamped by swiglu_clamp_exp (step35's clamp, silu, clamp, mul form) and files mixing IQ and K quant types across gate, up and down (pairwise over the types).

The oracle is upstream llama.cpp with the same placement on the RPC stand-in (``-ot exps=CPU --no-repack``): same
greedy tokens and bit-identical last logits (both sides run ggml-cpu's kernels on the same rows in upstream's order,
and every gather the engine does differently, such as a scale by slot instead of by expert id, copies values
exactly), with a GPU share and a CPU share in every run. Each variant has a negative control: the GPU share with the
variant's op left out (Engine.set_negative_control) no longer matches upstream.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from hybrimoe.testing.upstream import greedy_with_logits, nmse, prompt_tokens, run_engine_and_close

N_GEN = 12

#: variant name -> (make_tiny_model keywords, the negative control that leaves its op out on the GPU)
VARIANTS = {
    "llama4-top1": (dict(arch="llama4", quant="Q8_0", n_layer=4, n_expert=8, n_expert_used=1, n_shared=1), "weight_before"),
    "llama4-top2": (dict(arch="llama4", quant="Q8_0", n_layer=4, n_expert=6, n_expert_used=2, n_shared=1), "weight_before"),
    "deepseek2-fused": (dict(arch="deepseek2", quant="Q8_0", n_layer=3, n_expert=6, n_expert_used=2, n_shared=1,
                             n_dense_lead=1, fused_gate_up=True), "gate_up"),
    "grok-geglu": (dict(arch="grok", quant="Q8_0", n_expert=8, n_expert_used=2), "activation"),
    "grok-gelu-ungated": (dict(arch="grok", quant="Q8_0", n_expert=8, n_expert_used=2, gated_experts=False),
                          "activation"),
    "qwen3moe-scales": (dict(arch="qwen3moe", quant="Q8_0", n_expert=8, n_expert_used=2, expert_scales=True),
                        "scales"),
    "smallthinker-reglu": (dict(arch="smallthinker", quant="Q8_0", n_expert=8, n_expert_used=2), "activation"),
    "step35-clamped": (dict(arch="step35", quant="Q8_0", n_expert=8, n_expert_used=2, n_shared=1,
                            swiglu_clamp=0.5), "clamp"),
}

#: (gate, up, down) ggml types of the quant-mix files: every type of the slot pool's list appears, and the
#: IQ/K mixes put an IQ and a K type in one layer (IQ1/IQ2 and IQ3_XXS get a synthetic importance matrix)
QUANT_MIXES = [
    ("IQ2_XXS", "IQ4_XS", "Q3_K"),
    ("Q2_K", "IQ3_S", "IQ2_XS"),
    ("IQ3_XXS", "Q5_K", "IQ2_S"),
    ("Q4_K", "IQ4_NL", "Q6_K"),
    ("BF16", "F16", "Q8_0"),
]


# both sides in the file's layout (no_repack): the stand-in computes the GPU share with the plain CPU kernels, and
# upstream's repacked ones may round differently (tests/runtime/test_engine_repack.py covers repacked weights)
def _common(rpc_server, **kw):
    d = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=256, n_batch=512, n_ubatch=8, seed=0,
             verbose=False,
             no_repack=True)
    d.update(kw)
    return d


@pytest.fixture(scope="module")
def variant_model(tmp_path_factory):
    """``variant_model(name) -> Path``: the VARIANTS / QUANT_MIXES files, written once per module."""
    from hybrimoe.tiny import make_tiny_model

    made = {}
    root = tmp_path_factory.mktemp("variants")

    def make(name):
        if name not in made:
            if name.startswith("mix:"):
                g, u, d = name[4:].split("/")
                kw = dict(arch="qwen3moe", n_embd=256, n_ff_exp=256, n_expert=6, n_expert_used=2,
                          quant={"base": "Q8_0", "ffn_gate_exps": g, "ffn_up_exps": u, "ffn_down_exps": d})
            else:
                kw = dict(VARIANTS[name][0])
            made[name] = make_tiny_model(root / f"{name.replace(':', '-').replace('/', '-')}.gguf", **kw)
        return made[name]

    return make


def _engine_run(path, rpc_server, split_cost_model, cache="50%", ub=8, control=""):
    from hybrimoe import Llama

    llm = Llama(str(path), moe_cache=cache, moe_cost_model=split_cost_model, **_common(rpc_server, n_ubatch=ub))
    return run_engine_and_close(llm, 20, N_GEN, control)


def _reference(path, rpc_server, tokens, ub=8):
    from hybrimoe import Llama

    ref = Llama(str(path), tensor_buft_overrides="exps=CPU", **_common(rpc_server, n_ubatch=ub))
    try:
        return greedy_with_logits(ref, tokens, N_GEN)
    finally:
        ref.close()


def test_fixtures_have_their_variant(variant_model):
    """Each fixture really is the variant it is named after, as upstream reads it (tensor names, shapes, the
    architecture), and ``hybrimoe info`` names it and says the engine runs it."""
    from hybrimoe.commands.info import format_info
    from hybrimoe.model.reader import describe

    for name in VARIANTS:
        d = describe(variant_model(name))
        v = d["expert_variants"]
        assert v and all(x["engine"] for x in v.values()), (name, v)
        first = next(iter(v.values()))
        if name.startswith("llama4"):
            assert first["weight_before_ffn"] and d["shared"] is not None
        if name == "deepseek2-fused":
            assert first["fused_gate_up"] and set(d["expert_tensors"]) == {"gate_up", "down"}
            il = d["moe_layers"][0]
            F = d["expert_tensors"]["down"]["layers"][il]["shape"][0]
            assert d["expert_tensors"]["gate_up"]["layers"][il]["shape"][1] == 2 * F
        if name == "smallthinker-reglu":
            assert first["activation"] == "relu" and first["gated"]
        if name.startswith("grok"):
            assert first["activation"] == "gelu" and first["gated"] == (name == "grok-geglu")
        if name == "qwen3moe-scales":
            assert first["scales"] == ["down", "gate", "up"]
        if name == "step35-clamped":
            assert first["clamp"] == 0.5 and first["clamp_form"] == "clamp_silu_mul"
        assert f"expert variant:      {first['name']}" in format_info(d)


def test_scales_in_the_slot(variant_model):
    """A slot carries one F32 per kind of per-expert scale (contiguous per region: 4 bytes per slot), so the
    budget's slot size grows by exactly that; the facts name them per layer; a bad scale size is refused."""
    from hybrimoe.commands.info import format_info
    from hybrimoe.model.reader import describe
    from hybrimoe.runtime.engine_facts import engine_facts, engine_module

    path = variant_model("qwen3moe-scales")
    f = engine_facts(path)
    assert [list(b) for b in f.scale_bytes] == [[4, 4, 4]] * len(f.moe_layers)
    mats = sum(f.expert_bytes[0])
    text = format_info(describe(path))
    assert "ffn_down_exps.s" in text
    assert f"bytes per expert:    {mats + 12} (matrices {mats} + biases and scales 12;" in text
    E = engine_module().Engine
    plain = E.slot_bytes_for([tuple(b) for b in f.expert_bytes], [tuple(t) for t in f.expert_types])
    assert f.slot_bytes == plain + 12
    assert list(E.scale_strides([tuple(b) for b in f.scale_bytes], len(f.moe_layers))) == [4, 4, 4]
    with pytest.raises(ValueError, match="scale"):
        E.scale_strides([(8, 4, 4)] * len(f.moe_layers), len(f.moe_layers))


def test_fused_gate_up_in_the_slot(variant_model):
    """A fused gate_up expert takes the slot's first matrix region whole (2 * n_ff rows); the up region is
    empty."""
    from hybrimoe.runtime.engine_facts import engine_facts

    path = variant_model("deepseek2-fused")
    f = engine_facts(path)
    r = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    il = f.moe_layers[0]
    gu = r[f"blk.{il}.ffn_gate_up_exps.weight"]
    assert f.expert_bytes[0][0] == int(gu.n_bytes) // f.n_expert and f.expert_bytes[0][1] == 0


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_upstream_same_placement(name, variant_model, rpc_server, split_cost_model):
    """The hybrid engine on each variant: upstream's greedy tokens and the last logits bit for bit, with experts
    computed on both sides."""
    path = variant_model(name)
    tokens, out, lg, st = _engine_run(path, rpc_server, split_cost_model)
    assert not st["unsupported"] and not st["engine_skipped"], (st["unsupported"], st["engine_skipped"])
    e = st["engine"]
    assert e["gpu_experts"] > 0 and e["cpu_experts"] > 0, e
    ref_out, ref_lg = _reference(path, rpc_server, tokens)
    assert out == ref_out
    assert np.array_equal(lg, ref_lg), nmse(lg, ref_lg)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_on_the_cpu_only_hook_is_upstreams(name, variant_model):
    """The hook without the engine (the CPU-only path: build_expert_ffn over the file's tensors by expert id) on each
    variant gives upstream's CPU run bit for bit, every MoE layer hooked."""
    from hybrimoe import Llama

    path = variant_model(name)
    common = dict(n_ctx=256, n_batch=64, n_ubatch=8, n_threads=2, seed=0, verbose=False)
    llm = Llama(str(path), moe_hook=True, **common)
    try:
        tokens = prompt_tokens(llm, 20)
        out, lg = greedy_with_logits(llm, tokens, N_GEN)
        st = llm.moe_stats()
    finally:
        llm.close()
    assert st["unsupported"] == [] and sum(st["runs"]) > 0, st
    ref = Llama(str(path), **common)
    try:
        ref_out, ref_lg = greedy_with_logits(ref, tokens, N_GEN)
    finally:
        ref.close()
    assert out == ref_out
    assert np.array_equal(lg, ref_lg), nmse(lg, ref_lg)


@pytest.mark.parametrize("name", ["llama4-top2", "deepseek2-fused", "grok-geglu", "grok-gelu-ungated",
                                  "qwen3moe-scales", "step35-clamped", "smallthinker-reglu"])
def test_variant_op_left_out_on_the_gpu_changes_the_logits(name, variant_model, rpc_server, split_cost_model):
    """Negative control: the GPU share without the variant's op (weights after the FFN instead of before; the
    fused product's halves swapped; SiLU in place of GELU or ReLU; no scales; no clamp) no longer matches upstream, so the op
    is really built where the GPU computes."""
    path = variant_model(name)
    tokens, _, lg, st = _engine_run(path, rpc_server, split_cost_model, cache="100%",
                                    control=VARIANTS[name][1])
    assert st["engine"]["gpu_experts"] > 0
    _, ref_lg = _reference(path, rpc_server, tokens)
    assert nmse(lg, ref_lg) > 1e-6


def test_unknown_negative_control_is_refused(variant_model, rpc_server):
    from hybrimoe import Llama

    llm = Llama(str(variant_model("qwen3moe-scales")), moe_cache="25%", **_common(rpc_server))
    try:
        with pytest.raises(ValueError, match="negative control"):
            llm.moe_engine.set_negative_control("no-such-op")
    finally:
        llm.close()


@pytest.mark.parametrize("types", QUANT_MIXES, ids=["-".join(t) for t in QUANT_MIXES])
def test_quant_mix_matches_upstream(types, variant_model, rpc_server, split_cost_model):
    """IQ, K, 8-bit and 16-bit expert types mixed across gate, up and down in the slot pool (each region's stride a
    multiple of 16 and of its type's block bytes): upstream's tokens and logits bit for bit."""
    from hybrimoe.runtime.engine_facts import engine_facts, engine_module

    path = variant_model("mix:" + "/".join(types))
    f = engine_facts(path)
    want = [int(gguf.GGMLQuantizationType[t]) for t in types]
    assert all(list(t) == want for t in f.expert_types), (f.expert_types, want)  # the types really written
    strides = engine_module().Engine.region_strides([tuple(b) for b in f.expert_bytes],
                                                     [tuple(t) for t in f.expert_types])
    for st, b, t in zip(strides, f.expert_bytes[0], types):
        blk = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][1]
        assert st >= b and st % 16 == 0 and st % blk == 0
    tokens, out, lg, st = _engine_run(path, rpc_server, split_cost_model, cache="50%", ub=4)
    assert not st["unsupported"] and not st["engine_skipped"], (st["unsupported"], st["engine_skipped"])
    e = st["engine"]
    assert e["gpu_experts"] > 0 and e["cpu_experts"] > 0, e
    ref_out, ref_lg = _reference(path, rpc_server, tokens, ub=4)
    assert out == ref_out
    assert np.array_equal(lg, ref_lg), nmse(lg, ref_lg)


def test_type_without_block_layout_is_a_clear_error():
    """A ggml type id with no block layout (a removed type) or out of range is refused by name, never placed."""
    from hybrimoe.runtime.engine_facts import engine_module

    E = engine_module().Engine
    removed = 31  # GGML_TYPE_Q4_0_4_4: removed upstream, kept as a number with no block layout
    with pytest.raises(ValueError, match="ggml type"):
        E.region_strides([(1024, 1024, 1024)], [(8, 8, removed)])
    with pytest.raises(ValueError, match="ggml type"):
        E.region_strides([(1024, 1024, 1024)], [(8, 8, 1000)])
