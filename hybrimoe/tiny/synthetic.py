"""Full-size synthetic deepseek2 MoE models for benchmarks: quantized blocks written directly.

:func:`make_synthetic_model` writes a DeepSeek-V2-Lite-shaped GGUF (``DSV2_LITE_SHAPE``, fewer blocks) whose
weights are random quantized blocks (:func:`hybrimoe.tiny.rows.random_quant_rows`) of the types upstream's
Q4_K_M would give each tensor (:func:`hybrimoe.tiny.quantize.q4_k_m_type`), streamed tensor by tensor: several
GB in seconds, in constant memory. :func:`synthetic_tensor_plan` lists its tensors, shapes and types.
"""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

from hybrimoe.outputs import atomic_path
from hybrimoe.tiny.quantize import q4_k_m_type
from hybrimoe.tiny.rows import random_quant_rows
from hybrimoe.tiny.tokenizers import N_VOCAB, _write_tokenizer

# DeepSeek-V2-Lite's shape (config.json of deepseek-ai/DeepSeek-V2-Lite): the defaults of make_synthetic_model,
# except n_layer (27 there; fewer here, so a benchmark model fits a short GPU session)
DSV2_LITE_SHAPE = dict(n_embd=2048, n_ff_exp=1408, n_ff_dense=10944, n_expert=64, n_expert_used=6, n_shared=2,
                       n_head=16, kv_lora_rank=512, qk_rope=64, qk_nope=128, v_head=128, n_dense_lead=1)


def synthetic_tensor_plan(*, n_layer: int, n_embd: int, n_ff_exp: int, n_ff_dense: int, n_expert: int,
                          n_shared: int, n_head: int, kv_lora_rank: int, qk_rope: int, qk_nope: int, v_head: int,
                          n_dense_lead: int, n_vocab: int = N_VOCAB, quant: str = "Q4_K_M",
                          residual_scale: float = 0.15) -> list[tuple[str, tuple, str, float]]:
    """The tensors of a deepseek2 model (MLA attention without a query low-rank projection, like
    DeepSeek-V2-Lite), in file order: ``(name, ggml shape {ne0, ne1, ne2}, ggml type name, weight std)``.
    ``quant`` ``"Q4_K_M"`` takes the types of :func:`q4_k_m_type`, ``"F32"`` writes every tensor as F32."""
    D, F, E, H = n_embd, n_ff_exp, n_expert, n_head
    s = residual_scale
    qk = qk_nope + qk_rope

    def ty(name, shape):
        return "F32" if quant == "F32" or len(shape) == 1 else q4_k_m_type(name, shape[0], n_layer)

    plan = []

    def add(name, shape, std):
        plan.append((name, tuple(int(x) for x in shape), ty(name, shape), float(std)))

    add("token_embd.weight", (D, n_vocab), 1.0)
    add("output_norm.weight", (D,), 0.0)
    add("output.weight", (D, n_vocab), 1 / np.sqrt(D))
    for il in range(n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", (D,), 0.0)
        add(p + "attn_q.weight", (D, H * qk), 1 / np.sqrt(D))
        add(p + "attn_kv_a_mqa.weight", (D, kv_lora_rank + qk_rope), 1 / np.sqrt(D))
        add(p + "attn_kv_a_norm.weight", (kv_lora_rank,), 0.0)
        add(p + "attn_k_b.weight", (qk_nope, kv_lora_rank, H), 1 / np.sqrt(qk_nope))
        add(p + "attn_v_b.weight", (kv_lora_rank, v_head, H), 1 / np.sqrt(kv_lora_rank))
        add(p + "attn_output.weight", (H * v_head, D), s / np.sqrt(H * v_head))
        add(p + "ffn_norm.weight", (D,), 0.0)
        if il < n_dense_lead:
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


def _write_header(w, plan: list, *, quant: str, n_layer: int, n_embd: int, n_ff_exp: int, n_ff_dense: int,
                  n_expert: int, n_expert_used: int, n_shared: int, n_head: int, kv_lora_rank: int, qk_rope: int,
                  qk_nope: int, v_head: int, n_dense_lead: int, n_ctx_train: int) -> None:
    """The metadata of :func:`make_synthetic_model`'s file and the info of every tensor of ``plan`` (the data
    follows, tensor by tensor)."""
    w.add_name("hybrimoe-synthetic-deepseek2")
    _write_tokenizer(w, "spm")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff_dense)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_head_count(n_head)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(qk_rope)
    w.add_leading_dense_block_count(n_dense_lead)
    w.add_q_lora_rank(0)
    w.add_kv_lora_rank(kv_lora_rank)
    w.add_key_length(kv_lora_rank + qk_rope)
    w.add_value_length(kv_lora_rank)
    w.add_key_length_mla(qk_nope + qk_rope)
    w.add_value_length_mla(v_head)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_expert_shared_count(n_shared)
    w.add_expert_weights_scale(1.0)
    w.add_expert_weights_norm(False)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if quant == "Q4_K_M" else gguf.LlamaFileType.ALL_F32)
    for name, shape, t, _ in plan:  # tensor infos first; the data follows tensor by tensor (streamed)
        qt = gguf.GGMLQuantizationType[t]
        blk, size = gguf.GGML_QUANT_SIZES[qt]
        rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        nbytes = rows * shape[0] // blk * size
        np_shape = tuple(reversed(shape))
        if t in ("F32", "F16"):
            w.add_tensor_info(name, np_shape, np.dtype(np.float32 if t == "F32" else np.float16), nbytes)
        else:
            w.add_tensor_info(name, np_shape[:-1] + (shape[0] // blk * size,), np.dtype(np.uint8), nbytes,
                              raw_dtype=qt)


def make_synthetic_model(path, *, quant: str = "Q4_K_M", seed: int = 0, n_layer: int = 8,
                         n_embd: int = 2048, n_ff_exp: int = 1408, n_ff_dense: int = 10944, n_expert: int = 64,
                         n_expert_used: int = 6, n_shared: int = 2, n_head: int = 16, kv_lora_rank: int = 512,
                         qk_rope: int = 64, qk_nope: int = 128, v_head: int = 128, n_dense_lead: int = 1,
                         residual_scale: float = 0.15, n_ctx_train: int = 4096, progress: bool = False) -> Path:
    """Write a full-size deepseek2 MoE GGUF (DeepSeek-V2-Lite's shape by default, ``n_layer`` blocks) with random
    weights whose quantized blocks are written directly (:func:`random_quant_rows`), not quantized from floats:
    a model of several GB is written in seconds without tens of GB of floats. For benchmarks (speed, memory,
    cache behaviour with routing replay), not for text: the router is random, so without replay routing is
    arbitrary, and the tokenizer is the tiny 512-token one of :func:`make_tiny_model`.

    Args:
        path: output file (parent directories are created; written to a temporary file, then renamed).
        quant: ``"Q4_K_M"``: each tensor gets the type upstream's Q4_K_M gives it (:func:`q4_k_m_type`; e.g.
            ``ffn_gate_exps``/``ffn_up_exps`` Q4_K, ``ffn_down_exps`` Q5_0 or, in Q6_K layers, Q8_0 when
            ``n_ff_exp`` is not a multiple of 256); ``"F32"``: every tensor F32 (small models, e.g. to check
            the type plan against llama.cpp's quantizer).
        seed: RNG seed; the same arguments give a byte-identical file.
        n_layer: blocks, the first ``n_dense_lead`` with a dense FFN of width ``n_ff_dense``, the others MoE.
        n_embd: hidden size D; n_ff_exp: routed (and each shared) expert width F; n_expert: routed experts E;
        n_expert_used: top-k; n_shared: shared experts (one FFN of width ``n_shared * F`` per MoE layer).
        n_head, kv_lora_rank, qk_rope, qk_nope, v_head: MLA attention (queries without low-rank projection:
            ``attention.q_lora_rank`` 0).
        residual_scale: weight scale of the projections into the residual stream (as ``make_tiny_model``).
        progress: print one line per written layer to stderr.

    Sizes: with the defaults each MoE layer holds 64 x (2 x 2048 x 1408 Q4_K + 1408 x 2048 Q5_0/Q8_0) expert
    weights, 334-396 MiB, so 8 blocks come to about 2.5 GiB.

    Raises:
        ValueError: unknown ``quant``, inconsistent sizes (k > E, n_dense_lead >= n_layer, rows that fit no
            block size), or a shape whose type this writer cannot make.
    """
    if quant not in ("Q4_K_M", "F32"):
        raise ValueError(f"make_synthetic_model: quant must be 'Q4_K_M' or 'F32', got {quant!r}")
    if not 1 <= n_expert_used <= n_expert:
        raise ValueError(f"n_expert_used must be in 1..n_expert ({n_expert}), got {n_expert_used}")
    if not 0 <= n_dense_lead < n_layer:
        raise ValueError(f"n_dense_lead must be in 0..n_layer-1 ({n_layer - 1}), got {n_dense_lead}")
    if n_shared < 1:
        raise ValueError("deepseek2 needs n_shared >= 1")
    if quant == "Q4_K_M" and n_expert == 8:
        raise ValueError("n_expert 8: upstream's Q4_K_M has a special case for 8-expert models that "
                         "q4_k_m_type does not restate; use another expert count")
    plan = synthetic_tensor_plan(n_layer=n_layer, n_embd=n_embd, n_ff_exp=n_ff_exp, n_ff_dense=n_ff_dense,
                                 n_expert=n_expert, n_shared=n_shared, n_head=n_head, kv_lora_rank=kv_lora_rank,
                                 qk_rope=qk_rope, qk_nope=qk_nope, v_head=v_head, n_dense_lead=n_dense_lead,
                                 quant=quant, residual_scale=residual_scale)
    for name, shape, t, _ in plan:
        if t not in ("F32", "F16") and shape[0] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0]:
            raise ValueError(f"{name}: rows of {shape[0]} do not fit {t} blocks")
        if t == "F16" and quant == "Q4_K_M":
            raise ValueError(f"{name}: rows of {shape[0]} are not a multiple of 32 (upstream would write F16)")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # written next to the target and renamed at the end: a failure never leaves a damaged file at `path`
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(str(tmp), "deepseek2")
        _write_header(w, plan, quant=quant, n_layer=n_layer, n_embd=n_embd, n_ff_exp=n_ff_exp,
                      n_ff_dense=n_ff_dense, n_expert=n_expert, n_expert_used=n_expert_used, n_shared=n_shared,
                      n_head=n_head, kv_lora_rank=kv_lora_rank, qk_rope=qk_rope, qk_nope=qk_nope, v_head=v_head,
                      n_dense_lead=n_dense_lead, n_ctx_train=n_ctx_train)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (name, shape, t, std) in enumerate(plan):
            rng = np.random.default_rng([seed, i])
            rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
            if len(shape) == 1:  # norm weights
                data = np.ones(shape[0], np.float32)
            else:
                data = random_quant_rows(rng, t, rows, shape[0], std)
            w.write_tensor_data(data)
            if progress and name.endswith("ffn_down_shexp.weight"):
                print(f"make_synthetic_model: wrote {name.split('.')[0]}.{name.split('.')[1]}", file=sys.stderr)
        w.close()
    return path

