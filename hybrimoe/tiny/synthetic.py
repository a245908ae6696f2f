"""Full-size synthetic MoE models for benchmarks: quantized blocks written directly.

:func:`make_synthetic_model` writes a GGUF with the MoE shape of a real model (``SYNTHETIC_SHAPES``: DeepSeek-V2-Lite,
Qwen3-30B-A3B or gpt-oss-20b, fewer blocks) whose weights are random quantized blocks
(:func:`hybrimoe.tiny.rows.random_quant_rows`) of the types an upstream file type would give each tensor
(``SYNTHETIC_QUANTS``: Q4_K_M, Q4_0, gpt-oss's MXFP4, Q8_0), streamed tensor by tensor: several GB in seconds, in
constant memory. :func:`synthetic_tensor_plan` lists its tensors, shapes and types.

The deepseek2 tensors and metadata are this module's own (MLA without a query low-rank projection, as
DeepSeek-V2-Lite); the qwen3moe and gpt-oss ones are :mod:`hybrimoe.tiny.tiny_model`'s (``_attention``,
``_moe_ffn``, ``_write_metadata``), listed here with shapes and scales instead of drawn values.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np

from hybrimoe.outputs import atomic_path
from hybrimoe.tiny.quantize import fallback_type, q4_k_m_type
from hybrimoe.tiny.rows import random_quant_rows
from hybrimoe.tiny.tiny_model import _attention, _moe_ffn, _Shape, _write_metadata
from hybrimoe.tiny.tokenizers import N_VOCAB, _write_tokenizer

# DeepSeek-V2-Lite's shape (config.json of deepseek-ai/DeepSeek-V2-Lite: hidden_size 2048, moe_intermediate_size
# 1408, intermediate_size 10944, n_routed_experts 64, num_experts_per_tok 6, n_shared_experts 2,
# num_attention_heads 16, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128,
# first_k_dense_replace 1): the defaults of make_synthetic_model, except n_layer (27 there; fewer here, so a
# benchmark model fits a short GPU session)
DSV2_LITE_SHAPE = dict(n_embd=2048, n_ff_exp=1408, n_ff_dense=10944, n_expert=64, n_expert_used=6, n_shared=2,
                       n_head=16, kv_lora_rank=512, qk_rope=64, qk_nope=128, v_head=128, n_dense_lead=1)
# Qwen3-30B-A3B's shape (config.json of Qwen/Qwen3-30B-A3B: hidden_size 2048, moe_intermediate_size 768,
# num_experts 128, num_experts_per_tok 8, num_attention_heads 32, num_key_value_heads 4, head_dim 128; every
# block MoE, no shared expert; 48 blocks there)
QWEN3_30B_A3B_SHAPE = dict(n_embd=2048, n_ff_exp=768, n_expert=128, n_expert_used=8, n_head=32, n_head_kv=4,
                           head_dim=128)
# gpt-oss-20b's shape (config.json of openai/gpt-oss-20b: hidden_size 2880, intermediate_size 2880 (the expert
# width), num_local_experts 32, num_experts_per_tok 4, num_attention_heads 64, num_key_value_heads 8, head_dim
# 64; expert biases, attention sinks, sliding-window attention on every other block, SwiGLU with clamped
# inputs; 24 blocks there)
GPT_OSS_20B_SHAPE = dict(n_embd=2880, n_ff_exp=2880, n_expert=32, n_expert_used=4, n_head=64, n_head_kv=8,
                         head_dim=64)

#: shape name -> (llama.cpp architecture, sizes)
SYNTHETIC_SHAPES = {
    "deepseek-v2-lite": ("deepseek2", DSV2_LITE_SHAPE),
    "qwen3-30b-a3b": ("qwen3moe", QWEN3_30B_A3B_SHAPE),
    "gpt-oss-20b": ("gpt-oss", GPT_OSS_20B_SHAPE),
}
#: quant name -> the llama.cpp file type written as general.file_type
SYNTHETIC_QUANTS = {
    "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "F32": gguf.LlamaFileType.ALL_F32,
}


class PlanTensor(NamedTuple):
    """One tensor of a synthetic model: ``name``; ``shape`` in ggml order ``(ne0, ne1, ne2)`` (ne0 the row
    length, elements); ``type`` a ggml type name; ``std`` the standard deviation of its random weights; ``fill``
    None for random weights, else the value of every element (norm weights 1, biases 0; F32)."""

    name: str
    shape: tuple
    type: str
    std: float
    fill: float | None


def tensor_type(quant: str, name: str, shape: tuple, n_layer: int) -> str:
    """The ggml type upstream's quantizer (llama-quant.cpp, ``llama_tensor_get_type``) gives tensor ``name`` of
    ggml ``shape`` in a model of ``n_layer`` blocks for the file type behind ``quant`` (a key of ``SYNTHETIC_QUANTS``):

    - every quant: 1-D tensors, tensors not named ``*weight`` (biases), ``*_norm.weight`` and the router
      ``ffn_gate_inp.weight`` stay F32 (upstream's ``tensor_allows_quantization``);
    - ``"Q4_K_M"``: :func:`hybrimoe.tiny.quantize.q4_k_m_type`;
    - ``"Q4_0"``: Q4_0, except ``output.weight``: Q6_K (Q8_0 when 32 does not divide its rows);
    - ``"MXFP4"`` (``LLAMA_FTYPE_MOSTLY_MXFP4_MOE``): 3-D tensors with more than one matrix MXFP4 (the routed
      experts; deepseek2's per-head ``attn_k_b``/``attn_v_b`` too, as upstream does), every other weight Q8_0,
      ``output.weight`` included: the layout gpt-oss ships in (ggml-org/gpt-oss-20b-GGUF's
      ``gpt-oss-20b-mxfp4.gguf``: MXFP4 experts, Q8_0 embeddings, attention and output head);
    - ``"Q8_0"``: Q8_0;
    - ``"F32"``: F32;

    then the row-length fallback (:func:`hybrimoe.tiny.quantize.fallback_type`: e.g. Q4_K -> Q5_0, Q6_K -> Q8_0
    on rows that 256 does not divide, F16 where 32 does not).

    Raises:
        ValueError: ``quant`` is not a key of ``SYNTHETIC_QUANTS``.
    """
    if quant not in SYNTHETIC_QUANTS:
        raise ValueError(f"unknown quant {quant!r}; valid: {', '.join(SYNTHETIC_QUANTS)}")
    if (quant == "F32" or len(shape) < 2 or not name.endswith("weight") or name.endswith("_norm.weight")
            or name.endswith("ffn_gate_inp.weight")):
        return "F32"
    if quant == "Q4_K_M":
        return q4_k_m_type(name, shape[0], n_layer)
    if quant == "Q4_0":
        # the output head: Q8_0 when the file type's block does not divide its rows, else Q6_K
        t = ("Q6_K" if shape[0] % 32 == 0 else "Q8_0") if name == "output.weight" else "Q4_0"
    elif quant == "Q8_0":
        t = "Q8_0"
    else:
        t = "MXFP4" if len(shape) == 3 and shape[2] > 1 else "Q8_0"
    return fallback_type(t, shape[0])


# the knobs each shape takes (make_synthetic_model's arguments; None there means the shape's value)
_COMMON = ("n_embd", "n_ff_exp", "n_expert", "n_expert_used", "n_head")


def _sizes(shape: str, given: dict) -> dict:
    """``shape``'s sizes with the non-None values of ``given`` in their place, checked.

    Raises:
        ValueError: unknown shape, a knob the shape does not have, a size that is not an integer >= 1 (>= 0
            for ``n_dense_lead``), or sizes that do not fit together (k > E, heads not a multiple of KV heads).
    """
    if shape not in SYNTHETIC_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; valid: {', '.join(SYNTHETIC_SHAPES)}")
    arch, base = SYNTHETIC_SHAPES[shape]
    sizes = dict(base)
    for key, value in given.items():
        if value is None:
            continue
        if key not in sizes:
            takes = ", ".join(sorted(set(base) - set(_COMMON)))
            raise ValueError(f"shape {shape!r} ({arch}) has no {key}; besides {', '.join(_COMMON)} it takes "
                             f"{takes}")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        sizes[key] = int(value)
    for key, value in sizes.items():
        if value < (0 if key == "n_dense_lead" else 1):
            raise ValueError(f"{key} must be >= {0 if key == 'n_dense_lead' else 1}, got {value}")
    if sizes["n_expert_used"] > sizes["n_expert"]:
        raise ValueError(f"n_expert_used must be in 1..n_expert ({sizes['n_expert']}), got {sizes['n_expert_used']}")
    if "n_head_kv" in sizes and sizes["n_head"] % sizes["n_head_kv"]:
        raise ValueError(f"n_head ({sizes['n_head']}) must be a multiple of n_head_kv ({sizes['n_head_kv']})")
    if "head_dim" in sizes and sizes["head_dim"] % 2:
        raise ValueError(f"head_dim must be even (rope rotates pairs), got {sizes['head_dim']}")
    return sizes


def _deepseek2_plan(n_layer: int, z: dict, n_vocab: int, quant: str, s: float) -> list[PlanTensor]:
    """The tensors of a deepseek2 model of sizes ``z`` (MLA attention without a query low-rank projection, like
    DeepSeek-V2-Lite; ``n_dense_lead`` leading dense blocks, shared experts), in file order."""
    D, F, E, H = z["n_embd"], z["n_ff_exp"], z["n_expert"], z["n_head"]
    qk_nope, qk_rope, kv_lora, v_head = z["qk_nope"], z["qk_rope"], z["kv_lora_rank"], z["v_head"]
    n_ff_dense, n_shared = z["n_ff_dense"], z["n_shared"]
    qk = qk_nope + qk_rope
    plan = []

    def add(name, shape, std):
        shape = tuple(int(x) for x in shape)
        plan.append(PlanTensor(name, shape, tensor_type(quant, name, shape, n_layer), float(std),
                               1.0 if len(shape) == 1 else None))

    add("token_embd.weight", (D, n_vocab), 1.0)
    add("output_norm.weight", (D,), 0.0)
    add("output.weight", (D, n_vocab), 1 / np.sqrt(D))
    for il in range(n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", (D,), 0.0)
        add(p + "attn_q.weight", (D, H * qk), 1 / np.sqrt(D))
        add(p + "attn_kv_a_mqa.weight", (D, kv_lora + qk_rope), 1 / np.sqrt(D))
        add(p + "attn_kv_a_norm.weight", (kv_lora,), 0.0)
        add(p + "attn_k_b.weight", (qk_nope, kv_lora, H), 1 / np.sqrt(qk_nope))
        add(p + "attn_v_b.weight", (kv_lora, v_head, H), 1 / np.sqrt(kv_lora))
        add(p + "attn_output.weight", (H * v_head, D), s / np.sqrt(H * v_head))
        add(p + "ffn_norm.weight", (D,), 0.0)
        if il < z["n_dense_lead"]:
            add(p + "ffn_gate.weight", (D, n_ff_dense), 1 / np.sqrt(D))
            add(p + "ffn_up.weight", (D, n_ff_dense), 1 / np.sqrt(D))
            add(p + "ffn_down.weight", (n_ff_dense, D), 2 * s / np.sqrt(n_ff_dense))
            continue
        add(p + "ffn_gate_inp.weight", (D, E), 1 / np.sqrt(D))
        add(p + "ffn_gate_exps.weight", (D, F, E), 1 / np.sqrt(D))
        add(p + "ffn_up_exps.weight", (D, F, E), 1 / np.sqrt(D))
        add(p + "ffn_down_exps.weight", (F, D, E), 2 * s / np.sqrt(F))
        add(p + "ffn_gate_shexp.weight", (D, F * n_shared), 1 / np.sqrt(D))
        add(p + "ffn_up_shexp.weight", (D, F * n_shared), 1 / np.sqrt(D))
        add(p + "ffn_down_shexp.weight", (F * n_shared, D), 2 * s / np.sqrt(F * n_shared))
    return plan


class _Spec(NamedTuple):
    """What :class:`_Specs` gives for a tensor: its numpy shape, and the std or constant of its values."""

    np_shape: tuple
    std: float
    fill: float | None


class _Specs:
    """Stands in for :class:`hybrimoe.tiny.tiny_model._Draws`: records each tensor's shape and scale instead of
    drawing its values, so that the tiny writer's tensor lists (``_attention``, ``_moe_ffn``) describe the
    full-size models too. The expert variants that need drawn values (fused gate/up, expert scales) are not
    offered by the synthetic writer."""

    @staticmethod
    def normal(shape, std):
        return _Spec(tuple(int(x) for x in shape), float(std), None)

    @staticmethod
    def ones(n):
        return _Spec((int(n),), 0.0, 1.0)

    @staticmethod
    def zeros(n):
        return _Spec((int(n),), 0.0, 0.0)

    @staticmethod
    def full(n, value):
        return _Spec((int(n),), 0.0, float(value))

    @staticmethod
    def uniform(n, lo, hi):
        raise ValueError("the synthetic writer has no tensors of uniform values (expert scales)")


def _tiny_arch_shape(arch: str, n_layer: int, z: dict, s: float, n_ctx_train: int) -> _Shape:
    """The :class:`hybrimoe.tiny.tiny_model._Shape` of a full-size ``arch`` (qwen3moe or gpt-oss) model of
    sizes ``z``: what the tiny writer's tensor lists and metadata read."""
    return _Shape(arch=arch, D=z["n_embd"], F=z["n_ff_exp"], E=z["n_expert"], k=z["n_expert_used"], ns=0,
                  L=n_layer, n_head=z["n_head"], n_head_kv=z["n_head_kv"], hd=z["head_dim"], n_dense=0,
                  n_ff_d=z["n_ff_exp"], tokenizer="spm", router_margin=4.0, s=s, n_ctx_train=n_ctx_train,
                  chat_template=None, variant={})


def _tiny_arch_plan(sh: _Shape, n_vocab: int, quant: str) -> list[PlanTensor]:
    """The tensors of a qwen3moe or gpt-oss model of shape ``sh``, in the tiny writer's order and with its
    scales; the embeddings, output head and routers random (the tiny writer's are designed: see
    :mod:`hybrimoe.tiny.router`)."""
    D = sh.D
    t = {}
    t["token_embd.weight"] = _Specs.normal((n_vocab, D), 1.0)
    t["output_norm.weight"] = _Specs.ones(D)
    t["output.weight"] = _Specs.normal((n_vocab, D), 1 / np.sqrt(D))
    for il in range(sh.L):
        p = f"blk.{il}."
        _attention(t, p, sh, _Specs)
        _moe_ffn(t, p, sh, _Specs, _Specs.normal((sh.E, D), 1 / np.sqrt(D)))
    plan = []
    for name, spec in t.items():
        shape = tuple(reversed(spec.np_shape))
        plan.append(PlanTensor(name, shape, tensor_type(quant, name, shape, sh.L), spec.std, spec.fill))
    return plan


def synthetic_tensor_plan(*, n_layer: int, shape: str = "deepseek-v2-lite", quant: str = "Q4_K_M",
                          n_vocab: int = N_VOCAB, residual_scale: float = 0.15, **sizes) -> list[PlanTensor]:
    """The tensors of :func:`make_synthetic_model`'s file for the same arguments, in file order: a list of
    :class:`PlanTensor` ``(name, ggml shape (ne0, ne1, ne2), ggml type name, weight std, fill)``.

    Args:
        n_layer: blocks. shape: a key of ``SYNTHETIC_SHAPES``. quant: a key of ``SYNTHETIC_QUANTS`` (types:
            :func:`tensor_type`).
        n_vocab: rows of the embeddings and output head. residual_scale: as in :func:`make_synthetic_model`.
        sizes: the shape's sizes to change (the keys of its ``SYNTHETIC_SHAPES`` entry, e.g. ``n_embd``; None
            keeps the shape's value).

    Raises:
        ValueError: unknown shape or quant, a size the shape does not have, or sizes that do not fit together.
    """
    if quant not in SYNTHETIC_QUANTS:
        raise ValueError(f"unknown quant {quant!r}; valid: {', '.join(SYNTHETIC_QUANTS)}")
    if n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {n_layer}")
    z = _sizes(shape, sizes)
    arch = SYNTHETIC_SHAPES[shape][0]
    if arch == "deepseek2":
        return _deepseek2_plan(n_layer, z, n_vocab, quant, residual_scale)
    return _tiny_arch_plan(_tiny_arch_shape(arch, n_layer, z, residual_scale, 4096), n_vocab, quant)


def _write_deepseek2_metadata(w, *, quant: str, n_layer: int, n_ctx_train: int, z: dict) -> None:
    """The metadata of a deepseek2 :func:`make_synthetic_model` file of sizes ``z``."""
    w.add_name("hybrimoe-synthetic-deepseek2")
    _write_tokenizer(w, "spm")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(z["n_embd"])
    w.add_block_count(n_layer)
    w.add_feed_forward_length(z["n_ff_dense"])
    w.add_expert_feed_forward_length(z["n_ff_exp"])
    w.add_head_count(z["n_head"])
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(z["qk_rope"])
    w.add_leading_dense_block_count(z["n_dense_lead"])
    w.add_q_lora_rank(0)
    w.add_kv_lora_rank(z["kv_lora_rank"])
    w.add_key_length(z["kv_lora_rank"] + z["qk_rope"])
    w.add_value_length(z["kv_lora_rank"])
    w.add_key_length_mla(z["qk_nope"] + z["qk_rope"])
    w.add_value_length_mla(z["v_head"])
    w.add_expert_count(z["n_expert"])
    w.add_expert_used_count(z["n_expert_used"])
    w.add_expert_shared_count(z["n_shared"])
    w.add_expert_weights_scale(1.0)
    w.add_expert_weights_norm(False)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_file_type(SYNTHETIC_QUANTS[quant])


def _add_tensor_infos(w, plan: list[PlanTensor]) -> None:
    """The info (name, shape, type, size) of every tensor of ``plan``; the data follows, tensor by tensor."""
    for pt in plan:
        qt = gguf.GGMLQuantizationType[pt.type]
        blk, size = gguf.GGML_QUANT_SIZES[qt]
        rows = int(np.prod(pt.shape[1:], dtype=np.int64)) if len(pt.shape) > 1 else 1
        nbytes = rows * pt.shape[0] // blk * size
        np_shape = tuple(reversed(pt.shape))
        if pt.type in ("F32", "F16"):
            w.add_tensor_info(pt.name, np_shape, np.dtype(np.float32 if pt.type == "F32" else np.float16), nbytes)
        else:
            w.add_tensor_info(pt.name, np_shape[:-1] + (pt.shape[0] // blk * size,), np.dtype(np.uint8), nbytes,
                              raw_dtype=qt)


def make_synthetic_model(path, *, shape: str = "deepseek-v2-lite", quant: str = "Q4_K_M", seed: int = 0,
                         n_layer: int = 8, n_embd: int | None = None, n_ff_exp: int | None = None,
                         n_ff_dense: int | None = None, n_expert: int | None = None,
                         n_expert_used: int | None = None, n_shared: int | None = None, n_head: int | None = None,
                         kv_lora_rank: int | None = None, qk_rope: int | None = None, qk_nope: int | None = None,
                         v_head: int | None = None, n_dense_lead: int | None = None, n_head_kv: int | None = None,
                         head_dim: int | None = None, residual_scale: float = 0.15, n_ctx_train: int = 4096,
                         progress: bool = False) -> Path:
    """Write a full-size MoE GGUF with the MoE shape of a real model (``n_layer`` blocks) and random weights
    whose quantized blocks are written directly (:func:`random_quant_rows`), not quantized from floats: a model
    of several GB is written in seconds without tens of GB of floats. For benchmarks (speed, memory, cache
    behaviour with routing replay), not for text: the router is random, so without replay routing is arbitrary,
    and the tokenizer is the tiny 512-token one of :func:`make_tiny_model`.

    Shapes (``SYNTHETIC_SHAPES``; sizes from each model's config.json on Hugging Face; only the MoE-related
    sizes and the attention's head layout are the model's, not its vocabulary, rope or context settings):

    - ``"deepseek-v2-lite"`` (deepseek-ai/DeepSeek-V2-Lite; ``DSV2_LITE_SHAPE``): deepseek2, D 2048, 64 routed
      experts of width 1408, top-6, 2 shared experts, one leading dense block (FFN 10944), MLA attention of 16
      heads (kv_lora_rank 512, rope/nope/v head dims 64/128/128) without a query low-rank projection;
    - ``"qwen3-30b-a3b"`` (Qwen/Qwen3-30B-A3B; ``QWEN3_30B_A3B_SHAPE``): qwen3moe, D 2048, 128 experts of width
      768, top-8, no shared expert, 32 query / 4 KV heads of 128;
    - ``"gpt-oss-20b"`` (openai/gpt-oss-20b; ``GPT_OSS_20B_SHAPE``): llama.cpp's ``gpt-oss`` architecture
      (``gguf.MODEL_ARCH.GPT_OSS``), D 2880, 32 experts of width 2880, top-4, 64 query / 8 KV heads of 64,
      expert and router biases, attention sinks, sliding-window attention on every other block, SwiGLU-OAI.

    Args:
        path: output file (parent directories are created; written to a temporary file, then renamed).
        shape: a key of ``SYNTHETIC_SHAPES``.
        quant: ``"Q4_K_M"``, ``"Q4_0"``, ``"MXFP4"``, ``"Q8_0"`` or ``"F32"``: each tensor gets the type
            upstream's quantizer gives it for that file type (:func:`tensor_type`). ``"Q4_K_M"``: e.g.
            ``ffn_gate_exps``/``ffn_up_exps`` Q4_K, ``ffn_down_exps`` Q5_0 or, in Q6_K layers, Q8_0 when
            ``n_ff_exp`` is not a multiple of 256; ``"Q4_0"``: Q4_0 weights, Q6_K output head; ``"MXFP4"``: as
            gpt-oss ships, routed experts MXFP4 and the other weights Q8_0; ``"Q8_0"``: Q8_0 weights (these shapes'
            rows are multiples of 32: no fallback); ``"F32"``: every tensor F32 (small models, e.g. to check the
            type plan against llama.cpp's quantizer).
        seed: RNG seed; the same arguments give a byte-identical file.
        n_layer: blocks (deepseek2: the first ``n_dense_lead`` with a dense FFN of width ``n_ff_dense``, the
            others MoE; qwen3moe and gpt-oss: all MoE).
        n_embd, n_ff_exp, n_expert, n_expert_used, n_head: hidden size D, routed expert width F, routed experts E,
            top-k and query heads; None takes the shape's.
        n_ff_dense, n_shared, kv_lora_rank, qk_rope, qk_nope, v_head, n_dense_lead: deepseek-v2-lite only (None:
            the shape's): dense FFN width, shared experts (one FFN of width ``n_shared * F`` per MoE block), MLA
            sizes (queries without low-rank projection: ``attention.q_lora_rank`` 0), leading dense blocks.
        n_head_kv, head_dim: qwen3-30b-a3b and gpt-oss-20b only (None: the shape's): KV heads and the width of
            every head (elements; ``attention.key_length``/``value_length`` when ``head_dim * n_head != D``).
        residual_scale: weight scale of the projections into the residual stream (as ``make_tiny_model``).
        n_ctx_train: ``context_length`` written to the file.
        progress: print one line per written block to stderr.

    Sizes at the shapes' widths: routed experts per MoE block (MiB; two values where Q4_K_M's Q6_K blocks
    differ) and the whole file at the default 8 blocks (GiB):

    ====================  ==================  ===============  ===============
    shape                 Q4_K_M              Q4_0             MXFP4
    ====================  ==================  ===============  ===============
    deepseek-v2-lite      319-385 / 2.55      297 / 2.19       280 / 2.21
    qwen3-30b-a3b         324-374 / 2.81      324 / 2.62       306 / 2.55
    gpt-oss-20b           522-617 / 4.59      427 / 3.46       403 / 3.38
    ====================  ==================  ===============  ===============

    (gpt-oss-20b's rows of 2880 fit no 256-wide block, so its Q4_K_M experts fall back to Q5_0 and Q8_0.)

    Raises:
        ValueError: unknown ``shape`` or ``quant``; a size the shape does not have (e.g. ``kv_lora_rank`` with
            ``"qwen3-30b-a3b"``); inconsistent sizes (k > E, n_dense_lead >= n_layer, n_head not a multiple of
            n_head_kv); ``n_expert == 8`` with Q4_K_M or Q4_0 (upstream's 8-expert special cases are not
            restated); Q4_K_M on rows that upstream would write as F16 (not a multiple of 32).
    """
    if shape not in SYNTHETIC_SHAPES:
        raise ValueError(f"make_synthetic_model: unknown shape {shape!r}; valid: {', '.join(SYNTHETIC_SHAPES)}")
    if quant not in SYNTHETIC_QUANTS:
        raise ValueError(f"make_synthetic_model: quant must be one of {', '.join(SYNTHETIC_QUANTS)}, got {quant!r}")
    if n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {n_layer}")
    z = _sizes(shape, dict(n_embd=n_embd, n_ff_exp=n_ff_exp, n_ff_dense=n_ff_dense, n_expert=n_expert,
                           n_expert_used=n_expert_used, n_shared=n_shared, n_head=n_head, kv_lora_rank=kv_lora_rank,
                           qk_rope=qk_rope, qk_nope=qk_nope, v_head=v_head, n_dense_lead=n_dense_lead,
                           n_head_kv=n_head_kv, head_dim=head_dim))
    arch = SYNTHETIC_SHAPES[shape][0]
    if arch == "deepseek2" and not z["n_dense_lead"] < n_layer:
        raise ValueError(f"n_dense_lead must be in 0..n_layer-1 ({n_layer - 1}), got {z['n_dense_lead']}")
    if quant in ("Q4_K_M", "Q4_0") and z["n_expert"] == 8:
        raise ValueError(f"n_expert 8: upstream's {quant} has special cases for 8-expert models that this writer "
                         "does not restate; use another expert count")
    if arch == "deepseek2":
        plan = _deepseek2_plan(n_layer, z, N_VOCAB, quant, residual_scale)
    else:
        sh = _tiny_arch_shape(arch, n_layer, z, residual_scale, n_ctx_train)
        plan = _tiny_arch_plan(sh, N_VOCAB, quant)
    for pt in plan:
        if pt.type == "F16" and quant == "Q4_K_M":
            raise ValueError(f"{pt.name}: rows of {pt.shape[0]} are not a multiple of 32 (upstream would write "
                             "F16)")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # written next to the target and renamed at the end: a failure never leaves a damaged file at `path`
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        if arch == "deepseek2":
            _write_deepseek2_metadata(w, quant=quant, n_layer=n_layer, n_ctx_train=n_ctx_train, z=z)
        else:
            w.add_name(f"hybrimoe-synthetic-{arch}")
            _write_tokenizer(w, "spm")
            _write_metadata(w, sh, SYNTHETIC_QUANTS[quant])
        _add_tensor_infos(w, plan)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, pt in enumerate(plan):
            rng = np.random.default_rng([seed, i])
            if pt.fill is not None:  # norm weights and zero biases
                data = np.full(int(np.prod(pt.shape)), pt.fill, np.float32)
            else:
                rows = int(np.prod(pt.shape[1:], dtype=np.int64)) if len(pt.shape) > 1 else 1
                data = random_quant_rows(rng, pt.type, rows, pt.shape[0], pt.std)
            w.write_tensor_data(data)
            block = pt.name.split(".")[1] if pt.name.startswith("blk.") else None
            if progress and block is not None and (i + 1 == len(plan) or not plan[i + 1].name.startswith(
                    f"blk.{block}.")):
                print(f"make_synthetic_model: wrote blk.{block}", file=sys.stderr)
        w.close()
    return path
