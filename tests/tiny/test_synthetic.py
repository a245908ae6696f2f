"""Tests for hybrimoe.tiny.synthetic and hybrimoe.tiny.rows: full-size-shaped MoE models whose quantized blocks are
written directly. Every shape x quant (at small widths) loads and generates in llama.cpp with finite logits, and its
tensor types are the ones llama.cpp's own quantizer gives the same model written as F32; the random blocks
dequantize (gguf-py) to finite, zero-mean weights of the asked scale; bad input fails with a ValueError naming it."""
from __future__ import annotations

import numpy as np
import pytest

from hybrimoe.tiny import (
    DSV2_LITE_SHAPE,
    GPT_OSS_20B_SHAPE,
    QWEN3_30B_A3B_SHAPE,
    SYNTHETIC_SHAPES,
    make_synthetic_model,
    quantize_gguf,
    random_quant_rows,
    synthetic_tensor_plan,
)

gguf = pytest.importorskip("gguf")

N_LAYER = 4  # use_more_bits(il, 4) holds for blocks 2 and 3: Q4_K_M writes both ffn_down kinds
# each shape at small widths that keep its peculiarities: DeepSeek-V2-Lite's expert rows (1408 there, 160 here) and
# gpt-oss-20b's hidden size (2880 there, 320 here) fit no 256-wide block, so Q4_K_M falls back to 32-wide types;
# heads wider than n_embd / n_head (qwen3, gpt-oss); 16 experts (8 has upstream special cases)
SMALL = {
    "deepseek-v2-lite": dict(DSV2_LITE_SHAPE, n_embd=256, n_ff_exp=160, n_ff_dense=320, n_expert=16,
                             n_expert_used=4, n_head=2, kv_lora_rank=256, qk_rope=32, qk_nope=32, v_head=32),
    "qwen3-30b-a3b": dict(QWEN3_30B_A3B_SHAPE, n_embd=256, n_ff_exp=256, n_expert=16, n_expert_used=4, n_head=4,
                          n_head_kv=2),
    "gpt-oss-20b": dict(GPT_OSS_20B_SHAPE, n_embd=320, n_ff_exp=320, n_expert=16, n_expert_used=4, n_head=8,
                        n_head_kv=2),
}
# the llama.cpp file type whose quantizer rules each quant restates
UPSTREAM_FTYPE = {"Q4_K_M": "Q4_K_M", "Q4_0": "Q4_0", "MXFP4": "MXFP4_MOE", "Q8_0": "Q8_0"}


def _tensors(path) -> dict:
    """{name: (ggml type name, ggml shape)} read back with gguf.GGUFReader."""
    return {t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in gguf.GGUFReader(str(path)).tensors}


def _field(path, key):
    return gguf.GGUFReader(str(path)).fields[key].contents()


@pytest.fixture(scope="module")
def f32_models(tmp_path_factory):
    """Each small shape written as F32: what llama.cpp's quantizer is given for the reference types."""
    d = tmp_path_factory.mktemp("synth-f32")
    return {s: make_synthetic_model(d / f"{s}.gguf", shape=s, quant="F32", n_layer=N_LAYER, **kw)
            for s, kw in SMALL.items()}


# a few types each quant must give, stated here rather than taken from the quantizer: blk.2 is a use_more_bits
# block (Q4_K_M: ffn_down Q6_K, or Q8_0 where 256 does not divide its rows), blk.1 is not
EXPECTED = {
    ("deepseek-v2-lite", "Q4_K_M"): {"blk.1.ffn_gate_exps.weight": "Q4_K", "blk.1.ffn_down_exps.weight": "Q5_0",
                                     "blk.2.ffn_down_exps.weight": "Q8_0", "output.weight": "Q6_K"},
    ("deepseek-v2-lite", "Q4_0"): {"blk.1.ffn_gate_exps.weight": "Q4_0", "blk.1.ffn_down_exps.weight": "Q4_0",
                                   "blk.1.attn_k_b.weight": "Q4_0", "output.weight": "Q6_K"},
    ("deepseek-v2-lite", "MXFP4"): {"blk.1.ffn_up_exps.weight": "MXFP4", "blk.1.ffn_down_exps.weight": "MXFP4",
                                    "blk.1.ffn_up_shexp.weight": "Q8_0", "blk.0.ffn_down.weight": "Q8_0",
                                    "output.weight": "Q8_0"},
    ("qwen3-30b-a3b", "Q4_K_M"): {"blk.1.ffn_up_exps.weight": "Q4_K", "blk.1.ffn_down_exps.weight": "Q4_K",
                                  "blk.2.ffn_down_exps.weight": "Q6_K", "blk.2.attn_v.weight": "Q6_K",
                                  "blk.1.attn_v.weight": "Q4_K", "output.weight": "Q6_K"},
    ("qwen3-30b-a3b", "Q4_0"): {"blk.1.ffn_up_exps.weight": "Q4_0", "blk.2.ffn_down_exps.weight": "Q4_0",
                                "blk.0.attn_v.weight": "Q4_0", "output.weight": "Q6_K"},
    ("qwen3-30b-a3b", "MXFP4"): {"blk.1.ffn_gate_exps.weight": "MXFP4", "blk.1.attn_q.weight": "Q8_0",
                                 "token_embd.weight": "Q8_0", "output.weight": "Q8_0"},
    ("gpt-oss-20b", "Q4_K_M"): {"blk.1.ffn_gate_exps.weight": "Q5_0", "blk.1.ffn_down_exps.weight": "Q5_0",
                                "blk.2.ffn_down_exps.weight": "Q8_0", "blk.1.attn_output.weight": "Q4_K",
                                "output.weight": "Q8_0"},
    ("gpt-oss-20b", "Q4_0"): {"blk.1.ffn_gate_exps.weight": "Q4_0", "blk.3.ffn_down_exps.weight": "Q4_0",
                              "output.weight": "Q8_0"},
    ("gpt-oss-20b", "MXFP4"): {"blk.1.ffn_gate_exps.weight": "MXFP4", "blk.1.ffn_down_exps.weight": "MXFP4",
                               "blk.1.attn_k.weight": "Q8_0", "blk.1.attn_output.weight": "Q8_0",
                               "blk.1.ffn_gate_exps.bias": "F32", "blk.1.attn_sinks.weight": "F32",
                               "output.weight": "Q8_0"},
    ("deepseek-v2-lite", "Q8_0"): {"blk.1.ffn_gate_exps.weight": "Q8_0", "blk.1.ffn_down_exps.weight": "Q8_0",
                                   "output.weight": "Q8_0"},
    ("qwen3-30b-a3b", "Q8_0"): {"blk.1.ffn_up_exps.weight": "Q8_0", "blk.1.attn_q.weight": "Q8_0",
                                "token_embd.weight": "Q8_0"},
    ("gpt-oss-20b", "Q8_0"): {"blk.1.ffn_gate_exps.weight": "Q8_0", "blk.1.attn_k.weight": "Q8_0",
                              "output.weight": "Q8_0"},
}


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q4_0", "MXFP4", "Q8_0"])
@pytest.mark.parametrize("shape", list(SMALL))
def test_types_match_upstream_quantizer_and_model_generates(shape, quant, f32_models, tmp_path):
    """The file's tensors are synthetic_tensor_plan's (names, ggml shapes, types) and their types are what
    llama_model_quantize makes of the same model written as F32 with the quant's file type; llama.cpp loads the
    file and a short greedy generation has finite logits."""
    from hybrimoe import Llama
    from hybrimoe.testing.upstream import greedy_with_logits

    kw = SMALL[shape]
    path = make_synthetic_model(tmp_path / "m.gguf", shape=shape, quant=quant, n_layer=N_LAYER, **kw)
    got = _tensors(path)
    plan = synthetic_tensor_plan(shape=shape, quant=quant, n_layer=N_LAYER, **kw)
    assert list(got) == [pt.name for pt in plan]
    assert all(got[pt.name] == (pt.type, list(pt.shape)) for pt in plan)
    ref = _tensors(quantize_gguf(f32_models[shape], tmp_path / "ref.gguf", UPSTREAM_FTYPE[quant]))
    assert got == ref
    for name, want in EXPECTED[(shape, quant)].items():
        assert got[name][0] == want, name
    assert {t for name, (t, _) in got.items() if name.endswith("_norm.weight") or "ffn_gate_inp" in name} == {"F32"}

    arch = SYNTHETIC_SHAPES[shape][0]
    assert _field(path, "general.architecture") == arch
    assert _field(path, f"{arch}.expert_count") == kw["n_expert"]
    assert _field(path, f"{arch}.expert_used_count") == kw["n_expert_used"]
    assert _field(path, "general.file_type") == int(getattr(gguf.LlamaFileType, {
        "Q4_K_M": "MOSTLY_Q4_K_M", "Q4_0": "MOSTLY_Q4_0", "MXFP4": "MOSTLY_MXFP4_MOE", "Q8_0": "MOSTLY_Q8_0"}[quant]))

    llm = Llama(str(path), n_ctx=64, n_batch=64, n_threads=2, verbose=False)
    try:
        prompt = llm.tokenize(b"once upon a time the cat", add_bos=True, special=False)
        out, logits = greedy_with_logits(llm, prompt, 4)
    finally:
        llm.close()
    assert len(out) >= 1 and all(0 <= t < 512 for t in out)
    assert np.isfinite(logits).all() and logits.std() > 0.1


def test_full_shapes_are_the_models():
    """At the shapes' own sizes (listed, not written): the expert, router and attention tensors have the public
    configs' sizes, and gpt-oss-20b carries its biases and sinks."""
    def plan(shape, quant="Q4_K_M"):
        return {pt.name: (pt.type, pt.shape) for pt in synthetic_tensor_plan(shape=shape, quant=quant, n_layer=2)}

    ds = plan("deepseek-v2-lite")
    assert ds["blk.1.ffn_gate_exps.weight"][1] == (2048, 1408, 64)
    assert ds["blk.1.ffn_up_shexp.weight"][1] == (2048, 2816)  # two shared experts of 1408
    assert ds["blk.0.ffn_down.weight"][1] == (10944, 2048)
    assert ds["blk.1.attn_k_b.weight"][1] == (128, 512, 16)
    qw = plan("qwen3-30b-a3b")
    assert qw["blk.0.ffn_gate_exps.weight"] == ("Q4_K", (2048, 768, 128))
    assert qw["blk.0.ffn_down_exps.weight"][1] == (768, 2048, 128)
    assert qw["blk.0.ffn_gate_inp.weight"] == ("F32", (2048, 128))
    assert qw["blk.0.attn_q.weight"][1] == (2048, 32 * 128) and qw["blk.0.attn_k.weight"][1] == (2048, 4 * 128)
    assert qw["blk.0.attn_q_norm.weight"][1] == (128,)
    assert not any("shexp" in n for n in qw)
    go = plan("gpt-oss-20b", "MXFP4")
    assert go["blk.0.ffn_gate_exps.weight"] == ("MXFP4", (2880, 2880, 32))
    assert go["blk.0.ffn_down_exps.weight"] == ("MXFP4", (2880, 2880, 32))
    assert go["blk.0.ffn_gate_exps.bias"] == ("F32", (2880, 32))
    assert go["blk.0.attn_q.weight"] == ("Q8_0", (2880, 64 * 64))
    assert go["blk.0.attn_v.weight"] == ("Q8_0", (2880, 8 * 64))
    assert go["blk.0.attn_sinks.weight"] == ("F32", (64,))
    # rows of 2880: Q4_K_M's Q4_K and Q6_K fall back to Q5_0 and Q8_0, as upstream's quantizer does
    go = plan("gpt-oss-20b")
    assert go["blk.0.ffn_gate_exps.weight"][0] == "Q5_0" and go["blk.1.ffn_down_exps.weight"][0] == "Q8_0"


def test_head_width_metadata(tmp_path):
    """Heads wider than n_embd / n_head get attention.key_length / value_length (llama.cpp assumes the ratio
    without them); the sliding window of gpt-oss and its SWA layers come from the tiny writer's metadata."""
    p = make_synthetic_model(tmp_path / "q.gguf", shape="qwen3-30b-a3b", quant="Q4_0", n_layer=2,
                             **SMALL["qwen3-30b-a3b"])
    assert _field(p, "qwen3moe.attention.key_length") == 128 == _field(p, "qwen3moe.attention.value_length")
    assert _field(p, "qwen3moe.attention.head_count_kv") == 2
    p = make_synthetic_model(tmp_path / "g.gguf", shape="gpt-oss-20b", quant="MXFP4", n_layer=2,
                             **SMALL["gpt-oss-20b"])
    assert _field(p, "gpt-oss.attention.key_length") == 64
    assert _field(p, "gpt-oss.attention.sliding_window") > 0


def test_same_arguments_same_bytes(tmp_path):
    kw = dict(shape="gpt-oss-20b", quant="MXFP4", n_layer=2, **SMALL["gpt-oss-20b"])
    a = make_synthetic_model(tmp_path / "a.gguf", **kw).read_bytes()
    b = make_synthetic_model(tmp_path / "b.gguf", **kw).read_bytes()
    c = make_synthetic_model(tmp_path / "c.gguf", seed=1, **kw).read_bytes()
    assert a == b and a != c and len(a) == len(c)


def test_q4_0_falls_back_like_upstream(tmp_path):
    """Rows that 32 does not divide: upstream's Q4_0 writes F16 there (and so does Q4_0 here); Q4_K_M refuses them
    as it always has."""
    kw = dict(shape="qwen3-30b-a3b", n_layer=2, **dict(SMALL["qwen3-30b-a3b"], n_ff_exp=48))
    got = _tensors(make_synthetic_model(tmp_path / "q.gguf", quant="Q4_0", **kw))
    assert got["blk.0.ffn_down_exps.weight"][0] == "F16" and got["blk.0.ffn_up_exps.weight"][0] == "Q4_0"
    f32 = make_synthetic_model(tmp_path / "f.gguf", quant="F32", **kw)
    assert got == _tensors(quantize_gguf(f32, tmp_path / "r.gguf", "Q4_0"))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        make_synthetic_model(tmp_path / "k.gguf", quant="Q4_K_M", **kw)


@pytest.mark.parametrize("type_name,row_len", [("Q4_0", 96), ("MXFP4", 96), ("Q4_K", 512), ("Q6_K", 256),
                                               ("Q5_0", 160), ("Q8_0", 96)])
@pytest.mark.parametrize("std", [0.02, 1.0])
def test_random_quant_rows_dequantize_to_zero_mean_weights(type_name, row_len, std):
    """Random blocks are valid: gguf-py dequantizes them to finite weights, mean ~0, standard deviation ~std."""
    from gguf.quants import dequantize

    qt = gguf.GGMLQuantizationType[type_name]
    blocks = random_quant_rows(np.random.default_rng(1), type_name, 256, row_len, std)
    blk, size = gguf.GGML_QUANT_SIZES[qt]
    assert blocks.dtype == np.uint8 and blocks.shape == (256, row_len // blk * size)
    w = dequantize(blocks, qt)
    assert w.shape == (256, row_len) and np.isfinite(w).all()
    assert abs(float(w.mean())) < 0.05 * std and 0.95 * std < float(w.std()) < 1.05 * std
    if type_name == "MXFP4":  # two neighbouring E8M0 exponents, mixed to give the variance
        assert len(np.unique(blocks.reshape(-1, size)[:, 0])) == 2


def test_bad_input(tmp_path):
    kw = SMALL["qwen3-30b-a3b"]
    with pytest.raises(ValueError, match="unknown shape 'mixtral'"):
        make_synthetic_model(tmp_path / "a.gguf", shape="mixtral")
    with pytest.raises(ValueError, match="quant must be one of .*'Q5_K_S'"):
        make_synthetic_model(tmp_path / "a.gguf", shape="qwen3-30b-a3b", quant="Q5_K_S", **kw)
    with pytest.raises(ValueError, match="has no kv_lora_rank"):
        make_synthetic_model(tmp_path / "a.gguf", shape="qwen3-30b-a3b", kv_lora_rank=64)
    with pytest.raises(ValueError, match="has no n_head_kv"):
        make_synthetic_model(tmp_path / "a.gguf", n_head_kv=2)
    with pytest.raises(ValueError, match="8-expert"):
        make_synthetic_model(tmp_path / "a.gguf", shape="gpt-oss-20b", quant="Q4_0",
                             **dict(SMALL["gpt-oss-20b"], n_expert=8, n_expert_used=2))
    with pytest.raises(ValueError, match="n_expert_used"):
        make_synthetic_model(tmp_path / "a.gguf", shape="qwen3-30b-a3b", **dict(kw, n_expert_used=17))
    with pytest.raises(ValueError, match="multiple of n_head_kv"):
        make_synthetic_model(tmp_path / "a.gguf", shape="qwen3-30b-a3b", **dict(kw, n_head_kv=3))
    with pytest.raises(ValueError, match="n_dense_lead"):
        make_synthetic_model(tmp_path / "a.gguf", n_layer=2, **dict(SMALL["deepseek-v2-lite"], n_dense_lead=2))
    with pytest.raises(ValueError, match="no writer"):
        random_quant_rows(np.random.default_rng(0), "IQ2_XS", 1, 256, 0.1)
    with pytest.raises(ValueError, match="std must be"):
        random_quant_rows(np.random.default_rng(0), "MXFP4", 1, 32, 0.0)
    assert not list(tmp_path.iterdir())  # nothing half-written left behind
