"""Routing traces: a versioned ``.npz`` format, its loader, and the model facts the simulator needs.

Format ``hybrimoe.trace`` version 1 (one ``.npz`` file):

================== ============================== =====================================================
field              shape / dtype                  meaning
================== ============================== =====================================================
``format``         str                            ``"hybrimoe.trace"``
``format_version`` int                            1
``expert_ids``     ``[tokens, moe_layers, top_k]`` routed expert ids, int8/int16; each row is a *set*
``prompt_offsets`` ``[prompts + 1]`` int64         prompt i covers tokens ``[off[i], off[i+1])``
``num_experts``    int                            routed experts per MoE layer
``top_k``          int                            experts per token
``moe_layer_ids``  ``[moe_layers]`` int            model layer index of each MoE layer
``expert_bytes``   ``[moe_layers]`` float64        bytes of one routed expert per MoE layer
``n_dense_layers`` int                            leading dense (non-MoE) layers
``model``          str                            model name (selects :data:`MODEL_FACTS`)
``router_scores``  ``[tokens, moe_layers, E]``    optional router probabilities (float16/32)
================== ============================== =====================================================

Files without ``format`` (such as the DeepSeek-V2-Lite development trace, a file given with ``--trace`` /
``$HYBRIMOE_TRACE``, docs/design.md §12: ids, offsets, ``moe_layer_ids``, ``num_experts``, ``top_k``, no scores)
load as version 0; their model facts come from :data:`MODEL_FACTS` (``model=`` or recognised by shape). Without
router scores, score-based policies (MRS) fall back to 1/top_k for each activated expert: say so in any result that
uses such a trace.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

FORMAT = "hybrimoe.trace"
FORMAT_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ModelFacts:
    """Facts about a MoE model used to size experts and non-expert work (bytes, parameter counts).

    ``expert_bytes`` is the size of one routed expert (gate + up + down) as stored in the GGUF; ``*_params`` are
    weight counts. ``sources`` says where each number comes from.
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
        sources={
            "shape": "DeepSeek-V2-Lite config.json: hidden 2048, moe_intermediate 1408, intermediate 10944, 27 layers "
                     "(first 1 dense), 64 routed experts, top-6, 2 shared, 16 heads, kv_lora_rank 512, "
                     "qk_nope 128 + qk_rope 64, v_head 128; docs/design.md §6",
            "expert_bytes": "docs/design.md §6: Q4_K_M DeepSeek-V2-Lite, gate+up Q4_K (4.5 bpw, 3.24 MB) + ffn_down "
                            "legacy fallback (Q8_0, 8.5 bpw, 3.06 MB) = 6.31 MB, the top of the 5.2-6.3 MB range; read "
                            "the real sizes from the GGUF when one is at hand",
            "non_expert": "our arithmetic from the config (MLA attention 13.8 M + 2 shared experts 17.3 M + router "
                          "0.13 M params per MoE layer), stored at the experts' bytes per parameter (assumption)",
        },
    )


MODEL_FACTS = {"deepseek-v2-lite": _dsv2_lite()}


@dataclass
class RoutingTrace:
    """A routing trace in memory.

    ``expert_ids``: int16 ``[tokens, moe_layers, top_k]``; ``prompt_offsets``: int64 ``[prompts + 1]``;
    ``expert_bytes``: float64 ``[moe_layers]``; ``router_scores``: None or float32 ``[tokens, moe_layers, E]``.
    """

    expert_ids: np.ndarray
    prompt_offsets: np.ndarray
    num_experts: int
    top_k: int
    expert_bytes: np.ndarray
    n_dense_layers: int = 0
    moe_layer_ids: Optional[np.ndarray] = None
    router_scores: Optional[np.ndarray] = None
    model: str = ""
    format_version: int = FORMAT_VERSION
    path: str = ""

    @property
    def n_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.expert_ids.shape[1])

    @property
    def n_prompts(self) -> int:
        return int(len(self.prompt_offsets) - 1)

    @property
    def has_scores(self) -> bool:
        return self.router_scores is not None

    def validate(self) -> None:
        """Checks shapes, id ranges and offsets; raises ValueError naming the first problem."""
        ids = self.expert_ids
        if ids.ndim != 3:
            raise ValueError(f"trace expert_ids must be 3-D [tokens, moe_layers, top_k], got shape {ids.shape}")
        if ids.shape[2] != self.top_k:
            raise ValueError(f"trace expert_ids last dimension {ids.shape[2]} != top_k {self.top_k}")
        if not (1 <= self.top_k <= self.num_experts):
            raise ValueError(f"trace top_k {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_experts:
                bad = lo if lo < 0 else hi
                raise ValueError(f"trace expert id {bad} is outside 0..{self.num_experts - 1}")
        off = self.prompt_offsets
        if off.ndim != 1 or len(off) < 2 or off[0] != 0 or off[-1] != ids.shape[0] or np.any(np.diff(off) < 0):
            raise ValueError(f"trace prompt_offsets must be non-decreasing from 0 to the token count "
                             f"({ids.shape[0]}); got {len(off)} offsets ending at {off[-1] if len(off) else None}")
        if self.expert_bytes.shape != (ids.shape[1],) or np.any(~np.isfinite(self.expert_bytes)) \
                or np.any(self.expert_bytes <= 0):
            raise ValueError(f"trace expert_bytes must hold one positive value per MoE layer ({ids.shape[1]}), "
                             f"got shape {self.expert_bytes.shape}")
        if self.moe_layer_ids is not None and len(self.moe_layer_ids) != ids.shape[1]:
            raise ValueError(f"trace moe_layer_ids has {len(self.moe_layer_ids)} entries for {ids.shape[1]} "
                             "MoE layers")
        if self.router_scores is not None and self.router_scores.shape != (ids.shape[0], ids.shape[1],
                                                                           self.num_experts):
            raise ValueError(f"trace router_scores shape {self.router_scores.shape} != "
                             f"{(ids.shape[0], ids.shape[1], self.num_experts)}")

    def facts(self) -> Optional[ModelFacts]:
        """Model facts for this trace's model, or None when unknown."""
        return MODEL_FACTS.get(self.model)

    def to_core(self):
        """The C++ ``_core.Trace`` (validated again there, including repeated ids within a row)."""
        from hybrimoe import _core

        return _core.Trace(self.expert_ids.astype(np.int16, copy=False), self.prompt_offsets.astype(np.int64),
                           [float(b) for b in self.expert_bytes], int(self.num_experts), int(self.n_dense_layers),
                           None if self.router_scores is None else self.router_scores.astype(np.float32))

    def save(self, path: str | os.PathLike) -> None:
        """Writes format version 1 (see the module docstring)."""
        self.validate()
        arrays = dict(format=np.array(FORMAT), format_version=np.array(FORMAT_VERSION),
                      expert_ids=self.expert_ids.astype(np.int16 if self.num_experts > 127 else np.int8),
                      prompt_offsets=self.prompt_offsets.astype(np.int64), num_experts=np.array(self.num_experts),
                      top_k=np.array(self.top_k), expert_bytes=self.expert_bytes.astype(np.float64),
                      n_dense_layers=np.array(self.n_dense_layers), model=np.array(self.model),
                      moe_layer_ids=(self.moe_layer_ids if self.moe_layer_ids is not None
                                     else np.arange(self.n_dense_layers, self.n_dense_layers + self.n_layers)))
        if self.router_scores is not None:
            arrays["router_scores"] = self.router_scores.astype(np.float16)
        np.savez_compressed(path, **arrays)


def default_trace_path() -> Path:
    """Where the DeepSeek-V2-Lite development trace is (docs/design.md §12): ``$HYBRIMOE_TRACE``, else the
    default relative path ``shared/traces/dsv2lite_dev.npz``, looked up beside the source tree and in the current
    directory and its parents (an installed package is not in the checkout). Returns the first that exists, or the
    one beside the current directory."""
    env = os.environ.get("HYBRIMOE_TRACE")
    if env:
        return Path(env)
    rel = Path("shared") / "traces" / "dsv2lite_dev.npz"
    cwd = Path.cwd()
    candidates = [REPO_ROOT.parent / rel] + [d / rel for d in (cwd, *cwd.parents)]
    for c in candidates:
        if c.is_file():
            return c
    return cwd.parent / rel


def _guess_model(num_experts: int, top_k: int, n_layers: int) -> str:
    for name, f in MODEL_FACTS.items():
        if (f.n_experts, f.top_k, f.n_moe_layers) == (num_experts, top_k, n_layers):
            return name
    return ""


def load_trace(path: str | os.PathLike, model: Optional[str] = None) -> RoutingTrace:
    """Loads a trace (.npz, version 0 or 1) and validates it.

    ``model`` names an entry of :data:`MODEL_FACTS` for files without ``expert_bytes`` (version 0); by default the
    model is recognised from (experts, top_k, MoE layers). Raises FileNotFoundError for a missing file and
    ValueError for an unknown model, a newer format version, missing fields or inconsistent shapes.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as e:  # zipfile/npz errors come in many types
        raise ValueError(f"{path} is not a readable .npz trace: {e}") from e
    with z:
        names = set(z.files)
        for need in ("expert_ids", "prompt_offsets", "num_experts", "top_k"):
            if need not in names:
                raise ValueError(f"trace {path} lacks the field '{need}'")
        version = int(z["format_version"]) if "format_version" in names else 0
        if version > FORMAT_VERSION:
            raise ValueError(f"trace {path} has format version {version}; this hybrimoe reads up to "
                             f"{FORMAT_VERSION}")
        ids = z["expert_ids"]
        num_experts, top_k = int(z["num_experts"]), int(z["top_k"])
        if ids.ndim != 3:
            raise ValueError(f"trace expert_ids must be 3-D [tokens, moe_layers, top_k], got shape {ids.shape}")
        name = model or (str(z["model"]) if "model" in names else "") or _guess_model(num_experts, top_k,
                                                                                        ids.shape[1])
        if model is not None and model not in MODEL_FACTS:
            raise ValueError(f"unknown model '{model}' (known: {', '.join(sorted(MODEL_FACTS))})")
        facts = MODEL_FACTS.get(name)
        if "expert_bytes" in names:
            expert_bytes = z["expert_bytes"].astype(np.float64)
        elif facts is not None:
            expert_bytes = np.full(ids.shape[1], facts.expert_bytes)
        else:
            raise ValueError(f"trace {path} has no expert_bytes and its model is unknown; pass model= one of "
                             f"{', '.join(sorted(MODEL_FACTS))}")
        if "n_dense_layers" in names:
            n_dense = int(z["n_dense_layers"])
        elif "moe_layer_ids" in names:
            n_dense = int(np.min(z["moe_layer_ids"]))
        else:
            n_dense = facts.n_dense_layers if facts else 0
        tr = RoutingTrace(
            expert_ids=ids if ids.dtype == np.int16 else ids.astype(np.int16),
            prompt_offsets=z["prompt_offsets"].astype(np.int64), num_experts=num_experts, top_k=top_k,
            expert_bytes=expert_bytes, n_dense_layers=n_dense,
            moe_layer_ids=z["moe_layer_ids"] if "moe_layer_ids" in names else None,
            router_scores=z["router_scores"].astype(np.float32) if "router_scores" in names else None,
            model=name, format_version=version, path=str(path))
    tr.validate()
    return tr
