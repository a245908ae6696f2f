"""gpt-oss's experts on the engine: expert biases (ggml_add_id, by expert id on the CPU share, by slot on the GPU
share: the slot pool carries one bias row of each kind per slot) and the SwiGLU-OAI activation (ggml_swiglu_oai with
build_moe_ffn's alpha and clamp limit).

The oracle is upstream llama.cpp with the same placement on the RPC stand-in (``-ot exps=CPU --no-repack``): same
greedy tokens and bit-identical last logits (both sides run ggml-cpu's kernels on the same rows in upstream's order,
so nothing but an error can make them differ), with a GPU share and a CPU share in every run.
"""
from __future__ import annotations

import numpy as np
import pytest

from hybrimoe.testing.upstream import greedy_with_logits, nmse, prompt_tokens, run_engine_and_close

N_GEN = 16


# both sides in the file's layout (no_repack): the stand-in computes the GPU share with the plain CPU kernels, and
# upstream's repacked ones may round differently (tests/runtime/test_engine_repack.py covers repacked weights)
def _common(rpc_server, **kw):
    d = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=256, n_batch=512, n_ubatch=32, seed=0,
             verbose=False,
             no_repack=True)
    d.update(kw)
    return d


def _model(tiny_model):
    # the fixture's gpt-oss: attention sinks, sliding-window layers, router bias, per-expert biases of every kind;
    # Q8_0 matrices (the biases stay F32: llama.cpp's quantizer leaves 1-D/2-D bias tensors alone)
    return tiny_model("gpt-oss", "Q8_0")


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    """The fixture's gpt-oss with MXFP4 expert matrices (as gpt-oss files ship them; 32-element blocks of 17
    bytes, so a slot region's stride is a multiple of lcm(16, 17) = 272 bytes), Q8_0 elsewhere, F32 biases."""
    from hybrimoe.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mxfp4") / "gpt-oss-mxfp4.gguf", "gpt-oss",
                           quant={"base": "Q8_0", r"ffn_(gate|up|down)_exps": "MXFP4"})


def _reference(path, rpc_server, tokens, **kw):
    from hybrimoe import Llama

    ref = Llama(str(path), tensor_buft_overrides="exps=CPU", **_common(rpc_server, **kw))
    try:
        return greedy_with_logits(ref, tokens, N_GEN)
    finally:
        ref.close()


def test_facts_and_slot_bytes_carry_the_biases(tiny_model):
    """engine_facts reads one F32 bias row per kind and layer; a slot holds them besides the matrices (each
    rounded up to 16 bytes), so the budget's slot size grows by exactly that; ``hybrimoe info`` lists them."""
    import gguf

    from hybrimoe.commands.info import format_info
    from hybrimoe.model.reader import describe
    from hybrimoe.runtime.engine_facts import engine_facts, engine_module

    path = _model(tiny_model)
    f = engine_facts(path)
    names = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    il = f.moe_layers[0]
    want = [int(names[f"blk.{il}.ffn_{k}_exps.bias"].shape[0]) * 4 for k in ("gate", "up", "down")]
    assert [list(b) for b in f.bias_bytes] == [want] * len(f.moe_layers)
    E = engine_module().Engine
    plain = E.slot_bytes_for([tuple(b) for b in f.expert_bytes], [tuple(t) for t in f.expert_types])
    assert f.slot_bytes == plain + sum((b + 15) // 16 * 16 for b in want)
    assert list(E.bias_strides([tuple(b) for b in f.bias_bytes], len(f.moe_layers))) == \
        [(b + 15) // 16 * 16 for b in want]
    d = describe(path)
    assert d["expert_biases"]["down"]["bytes_per_expert"] == want[2]
    text = format_info(d)
    assert "ffn_down_exps.b" in text
    mats = sum(f.expert_bytes[0])
    assert f"bytes per expert:    {mats + sum(want)} (matrices {mats} + biases {sum(want)};" in text
    with pytest.raises(ValueError, match="bias"):
        E.slot_bytes_for([tuple(b) for b in f.expert_bytes], [tuple(t) for t in f.expert_types], [(6, 4, 4)] *
                         len(f.moe_layers))


# (ubatch 1: under the split cost model the hybrimoe planner loads every single-token miss to the GPU, so that
# case runs the hot-set preset over a seeded profile, whose misses stay on the CPU: both shares in the run)
@pytest.mark.parametrize("quant, cache, ub, policy", [("Q8_0", "25%", 1, "hot-set"),
                                                      ("Q8_0", "50%", 7, "hybrimoe"),
                                                      ("Q8_0", "100%", 32, "hybrimoe"),
                                                      ("MXFP4", "50%", 4, "hybrimoe")])
def test_gpt_oss_matches_upstream_same_placement(quant, cache, ub, policy, tiny_model, mxfp4_model, rpc_server,
                                                   split_cost_model):
    """The hybrid engine on gpt-oss: upstream's greedy tokens and the last logits bit for bit, with experts
    computed on both sides (biases by expert id on the CPU, by slot on the GPU)."""
    import gguf

    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts

    path = _model(tiny_model) if quant == "Q8_0" else mxfp4_model
    want = int(gguf.GGMLQuantizationType[quant])
    assert all(t == [want] * 3 for t in map(list, engine_facts(path).expert_types))  # MXFP4 really written
    f = engine_facts(path)
    profile = (np.random.default_rng(0).integers(0, 50, (len(f.moe_layers), f.n_expert))
               if policy == "hot-set" else None)
    llm = Llama(str(path), moe_cache=cache, moe_policy=policy, moe_profile=profile, moe_cost_model=split_cost_model,
                **_common(rpc_server, n_ubatch=ub))
    tokens, out, lg, st = run_engine_and_close(llm, 20, N_GEN)
    assert not st["unsupported"] and not st["engine_skipped"], (st["unsupported"], st["engine_skipped"])
    e = st["engine"]
    assert e["gpu_experts"] > 0 and e["cpu_experts"] > 0, e
    ref_out, ref_lg = _reference(path, rpc_server, tokens, n_ubatch=ub)
    assert out == ref_out
    assert np.array_equal(lg, ref_lg), nmse(lg, ref_lg)


def test_wrong_bias_rows_on_the_gpu_change_the_logits(tiny_model, rpc_server, split_cost_model):
    """Negative control: slots given the next expert's bias rows (matrices right) no longer match upstream, so
    the bias regions are really read, by slot."""
    from hybrimoe import Llama

    path = _model(tiny_model)
    llm = Llama(str(path), moe_cache="100%", moe_cost_model=split_cost_model, **_common(rpc_server))
    try:
        llm.moe_engine.set_wrong_bias_rows(True)
        tokens = prompt_tokens(llm, 20)
        _, lg = greedy_with_logits(llm, tokens, 1)
        gpu_experts = llm.moe_stats()["engine"]["gpu_experts"]
    finally:
        llm.close()
    ref = Llama(str(path), tensor_buft_overrides="exps=CPU", **_common(rpc_server))
    try:
        _, ref_lg = greedy_with_logits(ref, tokens, 1)
    finally:
        ref.close()
    assert gpu_experts > 0
    assert nmse(lg, ref_lg) > 1e-6


def test_swiglu_oai_clamp_is_upstreams(tiny_model, rpc_server, split_cost_model, tmp_path):
    """Gate and up biases of magnitude 12 put every pre-activation beyond SwiGLU-OAI's limit (7: ggml_swiglu_oai
    clamps the gate from above and the up projection to [-7, 7]; the matrices' part is far smaller), so the clamp is
    active in every expert the tokens reach; the engine still gives upstream's tokens and logits bit for bit."""
    import shutil

    import gguf

    from hybrimoe import Llama

    path = tmp_path / "gpt-oss-clamped.gguf"
    shutil.copy(tiny_model("gpt-oss", None), path)
    r = gguf.GGUFReader(str(path), "r+")
    rng = np.random.default_rng(7)
    n_edited = 0
    for t in r.tensors:
        if t.name.endswith(("ffn_gate_exps.bias", "ffn_up_exps.bias")):
            t.data[...] = (12.0 * rng.choice([-1.0, 1.0], size=t.data.shape)).astype(np.float32)
            n_edited += 1
    r.data.flush()
    del r
    assert n_edited >= 2
    llm = Llama(str(path), moe_cache="50%", moe_cost_model=split_cost_model, **_common(rpc_server, n_ubatch=8))
    try:
        tokens = prompt_tokens(llm, 20)
        out, lg = greedy_with_logits(llm, tokens, N_GEN)
        e = llm.moe_stats()["engine"]
    finally:
        llm.close()
    assert e["gpu_experts"] > 0 and e["cpu_experts"] > 0, e
    ref_out, ref_lg = _reference(path, rpc_server, tokens, n_ubatch=8)
    assert out == ref_out
    assert np.array_equal(lg, ref_lg), nmse(lg, ref_lg)
