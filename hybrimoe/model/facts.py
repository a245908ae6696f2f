"""Model facts: what the cost model and the simulator need to know about a MoE model, built in or read from a GGUF.

:class:`ModelFacts` holds the sizes (bytes, parameter counts) of a model's routed experts and of its other work per
layer; :data:`MODEL_FACTS` has the built-in entries (DeepSeek-V2-Lite, from its config.json and docs/design.md §6;
Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 and gpt-oss-120b from their config.json and llama.cpp's quant table, for
synthetic traces: :data:`QUANT_BLOCKS`, :func:`q4_k_m_expert_bytes`);
:func:`facts_from_gguf` reads them from a GGUF file's real tensors (through :func:`hybrimoe.model.reader.describe`,
the one reader of GGUF structure); :meth:`ModelFacts.to_dict` / :meth:`ModelFacts.from_dict` are their JSON form (schema
``hybrimoe.model_facts/1``, carried by routing traces as the field ``model_facts``);
:func:`selection_bias_from_gguf` reads DeepSeek-V3's selection bias (``exp_probs_b``).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Optional

import gguf
import numpy as np

from hybrimoe.model.reader import GGUFFile, describe, open_gguf
from hybrimoe.model.tables import GATINGS

FACTS_SCHEMA = "hybrimoe.model_facts/1"


@dataclass(frozen=True)
class ModelFacts:
    """Facts about a MoE model used to size experts and non-expert work (bytes, parameter counts).

    ``expert_bytes``: bytes of one routed expert (its gate, up and down weights as stored), the mean over the MoE
    layers; ``layer_expert_bytes``: the same per MoE layer (empty when only the mean is known). ``*_params`` are
    weight counts: ``expert_params`` of one routed expert, ``non_expert_params_per_moe_layer`` of everything else
    in a MoE layer (attention, shared experts, router, norms; mean over the MoE layers, per part in
    ``non_expert_parts``), ``dense_layer_params`` of a dense (non-MoE) layer (mean). Their bytes are
    ``non_expert_bytes_per_moe_layer`` / ``dense_layer_bytes`` when known (a GGUF's real tensor bytes), else the
    params times ``bytes_per_param_non_expert`` (:meth:`moe_layer_other_bytes`, :meth:`dense_bytes`).
    ``moe_layer_ids``: the model layer of each MoE layer (empty: unknown); ``n_layer``: the model's layers (0:
    unknown); ``n_head`` / ``n_head_kv``: attention heads (None: unknown); ``gating``: the router's gating
    function, one of :data:`GATINGS`. ``sources`` says where each number comes from.
    """

    name: str
    n_moe_layers: int
    n_dense_layers: int
    n_experts: int
    top_k: int
    n_shared_experts: int
    n_embd: int
    n_ff_exp: int
    expert_bytes: float
    expert_params: float
    non_expert_params_per_moe_layer: float
    dense_layer_params: float
    bytes_per_param_non_expert: float
    sources: dict = field(default_factory=dict)
    architecture: str = ""
    n_layer: int = 0
    moe_layer_ids: tuple = ()
    layer_expert_bytes: tuple = ()
    n_head: Optional[int] = None
    n_head_kv: Optional[int] = None
    gating: str = ""
    non_expert_bytes_per_moe_layer: Optional[float] = None
    dense_layer_bytes: Optional[float] = None
    non_expert_parts: dict = field(default_factory=dict)

    def moe_layer_other_bytes(self) -> float:
        """Bytes of a MoE layer's non-expert weights: the real ones when known, else params x bytes per param."""
        if self.non_expert_bytes_per_moe_layer is not None:
            return float(self.non_expert_bytes_per_moe_layer)
        return self.non_expert_params_per_moe_layer * self.bytes_per_param_non_expert

    def dense_bytes(self) -> float:
        """Bytes of a dense layer's weights: the real ones when known, else params x bytes per param."""
        if self.dense_layer_bytes is not None:
            return float(self.dense_layer_bytes)
        return self.dense_layer_params * self.bytes_per_param_non_expert

    def per_layer_expert_bytes(self) -> np.ndarray:
        """float64 ``[n_moe_layers]``: ``layer_expert_bytes``, or ``expert_bytes`` for every layer."""
        if self.layer_expert_bytes:
            return np.array(self.layer_expert_bytes, dtype=np.float64)
        return np.full(self.n_moe_layers, float(self.expert_bytes))

    def validate(self, where: str = "model facts") -> None:
        """Raises ValueError ``<where>: '<field>' ...`` naming the first field without a valid value (types,
        ranges, lengths)."""
        for f in fields(self):
            _check_field(f.name, getattr(self, f.name), where)
        if self.n_moe_layers < 1 or self.n_experts < 1:
            raise ValueError(f"{where}: 'n_moe_layers' and 'n_experts' must be >= 1, got {self.n_moe_layers} and "
                             f"{self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"{where}: 'top_k' must be in 1..n_experts ({self.n_experts}), got {self.top_k}")
        if self.expert_bytes <= 0 or self.expert_params <= 0:
            raise ValueError(f"{where}: 'expert_bytes' and 'expert_params' must be > 0")
        for key in ("layer_expert_bytes", "moe_layer_ids"):
            v = getattr(self, key)
            if v and len(v) != self.n_moe_layers:
                raise ValueError(f"{where}: '{key}' has {len(v)} entries for {self.n_moe_layers} MoE layers")
        if any(b <= 0 for b in self.layer_expert_bytes):
            raise ValueError(f"{where}: 'layer_expert_bytes' must all be > 0")
        ids = [int(i) for i in self.moe_layer_ids]
        if ids and (any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0
                    or (self.n_layer and ids[-1] >= self.n_layer)):
            raise ValueError(f"{where}: 'moe_layer_ids' must increase within 0..n_layer-1 ({self.n_layer - 1}), got "
                             f"{ids}")

    def to_dict(self) -> dict:
        """The JSON-safe dict (schema :data:`FACTS_SCHEMA`): ``"schema"`` and every field, tuples as lists, None as
        null.

        Raises:
            ValueError: the facts are not valid (:meth:`validate`), e.g. a number that JSON cannot hold.
        """
        self.validate()
        d: dict = {"schema": FACTS_SCHEMA}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "moe_layer_ids":
                v = [int(x) for x in v]
            elif f.name == "layer_expert_bytes":
                v = [float(x) for x in v]
            elif f.name == "non_expert_parts":
                v = {str(k): float(x) for k, x in v.items()}
            elif f.name == "sources":
                v = dict(v)
            elif isinstance(v, (np.integer, np.floating)):
                v = v.item()
            d[f.name] = v
        return d

    @classmethod
    def from_dict(cls, d, where: str = "model facts") -> "ModelFacts":
        """ModelFacts from :meth:`to_dict`'s dict (as :func:`json.loads` gives it). ``sources`` and the keys from
        ``architecture`` on may be left out (their defaults); the others are required.

        Raises:
            ValueError: not a dict, a wrong or missing ``schema``, or a missing, unknown or bad key (named, with
                ``where``).
        """
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
        if d.get("schema") != FACTS_SCHEMA:
            raise ValueError(f"{where}: 'schema' must be '{FACTS_SCHEMA}', got {d.get('schema')!r}")
        known = [f.name for f in fields(cls)]
        unknown = [str(k) for k in d if k != "schema" and k not in known]
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}")
        kw = {}
        for name in known:
            if name not in d:
                if name in _REQUIRED:
                    raise ValueError(f"{where}: missing key '{name}'")
                continue
            v = d[name]
            _check_field(name, v, where)
            kw[name] = tuple(v) if isinstance(v, list) else (dict(v) if isinstance(v, dict) else v)
        facts = cls(**kw)
        facts.validate(where)
        return facts


_INTS = ("n_moe_layers", "n_dense_layers", "n_experts", "top_k", "n_shared_experts", "n_embd", "n_ff_exp", "n_layer")
_FLOATS = ("expert_bytes", "expert_params", "non_expert_params_per_moe_layer", "dense_layer_params",
           "bytes_per_param_non_expert")
_REQUIRED = ("name",) + _INTS[:-1] + _FLOATS


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
            and math.isfinite(v) and v >= 0)


def _check_field(name: str, v, where: str) -> None:
    """ValueError ``<where>: '<name>' must be ...`` when ``v`` is not a valid value of the ModelFacts field
    ``name``."""
    if name in ("name", "architecture"):
        ok, want = isinstance(v, str), "a string"
    elif name == "gating":
        ok, want = v in GATINGS, "one of " + ", ".join(repr(g) for g in GATINGS)
    elif name in _INTS:
        ok, want = _is_int(v) and v >= 0, "an integer >= 0"
    elif name in ("n_head", "n_head_kv"):
        ok, want = v is None or (_is_int(v) and v >= 0), "null or an integer >= 0"
    elif name in _FLOATS:
        ok, want = _is_number(v), "a finite number >= 0"
    elif name in ("non_expert_bytes_per_moe_layer", "dense_layer_bytes"):
        ok, want = v is None or _is_number(v), "null or a finite number >= 0"
    elif name == "moe_layer_ids":
        ok, want = isinstance(v, (list, tuple)) and all(_is_int(x) for x in v), "a list of integers"
    elif name == "layer_expert_bytes":
        ok, want = isinstance(v, (list, tuple)) and all(_is_number(x) for x in v), "a list of finite numbers >= 0"
    elif name == "sources":
        ok = isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())
        want = "an object of strings"
    else:  # non_expert_parts
        ok = isinstance(v, dict) and all(isinstance(k, str) and _is_number(x) for k, x in v.items())
        want = "an object of finite numbers >= 0"
    if not ok:
        shown = v if isinstance(v, (bool, int, float, str, type(None))) else type(v).__name__
        raise ValueError(f"{where}: '{name}' must be {want}, got {shown!r}")


def _dsv2_lite() -> ModelFacts:
    n_embd, n_ff_exp, n_ff_dense, heads = 2048, 1408, 10944, 16
    gate_up = 2 * n_embd * n_ff_exp * 4.5 / 8          # Q4_K, 4.5 bpw
    down = n_embd * n_ff_exp * 8.5 / 8                 # rows of 1408 cannot be K-quants: Q8_0 fallback, 8.5 bpw
    expert_params = 3 * n_embd * n_ff_exp
    attn = n_embd * heads * 192 + n_embd * (512 + 64) + 512 * heads * 256 + heads * 128 * n_embd
    shared = 2 * expert_params
    router = n_embd * 64
    return ModelFacts(
        name="deepseek-v2-lite", n_moe_layers=26, n_dense_layers=1, n_experts=64, top_k=6, n_shared_experts=2,
        n_embd=n_embd, n_ff_exp=n_ff_exp, expert_bytes=gate_up + down, expert_params=expert_params,
        non_expert_params_per_moe_layer=attn + shared + router,
        dense_layer_params=attn + 3 * n_embd * n_ff_dense,
        bytes_per_param_non_expert=(gate_up + down) / expert_params,
        architecture="deepseek2", n_layer=27, moe_layer_ids=tuple(range(1, 27)), n_head=heads, gating="softmax",
        non_expert_parts={"attention": float(attn), "shared_experts": float(shared), "router": float(router)},
        sources={
            "shape": "DeepSeek-V2-Lite config.json: hidden 2048, moe_intermediate 1408, intermediate 10944, 27 layers "
                     "(first 1 dense), 64 routed experts, top-6, 2 shared, 16 heads, kv_lora_rank 512, "
                     "qk_nope 128 + qk_rope 64, v_head 128, scoring_func softmax; docs/design.md §6",
            "expert_bytes": "docs/design.md §6: Q4_K_M DeepSeek-V2-Lite, gate+up Q4_K (4.5 bpw, 3.24 MB) + ffn_down "
                            "legacy fallback (Q8_0, 8.5 bpw, 3.06 MB) = 6.31 MB, the top of the 5.2-6.3 MB range; read "
                            "the real sizes from the GGUF when one is at hand",
            "non_expert": "our arithmetic from the config (MLA attention 13.8 M + 2 shared experts 17.3 M + router "
                          "0.13 M params per MoE layer; norms left out), stored at the experts' bytes per parameter "
                          "(assumption)",
        },
    )


# ---- built-in shapes for synthetic traces: config.json numbers and llama.cpp's quant table ----------------------

#: ggml's block sizes, ``type: (weights per block, bytes per block)``: ggml/src/ggml-common.h of the pinned upstream
#: (vendor/llama.cpp/pin.json): block_q4_K = 2 fp16 (d, dmin) + 12 bytes of scales + 128 bytes of 4-bit quants;
#: block_q6_K = 128 (ql) + 64 (qh) + 16 int8 scales + fp16 d; block_q8_0 = fp16 d + 32 int8; block_mxfp4 = 1 byte
#: (e8m0 scale) + 16 bytes (32 4-bit values)
QUANT_BLOCKS = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q8_0": (32, 34), "MXFP4": (32, 17), "Q5_0": (32, 22)}
_QUANT_SOURCE = ("ggml/src/ggml-common.h (pinned upstream): Q4_K 144 bytes / 256 weights = 4.5 bpw, Q6_K 210 / 256 = "
                 "6.5625 bpw, Q8_0 34 / 32 = 8.5 bpw, MXFP4 17 / 32 = 4.25 bpw, Q5_0 22 / 32 = 5.5 bpw")


def bits_per_weight(quant: str) -> float:
    """Bits per weight of a ggml quant type of :data:`QUANT_BLOCKS` (8 x bytes per block / weights per block).

    Raises:
        ValueError: a type not in :data:`QUANT_BLOCKS` (named, with the known ones).
    """
    if quant not in QUANT_BLOCKS:
        raise ValueError(f"unknown quant type {quant!r} (known: {', '.join(QUANT_BLOCKS)})")
    n, b = QUANT_BLOCKS[quant]
    return 8.0 * b / n


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """upstream's use_more_bits (src/llama-quant.cpp, llama_tensor_get_type): the layers whose ffn_down a Q4_K_M
    file stores as Q6_K (the first and last eighth and every third layer between)."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def q4_k_m_expert_bytes(n_embd: int, n_ff_exp: int, moe_layer_ids, n_layer_all: int) -> tuple:
    """Bytes of one routed expert per MoE layer of a llama.cpp Q4_K_M file: gate and up (``n_embd x n_ff_exp``
    each) Q4_K; ffn_down Q6_K in the layers of upstream's use_more_bits(il, n_layer_all), else Q4_K
    (src/llama-quant.cpp, llama_tensor_get_type: ftype Q4_K_M, FFN_DOWN; the layer is parsed from the tensor name
    for MoE models and n_layer_all is the GGUF's block count). ffn_down's rows are ``n_ff_exp`` wide: where that is
    not a multiple of 256 upstream falls back to a type of 32-weight blocks (src/llama-quant.cpp,
    tensor_type_fallback: Q4_K -> Q5_0, Q6_K -> Q8_0).

    Raises:
        ValueError: ``n_embd`` (gate and up's rows) not a multiple of 256, or ``n_ff_exp`` not one of 32.
    """
    if n_embd % 256 or n_ff_exp % 32:
        raise ValueError(f"K-quant rows must be multiples of 256 (gate, up) and 32 (down), got n_embd {n_embd}, "
                         f"n_ff_exp {n_ff_exp}")
    k_rows = n_ff_exp % 256 == 0
    q4, q6 = bits_per_weight("Q4_K"), bits_per_weight("Q6_K")
    d4, d6 = (q4, q6) if k_rows else (bits_per_weight("Q5_0"), bits_per_weight("Q8_0"))
    gate_up = 2 * n_embd * n_ff_exp * q4 / 8
    return tuple(float(gate_up + n_embd * n_ff_exp * (d6 if _use_more_bits(il, n_layer_all) else d4) / 8)
                 for il in moe_layer_ids)


def _config_facts(name: str, *, arch: str, n_layer: int, n_dense: int, n_experts: int, top_k: int, n_shared: int,
                  n_embd: int, n_ff_exp: int, n_ff_dense: int, n_head: int, n_head_kv: int, attn_params: float,
                  gating: str, layer_bytes: tuple, shape_src: str, bytes_src: str, attn_src: str) -> ModelFacts:
    """ModelFacts of a model known from its config.json (numbers in ``shape_src``) and a stated quant type
    (``layer_bytes``, explained by ``bytes_src``); non-expert bytes at the experts' bytes per weight (an assumption,
    as for DeepSeek-V2-Lite)."""
    expert_params = 3 * n_embd * n_ff_exp
    shared = n_shared * expert_params
    router = n_embd * n_experts
    bpp = float(np.mean(layer_bytes)) / expert_params
    f = ModelFacts(
        name=name, n_moe_layers=n_layer - n_dense, n_dense_layers=n_dense, n_experts=n_experts, top_k=top_k,
        n_shared_experts=n_shared, n_embd=n_embd, n_ff_exp=n_ff_exp, expert_bytes=float(np.mean(layer_bytes)),
        expert_params=float(expert_params), non_expert_params_per_moe_layer=float(attn_params + shared + router),
        dense_layer_params=float(attn_params + 3 * n_embd * n_ff_dense) if n_dense else 0.0,
        bytes_per_param_non_expert=bpp, architecture=arch, n_layer=n_layer,
        moe_layer_ids=tuple(range(n_dense, n_layer)),
        layer_expert_bytes=tuple(layer_bytes), n_head=n_head, n_head_kv=n_head_kv, gating=gating,
        non_expert_parts={"attention": float(attn_params), "shared_experts": float(shared), "router": float(router)},
        sources={
            "shape": shape_src,
            "expert_params": f"3 matrices (gate, up, down) x n_embd {n_embd} x n_ff_exp {n_ff_exp} = {expert_params}",
            "expert_bytes": bytes_src + "; " + _QUANT_SOURCE,
            "non_expert": f"our arithmetic from the config: {attn_src}; + {n_shared} shared expert(s) + router "
                          f"n_embd x {n_experts}; norms left out. Stored at the routed experts' bytes per weight "
                          "(assumption: the file's other tensors may use other types)",
            "assumptions": "not read from a GGUF: layer counts and widths from config.json, bytes from the quant "
                           "table; biases (gpt-oss) and norms left out",
        })
    f.validate(f"built-in model facts {name}")
    return f


def _mixtral_8x7b() -> ModelFacts:
    n_embd, n_ff, n_layer, heads, kv, hd = 4096, 14336, 32, 32, 8, 128
    attn = n_embd * heads * hd + 2 * n_embd * kv * hd + heads * hd * n_embd
    return _config_facts(
        "mixtral-8x7b", arch="llama", n_layer=n_layer, n_dense=0, n_experts=8, top_k=2, n_shared=0, n_embd=n_embd,
        n_ff_exp=n_ff, n_ff_dense=0, n_head=heads, n_head_kv=kv, attn_params=attn, gating="softmax",
        layer_bytes=q4_k_m_expert_bytes(n_embd, n_ff, range(n_layer), n_layer),
        shape_src="mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size 4096, intermediate_size 14336 (each expert), "
                  "num_hidden_layers 32 (all MoE), num_local_experts 8, num_experts_per_tok 2, num_attention_heads 32, "
                  "num_key_value_heads 8 (head_dim 4096/32 = 128); softmax router",
        bytes_src="Q4_K_M (llama.cpp's llama_tensor_get_type as pinned): gate+up Q4_K 2 x 33.03 MB; ffn_down Q6_K "
                  "(48.17 MB) in the 16 use_more_bits layers of 32, Q4_K (33.03 MB) in the others: 114.23 or 99.09 MB "
                  "per expert (files made by older llama.cpp, with one tensor per expert, may differ)",
        attn_src="GQA attention q 4096x4096 + k, v 4096x1024 + o 4096x4096 = 41.9 M")


def _qwen3_30b_a3b() -> ModelFacts:
    n_embd, n_ff, n_layer, heads, kv, hd = 2048, 768, 48, 32, 4, 128
    attn = n_embd * heads * hd + 2 * n_embd * kv * hd + heads * hd * n_embd
    return _config_facts(
        "qwen3-30b-a3b", arch="qwen3moe", n_layer=n_layer, n_dense=0, n_experts=128, top_k=8, n_shared=0,
        n_embd=n_embd, n_ff_exp=n_ff, n_ff_dense=0, n_head=heads, n_head_kv=kv, attn_params=attn, gating="softmax",
        layer_bytes=q4_k_m_expert_bytes(n_embd, n_ff, range(n_layer), n_layer),
        shape_src="Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, moe_intermediate_size 768, num_hidden_layers 48 "
                  "(decoder_sparse_step 1, mlp_only_layers []: all MoE), num_experts 128, num_experts_per_tok 8, "
                  "num_attention_heads 32, num_key_value_heads 4, head_dim 128, norm_topk_prob true; softmax router",
        bytes_src="Q4_K_M (llama.cpp's llama_tensor_get_type as pinned): gate+up Q4_K 2 x 0.88 MB; ffn_down Q6_K "
                  "(1.29 MB) in the 24 use_more_bits layers of 48, Q4_K (0.88 MB) in the others: 3.06 or 2.65 MB per "
                  "expert",
        attn_src="GQA attention q 2048x4096 + k, v 2048x512 + o 4096x2048 = 18.9 M (q/k norms left out)")


def _mla_attn_params(n_embd: int, heads: int, q_lora: int = 1536, kv_lora: int = 512, nope: int = 128,
                     rope: int = 64, v: int = 128) -> int:
    """Weights of one multi-head latent attention block (DeepSeek-V2/V3's MLA, as in their config.json: q_a, q_b,
    kv_a, kv_b and o projections; norms left out); the defaults are DeepSeek-V3's and Kimi-K2's ranks."""
    return (n_embd * q_lora + q_lora * heads * (nope + rope) + n_embd * (kv_lora + rope)
            + kv_lora * heads * (nope + v) + heads * v * n_embd)


def _deepseek_v3() -> ModelFacts:
    n_embd, n_ff, n_dense_ff, n_layer, heads = 7168, 2048, 18432, 61, 128
    attn = _mla_attn_params(n_embd, heads)
    return _config_facts(
        "deepseek-v3", arch="deepseek2", n_layer=n_layer, n_dense=3, n_experts=256, top_k=8, n_shared=1,
        n_embd=n_embd, n_ff_exp=n_ff, n_ff_dense=n_dense_ff, n_head=heads, n_head_kv=heads, attn_params=attn,
        gating="sigmoid", layer_bytes=q4_k_m_expert_bytes(n_embd, n_ff, range(3, n_layer), n_layer),
        shape_src="deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, moe_intermediate_size 2048, "
                  "intermediate_size 18432 (dense layers), num_hidden_layers 61, first_k_dense_replace 3 (58 MoE "
                  "layers), n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1, num_attention_heads 128, "
                  "q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, "
                  "scoring_func sigmoid (topk_method noaux_tc, n_group 8, topk_group 4); the MTP layer "
                  "(num_nextn_predict_layers 1) is not converted (upstream conversion/deepseek.py: skip_mtp)",
        bytes_src="Q4_K_M (llama.cpp's llama_tensor_get_type as pinned, 61 blocks): gate+up Q4_K 2 x 8.26 MB; "
                  "ffn_down Q6_K (12.04 MB) in the 27 use_more_bits layers of the 58 MoE layers, Q4_K (8.26 MB) in "
                  "the others: 28.56 or 24.77 MB per expert",
        attn_src="MLA attention q_a 7168x1536 + q_b 1536x(128x192) + kv_a 7168x576 + kv_b 512x(128x256) + o "
                 "(128x128)x7168 = 187.1 M; dense layers add 3 x 7168 x 18432")


def _kimi_k2() -> ModelFacts:
    n_embd, n_ff, n_dense_ff, n_layer, heads = 7168, 2048, 18432, 61, 64
    attn = _mla_attn_params(n_embd, heads)
    return _config_facts(
        "kimi-k2", arch="deepseek2", n_layer=n_layer, n_dense=1, n_experts=384, top_k=8, n_shared=1,
        n_embd=n_embd, n_ff_exp=n_ff, n_ff_dense=n_dense_ff, n_head=heads, n_head_kv=heads, attn_params=attn,
        gating="sigmoid", layer_bytes=q4_k_m_expert_bytes(n_embd, n_ff, range(1, n_layer), n_layer),
        shape_src="moonshotai/Kimi-K2-Instruct config.json (the DeepSeek-V3 architecture): hidden_size 7168, "
                  "moe_intermediate_size 2048, intermediate_size 18432 (dense layer), num_hidden_layers 61, "
                  "first_k_dense_replace 1 (60 MoE layers), n_routed_experts 384, num_experts_per_tok 8, "
                  "n_shared_experts 1, num_attention_heads 64, q_lora_rank 1536, kv_lora_rank 512, "
                  "qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, scoring_func sigmoid",
        bytes_src="Q4_K_M (llama.cpp's llama_tensor_get_type as pinned, 61 blocks): as DeepSeek-V3's experts "
                  "(the same expert shape): 28.56 or 24.77 MB per expert",
        attn_src="MLA attention with 64 heads: q_a 7168x1536 + q_b 1536x(64x192) + kv_a 7168x576 + kv_b "
                 "512x(64x256) + o (64x128)x7168; the dense layer adds 3 x 7168 x 18432")


def _qwen3_235b_a22b() -> ModelFacts:
    n_embd, n_ff, n_layer, heads, kv, hd = 4096, 1536, 94, 64, 4, 128
    attn = n_embd * heads * hd + 2 * n_embd * kv * hd + heads * hd * n_embd
    return _config_facts(
        "qwen3-235b-a22b", arch="qwen3moe", n_layer=n_layer, n_dense=0, n_experts=128, top_k=8, n_shared=0,
        n_embd=n_embd, n_ff_exp=n_ff, n_ff_dense=0, n_head=heads, n_head_kv=kv, attn_params=attn, gating="softmax",
        layer_bytes=q4_k_m_expert_bytes(n_embd, n_ff, range(n_layer), n_layer),
        shape_src="Qwen/Qwen3-235B-A22B config.json (as THUDM/slime's scripts/models/qwen3-235B-A22B.sh restates "
                  "it): hidden_size 4096, moe_intermediate_size 1536, num_hidden_layers 94 (all MoE), num_experts "
                  "128, num_experts_per_tok 8, num_attention_heads 64, num_key_value_heads 4, head_dim 128; softmax "
                  "router",
        bytes_src="Q4_K_M (llama.cpp's llama_tensor_get_type as pinned): gate+up Q4_K 2 x 3.54 MB; ffn_down Q6_K "
                  "(5.16 MB) in the 46 use_more_bits layers of 94, Q4_K (3.54 MB) in the others: 12.24 or 10.62 MB "
                  "per expert",
        attn_src="GQA attention q 4096x8192 + k, v 4096x512 + o 8192x4096 = 71.3 M (q/k norms left out)")


def _glm45_air() -> ModelFacts:
    n_embd, n_ff, n_dense_ff, n_layer, heads, kv, hd = 4096, 1408, 10944, 46, 96, 8, 128
    attn = n_embd * heads * hd + 2 * n_embd * kv * hd + heads * hd * n_embd
    return _config_facts(
        "glm-4.5-air", arch="glm4moe", n_layer=n_layer, n_dense=1, n_experts=128, top_k=8, n_shared=1,
        n_embd=n_embd, n_ff_exp=n_ff, n_ff_dense=n_dense_ff, n_head=heads, n_head_kv=kv, attn_params=attn,
        gating="sigmoid", layer_bytes=q4_k_m_expert_bytes(n_embd, n_ff, range(1, n_layer), n_layer),
        shape_src="zai-org/GLM-4.5-Air config.json (as THUDM/slime's scripts/models/glm4.5-106B-A12B.sh restates "
                  "it): hidden_size 4096, moe_intermediate_size 1408, intermediate_size 10944 (the dense layer), "
                  "num_hidden_layers 46, first_k_dense_replace 1 (45 MoE layers), n_routed_experts 128, "
                  "num_experts_per_tok 8, n_shared_experts 1, num_attention_heads 96, num_key_value_heads 8, "
                  "head_dim 128; sigmoid router with a selection bias; the MTP layer left out",
        bytes_src="Q4_K_M (llama.cpp's llama_tensor_get_type as pinned, 46 blocks): gate+up Q4_K 2 x 3.24 MB; "
                  "ffn_down's rows of 1408 are no multiple of 256, so upstream's fallback stores it Q8_0 (6.13 MB) "
                  "in the use_more_bits layers and Q5_0 (3.96 MB) in the others: 12.62 or 10.45 MB per expert",
        attn_src="GQA attention q 4096x12288 + k, v 4096x1024 + o 12288x4096 = 109.1 M (biases left out); the "
                 "dense layer adds 3 x 4096 x 10944")


def _gpt_oss_120b() -> ModelFacts:
    n_embd, n_ff, n_layer, heads, kv, hd = 2880, 2880, 36, 64, 8, 64
    attn = n_embd * heads * hd + 2 * n_embd * kv * hd + heads * hd * n_embd
    per = 3 * n_embd * n_ff * bits_per_weight("MXFP4") / 8
    return _config_facts(
        "gpt-oss-120b", arch="gpt-oss", n_layer=n_layer, n_dense=0, n_experts=128, top_k=4, n_shared=0,
        n_embd=n_embd, n_ff_exp=n_ff, n_ff_dense=0, n_head=heads, n_head_kv=kv, attn_params=attn,
        gating="softmax_weight", layer_bytes=(per,) * n_layer,
        shape_src="openai/gpt-oss-120b config.json: hidden_size 2880, intermediate_size 2880 (each expert; gate_up "
                  "fused, 2 x 2880), num_hidden_layers 36 (all MoE), num_local_experts 128, experts_per_token 4, "
                  "num_attention_heads 64, num_key_value_heads 8, head_dim 64; softmax over the selected experts' "
                  "logits (upstream's gating softmax_weight for gpt-oss)",
        bytes_src="MXFP4 experts, as OpenAI ships them and upstream keeps them (llama-quant.cpp: MXFP4_MOE stores "
                  "expert tensors as MXFP4): 3 x 2880 x 2880 x 4.25 / 8 = 13.22 MB per expert (expert biases left out)",
        attn_src="GQA attention q 2880x4096 + k, v 2880x512 + o 4096x2880 = 26.5 M (sinks, biases left out)")


MODEL_FACTS = {"deepseek-v2-lite": _dsv2_lite(), "mixtral-8x7b": _mixtral_8x7b(), "qwen3-30b-a3b": _qwen3_30b_a3b(),
               "deepseek-v3": _deepseek_v3(), "kimi-k2": _kimi_k2(), "gpt-oss-120b": _gpt_oss_120b(),
               "qwen3-235b-a22b": _qwen3_235b_a22b(), "glm-4.5-air": _glm45_air()}


# ---- from a GGUF ---------------------------------------------------------------------------------------------------

def _run_moe_layers(d: dict) -> tuple[int, list]:
    """(layers that inference runs, their MoE layers) of a :func:`hybrimoe.model.reader.describe` dict: upstream's
    llama_hparams::n_layer() leaves out the trailing ``nextn_predict_layers`` blocks (multi-token prediction), whose
    experts no token routes through in a normal run.

    Raises:
        ValueError: no MoE layer among them.
    """
    n_run = int(d["n_layer"]) - int(d.get("n_layer_nextn") or 0)
    moe = [il for il in d["moe_layers"] if il < n_run]
    if not d["has_experts"] or not moe:
        raise ValueError(f"{d['path']}: not a Mixture-of-Experts model (no ffn_*_exps tensors in the layers that "
                         "run)")
    return n_run, moe


def _expert_width(kinds: dict, il: int) -> int:
    """n_ff_exp of MoE layer ``il``: ne1 of its gate (or up) experts, half of a fused gate_up's; 0 when unknown."""
    for kind, div in (("gate", 1), ("up", 1), ("gate_up", 2)):
        if il in kinds.get(kind, {}).get("layers", {}):
            return int(kinds[kind]["layers"][il]["shape"][1]) // div
    return 0


def facts_from_description(d: dict) -> ModelFacts:
    """ModelFacts from a :func:`hybrimoe.model.reader.describe` dict (see :func:`facts_from_gguf`).

    Raises:
        ValueError: not a MoE model, or a key the facts need is missing from the file (named).
    """
    where, arch = d["path"], d["architecture"]
    n_run, moe = _run_moe_layers(d)
    if not d["n_embd"]:
        raise ValueError(f"{where}: no {arch}.embedding_length")
    if not d["n_expert_used"]:
        raise ValueError(f"{where}: no {arch}.expert_used_count (top-k)")
    kinds = d["expert_tensors"]
    layer_bytes, layer_params = [], []
    for il in moe:
        per = [k["layers"][il] for k in kinds.values() if il in k["layers"]]
        layer_bytes.append(float(sum(v["bytes_per_expert"] for v in per)))
        layer_params.append(float(sum(v["shape"][0] * v["shape"][1] for v in per)))
    widths = [_expert_width(kinds, il) for il in moe]
    dense = [il for il in range(n_run) if il not in d["moe_layers"]]
    parts = d["layer_parts"]

    def totals(il):
        p = parts.get(il, {})
        return float(sum(v[0] for v in p.values())), float(sum(v[1] for v in p.values()))

    moe_pb = [totals(il) for il in moe]
    dense_pb = [totals(il) for il in dense]
    all_params, all_bytes = sum(p for p, _ in moe_pb + dense_pb), sum(b for _, b in moe_pb + dense_pb)
    if all_params > 0:
        bpp, bpp_src = all_bytes / all_params, "these tensors' bytes / elements over all layers that run"
    else:
        bpp, bpp_src = sum(layer_bytes) / sum(layer_params), "no such tensors: the routed experts' bytes / elements"
    mean_parts = {part: float(np.mean([parts.get(il, {}).get(part, [0, 0])[0] for il in moe]))
                  for part in sorted({p for il in moe for p in parts.get(il, {})})}
    name = d["name"] if isinstance(d.get("name"), str) and d["name"] else os.path.basename(where)
    ff_note = "" if len(set(widths)) == 1 else " (it varies between MoE layers: the first one's)"
    facts = ModelFacts(
        name=name, n_moe_layers=len(moe), n_dense_layers=len(dense), n_experts=int(d["n_expert"]),
        top_k=int(d["n_expert_used"]), n_shared_experts=int(d["shared"]["count"]) if d["shared"] else 0,
        n_embd=int(d["n_embd"]), n_ff_exp=widths[0], expert_bytes=float(np.mean(layer_bytes)),
        expert_params=float(np.mean(layer_params)),
        non_expert_params_per_moe_layer=float(np.mean([p for p, _ in moe_pb])),
        dense_layer_params=float(np.mean([p for p, _ in dense_pb])) if dense_pb else 0.0,
        bytes_per_param_non_expert=float(bpp), architecture=arch, n_layer=n_run, moe_layer_ids=tuple(moe),
        layer_expert_bytes=tuple(layer_bytes), n_head=d.get("n_head"), n_head_kv=d.get("n_head_kv"),
        gating=d["gating"], non_expert_bytes_per_moe_layer=float(np.mean([b for _, b in moe_pb])),
        dense_layer_bytes=float(np.mean([b for _, b in dense_pb])) if dense_pb else None,
        non_expert_parts=mean_parts,
        sources={
            "shape": f"GGUF {where}: {arch}.block_count (less nextn_predict_layers), embedding_length, expert_count, "
                     "expert_used_count, attention.head_count(_kv), expert_shared_count; MoE layers are the blocks "
                     "with ffn_*_exps tensors",
            "expert_bytes": f"GGUF {where}: per MoE layer, the ffn_*_exps weight tensors' bytes / experts (hybrimoe "
                            "info's bytes per expert; biases left out); expert_bytes is their mean",
            "expert_params": f"GGUF {where}: elements of one expert's ffn_*_exps weights (mean over the MoE layers); "
                             f"n_ff_exp from their shape{ff_note}",
            "non_expert": f"GGUF {where}: elements and bytes of every other blk.N tensor (attention, shared experts, "
                          "router, norms; a dense layer's FFN), per MoE layer and per dense layer, mean over those "
                          "layers; token embedding and output head left out",
            "bytes_per_param_non_expert": f"GGUF {where}: {bpp_src}",
            "gating": f"GGUF {where}: {d['gating_source']}",
        })
    facts.validate(f"model facts of {where}")
    return facts


def facts_from_gguf(path: "str | os.PathLike | GGUFFile") -> ModelFacts:
    """The ModelFacts of a GGUF MoE model, every number read from the file (``sources`` says which keys and
    tensors).

    Expert bytes are per MoE layer (``layer_expert_bytes``: ``hybrimoe info``'s bytes per expert summed over gate,
    up and down; ``expert_bytes``: their mean); the non-expert parameter counts and bytes are the file's other
    ``blk.N`` tensors (attention, shared experts, router, norms per MoE layer; dense layers), averaged over those
    layers; bytes per non-expert parameter are their bytes / elements; the gating function is
    ``<arch>.expert_gating_func`` (:func:`hybrimoe.model.reader.expert_gating` when absent). Multi-token-prediction
    blocks (``nextn_predict_layers``) are left out, as upstream's inference leaves them out.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a GGUF file, truncated or corrupt; not a MoE model; a key the facts need is missing.
    """
    return facts_from_description(describe(path))


def selection_bias_from_gguf(path: "str | os.PathLike | GGUFFile") -> Optional[np.ndarray]:
    """DeepSeek-V3's selection bias of a GGUF MoE model: float32 ``[moe_layers, n_experts]`` from the tensors
    ``blk.N.exp_probs_b.bias`` (added to the router's scores for the choice of experts only: upstream's
    llm_graph_context::build_moe_ffn), rows in the order of :attr:`ModelFacts.moe_layer_ids`; a MoE layer without
    the tensor gets zeros (nothing added); None when no layer has one.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a GGUF or not a MoE file; a bias tensor that is not F32/F16 or not ``n_experts`` long.
    """
    g = path if isinstance(path, GGUFFile) else open_gguf(path)
    d = describe(g)
    _, moe = _run_moe_layers(d)
    tensors = g.tensors
    E = int(d["n_expert"])
    out = np.zeros((len(moe), E), np.float32)
    found = False
    for i, il in enumerate(moe):
        t = tensors.get(f"blk.{il}.exp_probs_b.bias")
        if t is None:
            continue
        kind = gguf.GGMLQuantizationType(int(t.tensor_type))
        if kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise ValueError(f"{d['path']}: {t.name} is {kind.name}, expected F32 or F16")
        v = np.asarray(t.data).astype(np.float32).ravel()
        if v.size != E:
            raise ValueError(f"{d['path']}: {t.name} has {v.size} values for {E} experts")
        out[i] = v
        found = True
    return out if found else None
