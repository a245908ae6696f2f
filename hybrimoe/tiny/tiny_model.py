"""Tiny MoE GGUF models for tests and demos: :func:`make_tiny_model`.

``make_tiny_model(path, arch=...)`` writes a small, valid GGUF file that llama.cpp loads and generates from,
with random (seeded) weights, a real tokenizer (:mod:`hybrimoe.tiny.tokenizers`), a router designed for wide
top-k margins (:mod:`hybrimoe.tiny.router`) and, optionally, quantized through llama.cpp's own quantizer
(:mod:`hybrimoe.tiny.quantize`), including per-tensor mixes for the expert tensors.

Architectures (GGUF ``general.architecture``):

============  ============================================================================================
``qwen3moe``  routed experts only; q/k RMS norms per head; top-k weights normalised
``qwen2moe``  routed experts + one shared expert of width ``n_shared * n_ff_exp`` with its sigmoid gate
              (``ffn_gate_inp_shexp``)
``olmoe``     routed experts only; q/k norms over the whole projection (so ``n_head_kv == n_head``)
``llama``     Mixtral-style: ``feed_forward_length`` is the expert width, softmax routing
``deepseek2`` MLA attention (q/kv low-rank, split ``attn_k_b``/``attn_v_b``), ``n_dense_lead`` leading
              dense FFN layers, ``n_shared`` shared experts, ``expert_weights_scale``,
              ``expert_weights_norm`` and ``expert_gating_func`` (sigmoid by default, as DeepSeek-V3)
``gpt-oss``   OpenAI-MoE: attention sinks, sliding-window layers, router bias and per-expert biases
              (``ffn_{gate,up,down}_exps.bias``), SwiGLU-OAI activation
``llama4``    Llama 4: every layer MoE (``interleave_moe_layer_step`` 1), one shared expert of width
              ``n_ff_exp``, sigmoid routing weights applied to the experts' input (build_moe_ffn's
              weight_before_ffn), upstream's default 8192-token attention chunks, top-1 by default;
              ``n_layer`` >= 4 (every 4th block has no rope, the one that reads upstream's attention temperature)
``grok``      Grok-1: GELU experts (gated GEGLU; ``gated_experts=False`` writes no ``ffn_gate_exps``: GELU of
              the up product), attention-output and FFN-output RMS norms (weights ``residual_scale``), no
              embedding or logit scale
``smallthinker`` SmallThinker: gated ReLU experts (ggml_reglu_split), the router reading the block's input before
              attention (build_moe_ffn's probs_in), softmax routing, no sliding window
``step35``    Step 3.5: routed experts + one shared expert of width ``n_ff_exp``, sigmoid routing, even blocks
              sliding-window (64 tokens) and odd ones full attention (upstream ropes half the head there);
              ``swiglu_clamp`` > 0 writes ``swiglu_clamp_exp`` for every layer (build_moe_ffn's clamp(up),
              clamp(silu(gate)), mul form)
============  ============================================================================================

Expert variants on top (each changes only the files that ask for it): ``fused_gate_up=True`` (deepseek2: one
``ffn_gate_up_exps`` ``{D, 2F, E}``, gate rows first, as ``create_tensor_gate_up_exps`` loads it) and
``expert_scales=True`` (qwen3moe, llama: F32 per-expert scales ``ffn_{gate,up,down}_exps.scale`` ``{E}``, uniform in
[0.5, 1.5), which build_moe_ffn multiplies into each expert's products).

Tensor shapes below use ggml order ``{ne0, ne1, ne2}`` (ne0 = contiguous row length); the numpy arrays
handed to the gguf writer have the reversed shape. ``D = n_embd``, ``F = n_ff_exp``, ``E = n_expert``,
``k = n_expert_used``, ``V = N_VOCAB`` = 512 tokens (both tokenizers).
Routed experts: ``ffn_gate_exps``/``ffn_up_exps`` ``{D, F, E}``, ``ffn_down_exps`` ``{F, D, E}``; router
``ffn_gate_inp`` ``{D, E}`` (llama.cpp's quantizer never quantizes it; it stays F32).

The output head is random for text-piece tokens and zero for byte, control and unused tokens, so greedy
generation produces readable text pieces and never a lone byte token (invalid UTF-8 keeps llama-cpp-python's
``create_completion`` generating past ``max_tokens``) nor EOS.

Quantized models are first written as F32 to a temporary file next to ``path`` and then quantized through
``llama_model_quantize``. Row lengths must fit the quant's blocks (multiples of 256 for K-quants, 32 for Q8_0
and the other 32-wide types): an explicit ``n_embd`` or ``n_ff_exp`` that does not is refused with
``ValueError``; left out, they default to 64 and 32 rounded up to the quant's block width
(:func:`default_widths`: 256 and 256 for K-quants and ``"mix"``).
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from hybrimoe.outputs import atomic_path
from hybrimoe.tiny.quantize import check_rows, parse_quant, quantize_gguf
from hybrimoe.tiny.router import router_design
from hybrimoe.tiny.tokenizers import TOKENIZERS, _write_tokenizer

ARCHS = ("qwen3moe", "qwen2moe", "olmoe", "llama", "deepseek2", "gpt-oss", "llama4", "grok", "step35",
         "smallthinker")

_DEFAULTS = {
    # arch: (n_expert, n_expert_used, n_shared)
    "qwen3moe": (8, 2, 0), "qwen2moe": (8, 2, 1), "olmoe": (8, 2, 0), "llama": (8, 2, 0),
    "deepseek2": (8, 2, 1), "gpt-oss": (8, 2, 0), "llama4": (8, 1, 1), "grok": (8, 2, 0), "step35": (8, 2, 1),
    "smallthinker": (8, 2, 0),
}
# widths (elements) of an unquantized or 32-block model when none are given; a quant with wider blocks raises
# them to its block width (default_widths)
DEFAULT_N_EMBD = 64
DEFAULT_N_FF_EXP = 32


def default_widths(quant=None) -> tuple[int, int]:
    """``(n_embd, n_ff_exp)`` that :func:`make_tiny_model` uses for ``quant`` when they are not given.

    Each is the smallest multiple of the widest block among the quant's types (``QuantSpec.block``, elements)
    that is at least ``DEFAULT_N_EMBD`` = 64 / ``DEFAULT_N_FF_EXP`` = 32: (64, 32) for F32, F16 and the 32-wide
    types (Q8_0, Q4_0, ...), (256, 256) for K-quant file types (Q4_K_M, Q6_K, ...) and ``"mix"``.

    Raises:
        ValueError: ``quant`` is not a valid quant argument (:func:`hybrimoe.tiny.quantize.parse_quant`).
    """
    return _default_widths(parse_quant(quant))


def _default_widths(spec) -> tuple[int, int]:
    """:func:`default_widths` of an already parsed quant (a ``QuantSpec``, or None for F32)."""
    blk = spec.block if spec is not None else 1
    return -(-DEFAULT_N_EMBD // blk) * blk, -(-DEFAULT_N_FF_EXP // blk) * blk


def _normal(rng, shape, std):
    """float32 array of ``shape`` drawn from N(0, std^2) with ``rng``."""
    return (rng.standard_normal(shape) * std).astype(np.float32)


class _Draws:
    """The values of a tiny model's tensors, float32 arrays in numpy's shape order, drawn from ``rng`` in the
    order asked for. :func:`_attention` and :func:`_moe_ffn` take their values from such an object, so that the
    full-size writer (:mod:`hybrimoe.tiny.synthetic`) can list the same tensors with another one that records
    shapes and scales instead of drawing floats."""

    def __init__(self, rng):
        self.rng = rng

    def normal(self, shape, std):
        """N(0, std^2) values of ``shape``."""
        return _normal(self.rng, shape, std)

    def uniform(self, n, lo, hi):
        """``n`` values uniform in [lo, hi)."""
        return self.rng.uniform(lo, hi, n).astype(np.float32)

    def ones(self, n):
        """``n`` ones (norm weights)."""
        return np.ones(n, np.float32)

    def zeros(self, n):
        """``n`` zeros (biases)."""
        return np.zeros(n, np.float32)

    def full(self, n, value):
        """``n`` copies of ``value``."""
        return np.full(n, value, np.float32)


def make_tiny_model(path, arch: str = "qwen3moe", *, seed: int = 0, n_layer: int | None = None,
                    n_embd: int | None = None,
                    n_expert: int | None = None, n_expert_used: int | None = None, n_ff_exp: int | None = None,
                    n_shared: int | None = None, n_head: int = 4, n_dense_lead: int = 1, n_ff_dense: int | None = None,
                    quant=None, tokenizer: str = "spm", router_margin: float = 4.0,
                    residual_scale: float = 0.15, n_ctx_train: int = 512, chat_template: str | None = None,
                    fused_gate_up: bool = False, expert_scales: bool = False, gated_experts: bool = True,
                    swiglu_clamp: float = 0.0) -> Path:
    """Write a tiny MoE GGUF model to ``path`` and return it as a ``Path``.

    Args:
        path: output file (parent directories are created; an existing file is replaced).
        arch: one of ``ARCHS`` (``qwen3moe``, ``qwen2moe``, ``olmoe``, ``llama``, ``deepseek2``, ``gpt-oss``).
        seed: RNG seed; the same arguments and seed give a byte-identical file.
        n_layer: transformer blocks (for deepseek2, including the ``n_dense_lead`` leading dense ones); default
            2, and 4 for llama4 (whose every 4th block has no rope: upstream needs one).
        n_embd: hidden size D (elements); must be a multiple of ``n_head`` and of the quant's block width
            (32 for Q8_0/Q4_0, 256 for K-quants). Default: 64, or the block width when wider
            (:func:`default_widths`).
        n_expert: routed experts E per MoE layer (any value >= 1, e.g. 6 or 60; default 8).
        n_expert_used: experts selected per token k (1 <= k <= E; default 2).
        n_ff_exp: routed expert FFN width F (elements; a multiple of the quant's block width). Default: 32, or
            the block width when wider.
        n_shared: shared experts. qwen2moe: one shared FFN of width ``n_shared * n_ff_exp`` (default 1, >= 1);
            deepseek2: ``expert_shared_count`` (default 1, >= 1); other archs: must be 0/None.
        n_head: attention heads (head dim D / n_head; deepseek2 uses its own MLA sizes, see below).
        n_dense_lead: deepseek2 only: leading dense FFN layers (``leading_dense_block_count``, < n_layer).
        n_ff_dense: deepseek2 only: dense FFN width (default ``2 * n_ff_exp``).
        quant: None/"F32", a file-type name (``FTYPES``), ``"mix"`` or a {pattern: ggml type} dict
            (:mod:`hybrimoe.tiny.quantize`).
        tokenizer: ``"spm"`` (llama SPM with byte fallback) or ``"bpe"`` (gpt2 byte-level BPE).
        router_margin: designed minimum gap (router-logit units) between the k-th and (k+1)-th router logit
            for the nominal hidden state of every vocabulary token (:mod:`hybrimoe.tiny.router`). Must be > 0.
        residual_scale: RMS (relative to the embedding's) that each attention / FFN block adds to the residual
            stream; smaller keeps routing closer to the design.
        n_ctx_train: ``context_length`` written to the file.
        chat_template: a Jinja chat template written as ``tokenizer.chat_template`` (llama-cpp-python formats chat
            requests with it); None writes none (the file is then byte-identical to one made before this option).
        fused_gate_up: deepseek2 only: fused ``ffn_gate_up_exps`` instead of separate gate and up experts (the
            same weights, drawn as for the separate ones).
        expert_scales: qwen3moe and llama only: F32 per-expert scales ``ffn_{gate,up,down}_exps.scale``.
        gated_experts: grok only: False writes no ``ffn_gate_exps`` (ungated GELU experts).
        swiglu_clamp: step35 only: the routed experts' ``swiglu_clamp_exp`` limit (> 0; 0 writes none).

    deepseek2 MLA sizes (fixed): q_lora_rank 32 (none with 26 or 27 blocks: llama.cpp reads those as
    DeepSeek-V2-Lite, whose queries have no low-rank projection), kv_lora_rank 32, qk_rope 16, qk_nope 16, v_head 16,
    ``head_count_kv`` 1 (``key_length`` = kv_lora_rank + rope = 48, ``value_length`` = kv_lora_rank = 32,
    ``key_length_mla`` 32, ``value_length_mla`` 16), sigmoid gating, ``expert_weights_norm`` true,
    ``expert_weights_scale`` 2.5.

    Raises:
        ValueError: unknown arch, tokenizer or quant; inconsistent sizes (k > E, n_embd % n_head, rows not a
            multiple of the quant block, shared experts on an arch without them, ...).
        RuntimeError: llama.cpp's quantizer failed.
    """
    shape = _shape(arch, n_layer, n_embd, n_expert, n_expert_used, n_ff_exp, n_shared, n_head, n_dense_lead,
                   n_ff_dense, quant, tokenizer, router_margin, residual_scale, n_ctx_train, chat_template,
                   dict(fused_gate_up=bool(fused_gate_up), expert_scales=bool(expert_scales),
                        gated_experts=bool(gated_experts), swiglu_clamp=float(swiglu_clamp)))
    qspec = parse_quant(quant)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    # written next to the target and renamed at the end: a failure never leaves a damaged file at `path`
    with atomic_path(path) as out_tmp:
        if qspec is None:
            _write(out_tmp, shape, rng)
        else:
            with tempfile.TemporaryDirectory(dir=path.parent) as d:  # the F32 file the quantizer reads
                f32 = Path(d) / "f32.gguf"
                _write(f32, shape, rng)
                quantize_gguf(str(f32), str(out_tmp), qspec.base, qspec.overrides)
    return path


@dataclass(frozen=True)
class _Shape:
    """The checked sizes of a tiny model (``D`` n_embd, ``F`` n_ff_exp, ``E`` experts, ``k`` top-k, ``ns`` shared
    experts, ``L`` blocks, ``hd`` head dim, ``n_ff_d`` dense FFN width, ``s`` residual scale, ``variant`` the
    expert-variant options) and the file's other settings."""

    arch: str
    D: int
    F: int
    E: int
    k: int
    ns: int
    L: int
    n_head: int
    n_head_kv: int
    hd: int
    n_dense: int
    n_ff_d: int
    tokenizer: str
    router_margin: float
    s: float
    n_ctx_train: int
    chat_template: str | None
    variant: dict


def _shape(arch, n_layer, n_embd, n_expert, n_expert_used, n_ff_exp, n_shared, n_head, n_dense_lead, n_ff_dense,
           quant, tokenizer, router_margin, residual_scale, n_ctx_train, chat_template, variant) -> _Shape:
    """:func:`make_tiny_model`'s arguments checked and completed with the architecture's defaults; ValueError as
    documented there."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; valid: {', '.join(TOKENIZERS)}")
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
        raise ValueError(f"chat_template must be a non-empty string (a Jinja template), got {chat_template!r}")
    d_e, d_k, d_s = _DEFAULTS[arch]
    E = d_e if n_expert is None else int(n_expert)
    k = d_k if n_expert_used is None else int(n_expert_used)
    ns = d_s if n_shared is None else int(n_shared)
    qspec = parse_quant(quant)
    d_embd, d_ff = _default_widths(qspec)
    D = d_embd if n_embd is None else int(n_embd)
    F = d_ff if n_ff_exp is None else int(n_ff_exp)
    L = int(n_layer) if n_layer is not None else (4 if arch == "llama4" else 2)
    if L < 1 or D < 1 or F < 1:
        raise ValueError("n_layer, n_embd and n_ff_exp must be >= 1")
    if not 1 <= E <= 256:
        raise ValueError(f"n_expert must be in 1..256, got {E}")
    if not 1 <= k <= E:
        raise ValueError(f"n_expert_used must be in 1..n_expert ({E}), got {k}")
    if n_head < 1:
        raise ValueError(f"n_head must be >= 1, got {n_head}")
    if D % n_head:
        raise ValueError(f"n_embd ({D}) must be a multiple of n_head ({n_head})")
    if not np.isfinite(router_margin) or router_margin <= 0:
        raise ValueError(f"router_margin must be a finite number > 0, got {router_margin}")
    if not np.isfinite(residual_scale) or residual_scale < 0:
        raise ValueError(f"residual_scale must be a finite number >= 0, got {residual_scale}")
    if variant["fused_gate_up"] and arch != "deepseek2":
        raise ValueError(f"fused_gate_up: {arch} does not load ffn_gate_up_exps here; deepseek2 does")
    if variant["expert_scales"] and arch not in ("qwen3moe", "llama"):
        raise ValueError(f"expert_scales: {arch}'s graph does not pass them to build_moe_ffn here; qwen3moe and "
                         "llama do")
    if not variant["gated_experts"] and arch != "grok":
        raise ValueError(f"gated_experts=False: {arch} requires ffn_gate_exps; grok does not")
    clamp = variant["swiglu_clamp"]
    if clamp and (arch != "step35" or not np.isfinite(clamp) or clamp < 0):
        raise ValueError(f"swiglu_clamp must be a finite limit >= 0 on step35 (got {clamp!r} on {arch})")
    if arch in ("qwen2moe", "deepseek2", "llama4", "step35"):
        if ns < 1:
            raise ValueError(f"{arch} needs n_shared >= 1")
    elif ns:
        raise ValueError(f"{arch} has no shared experts (n_shared must be 0); qwen2moe, deepseek2 and llama4 have "
                         "them")
    if arch in ("llama4", "step35") and ns != 1:
        raise ValueError(f"{arch} has exactly one shared expert (n_shared=1)")
    if arch == "llama4" and L < 4:
        # upstream's graph always has the attention-temperature input, which only the no-rope layers (every 4th)
        # read; with fewer blocks it is never allocated and upstream aborts setting it
        raise ValueError(f"llama4 needs n_layer >= 4 (its every 4th block has no rope), got {L}")
    n_dense = 0
    if arch == "deepseek2":
        n_dense = int(n_dense_lead)
        if not 0 <= n_dense < L:
            raise ValueError(f"n_dense_lead must be in 0..n_layer-1 ({L - 1}), got {n_dense}")
    n_ff_d = int(n_ff_dense) if n_ff_dense is not None else 2 * F
    check_rows(quant, qspec, (("n_embd", D), ("n_ff_exp", F)))

    return _Shape(arch=arch, D=D, F=F, E=E, k=k, ns=ns, L=L, n_head=n_head,
                  n_head_kv=n_head if arch == "olmoe" else max(1, n_head // 2), hd=D // n_head, n_dense=n_dense,
                  n_ff_d=n_ff_d, tokenizer=tokenizer, router_margin=router_margin, s=float(residual_scale),
                  n_ctx_train=n_ctx_train, chat_template=chat_template, variant=variant)


#: deepseek2's multi-head latent attention sizes (fixed): q and kv LoRA ranks, rope and no-rope head dims, v head dim
_MLA = dict(q_lora=32, kv_lora=32, rope=16, nope=16, v=16)


def _is_lite(sh: _Shape) -> bool:
    # llama.cpp takes a deepseek2 model with 26 or 27 blocks for DeepSeek-V2-Lite, whose queries have no
    # low-rank projection (src/models/deepseek2.cpp, is_lite): write attn_q then, like that model
    return sh.arch == "deepseek2" and sh.L in (26, 27)


def _write_metadata(w, sh: _Shape, file_type=gguf.LlamaFileType.ALL_F32) -> None:
    """The architecture's metadata keys (the tokenizer's are written before); ``general.file_type`` is
    ``file_type``. Heads of another width than ``D / n_head`` (``sh.hd``, as the full-size shapes of
    :mod:`hybrimoe.tiny.synthetic` have) get ``attention.key_length`` and ``value_length``; llama.cpp takes
    ``D / n_head`` without them."""
    arch, variant = sh.arch, sh.variant
    if sh.chat_template is not None:
        w.add_chat_template(sh.chat_template)
    w.add_context_length(sh.n_ctx_train)
    w.add_embedding_length(sh.D)
    w.add_block_count(sh.L)
    w.add_head_count(sh.n_head)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(sh.E)
    w.add_expert_used_count(sh.k)
    w.add_file_type(file_type)
    if arch in ("llama", "olmoe"):
        w.add_feed_forward_length(sh.F)
    else:
        w.add_feed_forward_length(sh.n_ff_d if arch == "deepseek2" else sh.F)
        w.add_expert_feed_forward_length(sh.F)
    if arch in ("qwen2moe", "step35"):
        w.add_expert_shared_feed_forward_length(sh.ns * sh.F)
    if arch == "step35":
        w.add_sliding_window(64)
        w.add_sliding_window_pattern([il % 2 == 0 for il in range(sh.L)])  # upstream needs one SWA layer
        if variant.get("swiglu_clamp"):
            w.add_swiglu_clamp_exp([float(variant["swiglu_clamp"])] * sh.L)
    if arch == "deepseek2":
        w.add_head_count_kv(1)
        w.add_leading_dense_block_count(sh.n_dense)
        if not _is_lite(sh):
            w.add_q_lora_rank(_MLA["q_lora"])
        w.add_kv_lora_rank(_MLA["kv_lora"])
        w.add_key_length(_MLA["kv_lora"] + _MLA["rope"])
        w.add_value_length(_MLA["kv_lora"])
        w.add_key_length_mla(_MLA["nope"] + _MLA["rope"])
        w.add_value_length_mla(_MLA["v"])
        w.add_rope_dimension_count(_MLA["rope"])
        w.add_expert_shared_count(sh.ns)
        w.add_expert_weights_scale(2.5)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    else:
        w.add_head_count_kv(sh.n_head_kv)
        w.add_rope_dimension_count(sh.hd)
        if sh.hd * sh.n_head != sh.D:
            w.add_key_length(sh.hd)
            w.add_value_length(sh.hd)
    if arch == "gpt-oss":
        w.add_sliding_window(64)
        w.add_expert_weights_scale(1.0)
    if arch == "llama4":
        # no sliding_window key: upstream's Llama 4 defaults (8192-token attention chunks, temperature tuning, 3
        # chunked layers to 1 full, no rope in every 4th), the chunks longer than any context the tests use
        # (sliding_window 0 would select plain attention, whose graph upstream cannot set inputs for)
        w.add_interleave_moe_layer_step(1)
    if arch == "smallthinker":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    if arch == "grok":
        w.add_embedding_scale(1.0)
        w.add_logit_scale(1.0)
        w.add_attn_output_scale(1.0)


def _attention(t: dict, p: str, sh: _Shape, v) -> None:
    """Block ``p``'s attention tensors and the norms around it, made by ``v`` (a :class:`_Draws`, or another
    object with its methods) in a fixed order."""
    D, n_head, hd, s = sh.D, sh.n_head, sh.hd, sh.s
    t[p + "attn_norm.weight"] = v.ones(D)
    if sh.arch == "deepseek2":
        m = _MLA
        qk = m["nope"] + m["rope"]
        t[p + "attn_kv_a_norm.weight"] = v.ones(m["kv_lora"])
        if _is_lite(sh):
            t[p + "attn_q.weight"] = v.normal((n_head * qk, D), 1 / np.sqrt(D))
        else:
            t[p + "attn_q_a_norm.weight"] = v.ones(m["q_lora"])
            t[p + "attn_q_a.weight"] = v.normal((m["q_lora"], D), 1 / np.sqrt(D))
            t[p + "attn_q_b.weight"] = v.normal((n_head * qk, m["q_lora"]), 1 / np.sqrt(m["q_lora"]))
        t[p + "attn_kv_a_mqa.weight"] = v.normal((m["kv_lora"] + m["rope"], D), 1 / np.sqrt(D))
        t[p + "attn_k_b.weight"] = v.normal((n_head, m["kv_lora"], m["nope"]), 1 / np.sqrt(m["nope"]))
        t[p + "attn_v_b.weight"] = v.normal((n_head, m["v"], m["kv_lora"]), 1 / np.sqrt(m["kv_lora"]))
        t[p + "attn_output.weight"] = v.normal((D, n_head * m["v"]), s / np.sqrt(n_head * m["v"]))
    else:
        t[p + "attn_q.weight"] = v.normal((n_head * hd, D), 1 / np.sqrt(D))
        t[p + "attn_k.weight"] = v.normal((sh.n_head_kv * hd, D), 1 / np.sqrt(D))
        t[p + "attn_v.weight"] = v.normal((sh.n_head_kv * hd, D), 1 / np.sqrt(D))
        t[p + "attn_output.weight"] = v.normal((D, n_head * hd), s / np.sqrt(n_head * hd))
        if sh.arch == "qwen3moe":
            t[p + "attn_q_norm.weight"] = v.ones(hd)
            t[p + "attn_k_norm.weight"] = v.ones(hd)
        elif sh.arch == "olmoe":
            t[p + "attn_q_norm.weight"] = v.ones(D)
            t[p + "attn_k_norm.weight"] = v.ones(D)
        elif sh.arch == "gpt-oss":
            t[p + "attn_output.bias"] = v.zeros(D)
            t[p + "attn_sinks.weight"] = v.normal((n_head,), 0.5)
    if sh.arch == "gpt-oss":
        t[p + "post_attention_norm.weight"] = v.ones(D)
    elif sh.arch == "grok":
        # grok RMS-normalises the attention and FFN outputs: their weights set what each adds to the residual
        t[p + "attn_output_norm.weight"] = v.full(D, s)
        t[p + "ffn_norm.weight"] = v.ones(D)
        t[p + "layer_output_norm.weight"] = v.full(D, s)
    else:
        t[p + "ffn_norm.weight"] = v.ones(D)


def _moe_ffn(t: dict, p: str, sh: _Shape, v, router) -> None:
    """Block ``p``'s router, routed experts (and their variant's tensors) and shared experts, made by ``v`` as
    in :func:`_attention`."""
    D, F, E, s, variant = sh.D, sh.F, sh.E, sh.s, sh.variant
    t[p + "ffn_gate_inp.weight"] = router
    gate = v.normal((E, F, D), 1 / np.sqrt(D))
    up = v.normal((E, F, D), 1 / np.sqrt(D))
    if variant.get("fused_gate_up"):
        t[p + "ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)  # {D, 2F, E}: gate rows first
    else:
        if variant.get("gated_experts", True):
            t[p + "ffn_gate_exps.weight"] = gate
        t[p + "ffn_up_exps.weight"] = up
    t[p + "ffn_down_exps.weight"] = v.normal((E, D, F), 2 * s / np.sqrt(F))
    if variant.get("expert_scales"):
        for kind in ("gate", "up", "down"):
            t[p + f"ffn_{kind}_exps.scale"] = v.uniform(E, 0.5, 1.5)
    if sh.arch == "gpt-oss":
        t[p + "ffn_gate_inp.bias"] = v.zeros(E)
        t[p + "ffn_gate_exps.bias"] = v.normal((E, F), 0.05)
        t[p + "ffn_up_exps.bias"] = v.normal((E, F), 0.05)
        t[p + "ffn_down_exps.bias"] = v.normal((E, D), 0.05 * s)
    if sh.arch in ("qwen2moe", "deepseek2", "llama4", "step35"):
        fs = sh.ns * F
        if sh.arch == "qwen2moe":
            t[p + "ffn_gate_inp_shexp.weight"] = v.normal((D,), 1 / np.sqrt(D))
        t[p + "ffn_gate_shexp.weight"] = v.normal((fs, D), 1 / np.sqrt(D))
        t[p + "ffn_up_shexp.weight"] = v.normal((fs, D), 1 / np.sqrt(D))
        t[p + "ffn_down_shexp.weight"] = v.normal((D, fs), 2 * s / np.sqrt(fs))


def _write(path: Path, sh: _Shape, rng) -> None:
    """Write the F32 model of :func:`make_tiny_model` to ``path`` with the checked sizes ``sh``, drawing every weight
    from ``rng`` in a fixed order (the same arguments and seed: the same file)."""
    w = gguf.GGUFWriter(str(path), sh.arch)
    w.add_name(f"hybrimoe-tiny-{sh.arch}")
    normal = _write_tokenizer(w, sh.tokenizer)
    n_vocab = len(normal)
    _write_metadata(w, sh)
    D = sh.D
    emb, routers, _ = router_design(rng, n_vocab, D, sh.E, sh.k, sh.L - sh.n_dense, sh.router_margin)
    t = {}
    t["token_embd.weight"] = emb
    t["output_norm.weight"] = np.ones(D, np.float32)
    # output head: rows of byte, control and unused tokens are zero (logit 0), so greedy decoding emits
    # text pieces (a lone byte token is invalid UTF-8 and llama-cpp-python then never stops generating)
    t["output.weight"] = _normal(rng, (n_vocab, D), 1.0 / np.sqrt(D)) * normal[:, None].astype(np.float32)
    draws = _Draws(rng)
    for il in range(sh.L):
        p = f"blk.{il}."
        _attention(t, p, sh, draws)
        if il < sh.n_dense:
            t[p + "ffn_gate.weight"] = _normal(rng, (sh.n_ff_d, D), 1 / np.sqrt(D))
            t[p + "ffn_up.weight"] = _normal(rng, (sh.n_ff_d, D), 1 / np.sqrt(D))
            t[p + "ffn_down.weight"] = _normal(rng, (D, sh.n_ff_d), 2 * sh.s / np.sqrt(sh.n_ff_d))
        else:
            _moe_ffn(t, p, sh, draws, routers[il - sh.n_dense])
    for name, arr in t.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
