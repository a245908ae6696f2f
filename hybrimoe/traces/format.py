"""Routing traces: a versioned ``.npz`` format, its loader and checks.

Format ``hybrimoe.trace`` version 2 (one ``.npz`` file; version 1 files lack the last six fields and still load):

================== ============================== =====================================================
field              shape / dtype                  meaning
================== ============================== =====================================================
``format``         str                            ``"hybrimoe.trace"``
``format_version`` int                            2
``expert_ids``     ``[tokens, moe_layers, top_k]`` routed expert ids, int8/int16; each row is a *set*
``prompt_offsets`` ``[prompts + 1]`` int64         prompt i covers tokens ``[off[i], off[i+1])``
``num_experts``    int                            routed experts per MoE layer
``top_k``          int                            experts per token
``moe_layer_ids``  ``[moe_layers]`` int            model layer index of each MoE layer
``expert_bytes``   ``[moe_layers]`` float64        bytes of one routed expert per MoE layer
``n_dense_layers`` int                            dense (non-MoE) layers
``model``          str                            model name (selects :data:`MODEL_FACTS` when no facts are carried)
``router_scores``  ``[tokens, moe_layers, E]``    optional router scores over all experts, float16 (float32 in
                                                  memory): after the gating function, before any selection bias
                                                  (for ``softmax_weight``, the raw logits)
``phases``         ``[tokens]`` int8               v2, optional: :data:`PHASE_PREFILL` 0 or :data:`PHASE_DECODE` 1
``gating``         str                            v2: the router's gating function, one of
                                                  :data:`hybrimoe.model.tables.GATINGS` (``""``: unknown)
``selection_bias`` ``[moe_layers, E]`` float32     v2, optional: added to the scores for the choice of experts only
                                                  (DeepSeek-V3's ``exp_probs_b``)
``partial``        bool                           v2: the recording was interrupted (its last prompt may be cut)
``model_facts``    str (JSON)                     v2, optional: :meth:`ModelFacts.to_dict` of the recorded model
``synthetic``      str (JSON)                     v2, optional: present only in a generated trace
                                                  (:func:`hybrimoe.traces.synthetic.synthetic_trace`): generator, shape,
                                                  seed, knobs, and the router-score model, an assumption
================== ============================== =====================================================

Files without ``format`` (such as the DeepSeek-V2-Lite development trace, a file given with ``--trace`` /
``$HYBRIMOE_TRACE``, docs/design.md §12: ids, offsets, ``moe_layer_ids``, ``num_experts``, ``top_k``, no scores)
load as version 0; their model facts come from :data:`MODEL_FACTS` (``model=`` or recognised by shape). Without
router scores, score-based policies (MRS) fall back to 1/top_k for each activated expert: say so in any result that
uses such a trace.

A token is *incomplete* when a row of it holds an id outside ``0..E-1`` (a recorder writes -1 for a layer it did
not reach), an id twice, or a score that is not finite. :func:`load_trace` refuses such a trace with one line naming
the first such token, its prompt and MoE layer (``check_tokens=False`` loads it), and
:meth:`RoutingTrace.drop_incomplete` removes those tokens.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import numpy as np

from hybrimoe import _core
from hybrimoe.envs import DEFAULT_TRACE, trace_override
from hybrimoe.model.facts import MODEL_FACTS, ModelFacts
from hybrimoe.model.tables import GATINGS
from hybrimoe.outputs import atomic_open

FORMAT = "hybrimoe.trace"
FORMAT_VERSION = 2
#: the folder of the source tree (the checkout, when the package runs from it)
REPO_ROOT = Path(__file__).resolve().parents[2]
PHASE_PREFILL = 0
PHASE_DECODE = 1
#: the largest magnitude float16 holds (router scores are stored as float16)
_F16_MAX = float(np.finfo(np.float16).max)
_DROP_HINT = "simulate --drop-incomplete, or RoutingTrace.drop_incomplete(), drops such tokens"


@dataclass
class RoutingTrace:
    """A routing trace in memory.

    ``expert_ids``: int16 ``[tokens, moe_layers, top_k]``; ``prompt_offsets``: int64 ``[prompts + 1]``;
    ``expert_bytes``: float64 ``[moe_layers]`` (bytes of one routed expert); ``router_scores``: None or float32
    ``[tokens, moe_layers, E]``; ``phases``: None or int8 ``[tokens]`` (:data:`PHASE_PREFILL` /
    :data:`PHASE_DECODE`); ``gating``: one of :data:`hybrimoe.model.tables.GATINGS`; ``selection_bias``: None or float32
    ``[moe_layers, E]``; ``partial``: an interrupted recording; ``facts``: None or the :class:`ModelFacts` the
    file carries (:meth:`resolve_facts` falls back to :data:`MODEL_FACTS` by ``model``); ``synthetic``: None for
    recorded routing, else the dict :func:`hybrimoe.traces.synthetic.synthetic_trace` describes its generation with (its
    router scores are an assumption). ``format_version`` and ``path`` say where a loaded trace came from.
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
    phases: Optional[np.ndarray] = None
    gating: str = ""
    selection_bias: Optional[np.ndarray] = None
    partial: bool = False
    facts: Optional[ModelFacts] = None
    synthetic: Optional[dict] = None

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

    def _where(self) -> str:
        return f"trace {self.path}" if self.path else "trace"

    def validate(self, check_tokens: bool = True) -> None:
        """Checks shapes, offsets, the v2 fields and (``check_tokens``) every token; raises ValueError, one line
        naming the first problem (for a token: its index, prompt and MoE layer, see :meth:`incomplete_tokens`)."""
        w = self._where()
        ids = self.expert_ids
        if ids.ndim != 3:
            raise ValueError(f"{w}: expert_ids must be 3-D [tokens, moe_layers, top_k], got shape {ids.shape}")
        T, L, K = ids.shape
        if K != self.top_k:
            raise ValueError(f"{w}: expert_ids last dimension {K} != top_k {self.top_k}")
        if not (1 <= self.top_k <= self.num_experts):
            raise ValueError(f"{w}: top_k {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{w}: expert_ids must be integers, got {ids.dtype}")
        off = self.prompt_offsets
        if off.ndim != 1 or len(off) < 2 or off[0] != 0 or off[-1] != T or np.any(np.diff(off) < 0):
            raise ValueError(f"{w}: prompt_offsets must be non-decreasing from 0 to the token count ({T}); got "
                             f"{len(off)} offsets ending at {off[-1] if len(off) else None}")
        eb = np.asarray(self.expert_bytes)
        if eb.shape != (L,) or np.any(~np.isfinite(eb)) or np.any(eb <= 0):
            raise ValueError(f"{w}: expert_bytes must hold one positive value per MoE layer ({L}), got shape "
                             f"{eb.shape}")
        if self.moe_layer_ids is not None and len(self.moe_layer_ids) != L:
            raise ValueError(f"{w}: moe_layer_ids has {len(self.moe_layer_ids)} entries for {L} MoE layers")
        E = self.num_experts
        if self.router_scores is not None and self.router_scores.shape != (T, L, E):
            raise ValueError(f"{w}: router_scores shape {self.router_scores.shape} != {(T, L, E)}")
        if self.phases is not None:
            ph = np.asarray(self.phases)
            if ph.shape != (T,) or not np.issubdtype(ph.dtype, np.integer):
                raise ValueError(f"{w}: phases must be integers [tokens] ({T}), got shape {ph.shape} ({ph.dtype})")
            bad = np.flatnonzero((ph != PHASE_PREFILL) & (ph != PHASE_DECODE))
            if bad.size:
                raise ValueError(f"{w}: phase {int(ph[bad[0]])} at token {int(bad[0])} (prompt "
                                 f"{self.prompt_of(int(bad[0]))}) is neither {PHASE_PREFILL} (prefill) nor "
                                 f"{PHASE_DECODE} (decode)")
        if self.gating not in GATINGS:
            raise ValueError(f"{w}: gating {self.gating!r} is not one of {', '.join(repr(g) for g in GATINGS)}")
        if self.selection_bias is not None:
            sb = np.asarray(self.selection_bias)
            if sb.shape != (L, E) or not np.all(np.isfinite(sb)):
                raise ValueError(f"{w}: selection_bias must be finite [moe_layers, experts] {(L, E)}, got shape "
                                 f"{sb.shape}")
        if not isinstance(self.partial, (bool, np.bool_)):
            raise ValueError(f"{w}: partial must be a bool, got {type(self.partial).__name__}")
        if self.facts is not None:
            if not isinstance(self.facts, ModelFacts):
                raise ValueError(f"{w}: facts must be a ModelFacts, got {type(self.facts).__name__}")
            self.facts.validate(f"{w}: model facts")
            self.check_shape(self.facts, "its model facts")
        if self.synthetic is not None and not isinstance(self.synthetic, dict):
            raise ValueError(f"{w}: synthetic must be None or a dict, got {type(self.synthetic).__name__}")
        if check_tokens:
            self._check_tokens()

    def check_shape(self, facts: ModelFacts, what: str) -> None:
        """Raises ValueError giving both shapes when ``facts`` (of ``what``, e.g. a GGUF path) has another
        (MoE layers, experts, top-k) than this trace."""
        mine = (self.n_layers, self.num_experts, self.top_k)
        theirs = (facts.n_moe_layers, facts.n_experts, facts.top_k)
        if mine != theirs:
            raise ValueError(f"{self._where()} has {mine[0]} MoE layers, {mine[1]} experts, top-{mine[2]}; {what} "
                             f"has {theirs[0]} MoE layers, {theirs[1]} experts, top-{theirs[2]}")

    def prompt_of(self, token: int) -> int:
        """The prompt that holds ``token`` (an index into the tokens)."""
        return int(np.searchsorted(self.prompt_offsets, token, side="right") - 1)

    def _problems(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """bool ``[tokens, moe_layers]`` each: an id outside 0..E-1, an id repeated in the row, a score not finite."""
        ids = self.expert_ids
        T, L, _ = ids.shape
        out_of_range = ((ids < 0) | (ids >= self.num_experts)).any(axis=2)
        s = np.sort(ids, axis=2)
        repeated = (s[:, :, 1:] == s[:, :, :-1]).any(axis=2)
        nonfinite = np.zeros((T, L), bool)
        if self.router_scores is not None:
            step = 4096  # tokens at a time: a bool copy of all scores would be as large as them
            for b in range(0, T, step):
                nonfinite[b:b + step] = ~np.isfinite(self.router_scores[b:b + step]).all(axis=2)
        return out_of_range, repeated, nonfinite

    def incomplete_tokens(self) -> np.ndarray:
        """bool ``[tokens]``: the tokens with an id outside 0..E-1 (e.g. -1 where a recorder did not reach a layer),
        a repeated id in a row, or a score that is not finite (NaN, inf), in any MoE layer."""
        a, b, c = self._problems()
        return (a | b | c).any(axis=1)

    def _check_tokens(self) -> None:
        problems = self._problems()
        bad = problems[0] | problems[1] | problems[2]
        if not bad.any():
            return
        t, layer = (int(x) for x in np.unravel_index(int(np.argmax(bad)), bad.shape))
        row = [int(x) for x in self.expert_ids[t, layer]]
        if problems[0][t, layer]:
            e = next(x for x in row if not 0 <= x < self.num_experts)
            what = f"expert id {e} is outside 0..{self.num_experts - 1}"
        elif problems[1][t, layer]:
            e = next(x for i, x in enumerate(row) if x in row[:i])
            what = f"expert {e} is repeated in the row {row}"
        else:
            sc = self.router_scores[t, layer]
            e = int(np.flatnonzero(~np.isfinite(sc))[0])
            what = f"the router score of expert {e} is {float(sc[e])}"
        n = int(bad.any(axis=1).sum())
        raise ValueError(f"{self._where()}: token {t} (prompt {self.prompt_of(t)}), MoE layer {layer}: {what}; {n} "
                         f"token(s) have such problems ({_DROP_HINT})")

    def select_tokens(self, keep: np.ndarray) -> "RoutingTrace":
        """A copy with only the tokens where ``keep`` (bool ``[tokens]``) is true: ids, scores and phases cut,
        prompt offsets moved (a prompt left without tokens stays, empty); the other fields as they are."""
        keep = np.asarray(keep, dtype=bool)
        if keep.shape != (self.n_tokens,):
            raise ValueError(f"select_tokens needs a bool mask of {self.n_tokens} tokens, got shape {keep.shape}")
        kept = np.concatenate([[0], np.cumsum(keep)]).astype(np.int64)
        return replace(self, expert_ids=self.expert_ids[keep], prompt_offsets=kept[self.prompt_offsets],
                       router_scores=None if self.router_scores is None else self.router_scores[keep],
                       phases=None if self.phases is None else np.asarray(self.phases)[keep])

    def drop_incomplete(self) -> tuple["RoutingTrace", int]:
        """(a copy without the incomplete tokens (:meth:`incomplete_tokens`), how many were dropped)."""
        bad = self.incomplete_tokens()
        return self.select_tokens(~bad), int(bad.sum())

    def resolve_facts(self) -> Optional[ModelFacts]:
        """The model facts this trace carries, else the :data:`MODEL_FACTS` entry of its model, else None."""
        return self.facts if self.facts is not None else MODEL_FACTS.get(self.model)

    def to_core(self):
        """The C++ ``_core.Trace`` (validated again there, including repeated ids within a row; the v2 fields other
        than the scores stay here)."""
        ids = self.expert_ids
        if ids.size and ids.dtype.itemsize > 2 and (int(ids.max()) > 32767 or int(ids.min()) < -32768):
            raise ValueError(f"{self._where()}: expert ids beyond the int16 range")
        return _core.Trace(ids.astype(np.int16, copy=False), self.prompt_offsets.astype(np.int64),
                           [float(b) for b in self.expert_bytes], int(self.num_experts), int(self.n_dense_layers),
                           # float32 scores go through as they are (_core.Trace copies them once; astype would
                           # copy them first)
                           None if self.router_scores is None else np.asarray(self.router_scores, np.float32))

    def save(self, path: str | os.PathLike) -> None:
        """Writes format version 2 (module docstring) to ``path`` exactly as named, atomically: into a temporary
        file in the same folder, then renamed over ``path``, so that ``path`` is either the old file or the
        whole new one (a failure leaves no temporary file behind). Incomplete tokens are written as they are (a
        recorder keeps what it reached); :func:`load_trace` then asks for ``check_tokens=False``.

        Raises:
            ValueError: the trace's structure is not valid (:meth:`validate` without the token checks), or a
                finite score beyond float16's range (it would be stored as inf).
            OSError: the folder is missing or not writable, or ``path`` is a directory.
        """
        self.validate(check_tokens=False)
        ids = self.expert_ids
        small = ids.size == 0 or (int(ids.min()) >= -128 and int(ids.max()) <= 127)
        arrays = dict(format=np.array(FORMAT), format_version=np.array(FORMAT_VERSION),
                      expert_ids=ids.astype(np.int8 if small else np.int16),
                      prompt_offsets=self.prompt_offsets.astype(np.int64), num_experts=np.array(self.num_experts),
                      top_k=np.array(self.top_k), expert_bytes=np.asarray(self.expert_bytes, np.float64),
                      n_dense_layers=np.array(self.n_dense_layers), model=np.array(self.model),
                      moe_layer_ids=(np.asarray(self.moe_layer_ids, np.int64) if self.moe_layer_ids is not None
                                     else np.arange(self.n_dense_layers, self.n_dense_layers + self.n_layers)),
                      gating=np.array(self.gating), partial=np.array(bool(self.partial)))
        if self.router_scores is not None:
            sc = self.router_scores
            big = np.isfinite(sc) & (np.abs(sc) > _F16_MAX)
            if big.any():
                t, layer, e = (int(x) for x in np.argwhere(big)[0])
                raise ValueError(f"{self._where()}: the router score {float(sc[t, layer, e])} of expert {e} at token "
                                 f"{t}, MoE layer {layer} is beyond float16's range (+-{_F16_MAX:.0f}), the stored "
                                 "type")
            arrays["router_scores"] = sc.astype(np.float16)
        if self.phases is not None:
            arrays["phases"] = np.asarray(self.phases).astype(np.int8)
        if self.selection_bias is not None:
            arrays["selection_bias"] = np.asarray(self.selection_bias, np.float32)
        if self.facts is not None:
            arrays["model_facts"] = np.array(json.dumps(self.facts.to_dict(), allow_nan=False))
        if self.synthetic is not None:
            arrays["synthetic"] = np.array(json.dumps(self.synthetic, allow_nan=False))
        _write_atomically(Path(path), arrays)


def _write_atomically(path: Path, arrays: dict) -> None:
    """``np.savez_compressed(path, **arrays)`` through a temporary file beside ``path`` and os.replace; the file
    gets the mode a new file would get (or the replaced file's)."""
    with atomic_open(path, "wb") as fh:
        np.savez_compressed(fh, **arrays)


def default_trace_path(start: Optional[Path] = None) -> Path:
    """Where the DeepSeek-V2-Lite development trace is (docs/design.md §12): ``$HYBRIMOE_TRACE``, else the
    default relative path ``shared/traces/dsv2lite_dev.npz``, looked up beside the source tree and in ``start``
    and its parents (an installed package is not in the checkout). Returns the first that exists, or the one beside
    ``start``. ``start``: the folder to look from (default: the current directory; the test suite gives the
    folder pytest started in, since its fixtures move the working directory out of the checkout)."""
    env = trace_override()
    if env is not None:
        return env
    rel = DEFAULT_TRACE
    start = Path.cwd() if start is None else Path(start).resolve()
    candidates = [REPO_ROOT.parent / rel] + [d / rel for d in (start, *start.parents)]
    for c in candidates:
        if c.is_file():
            return c
    return start.parent / rel


def _guess_model(num_experts: int, top_k: int, n_layers: int) -> str:
    for name, f in MODEL_FACTS.items():
        if (f.n_experts, f.top_k, f.n_moe_layers) == (num_experts, top_k, n_layers):
            return name
    return ""


def _facts_field(z, path) -> Optional[ModelFacts]:
    """The ModelFacts of a file's ``model_facts`` JSON field, None when absent; ValueError naming the file."""
    if "model_facts" not in z.files:
        return None
    where = f"trace {path}: model_facts"
    try:
        doc = json.loads(str(z["model_facts"]))
    except ValueError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None
    return ModelFacts.from_dict(doc, where)


def _synthetic_field(z, path) -> Optional[dict]:
    """The dict of a generated trace's ``synthetic`` JSON field, None when absent; ValueError naming the file."""
    if "synthetic" not in z.files:
        return None
    try:
        doc = json.loads(str(z["synthetic"]))
    except ValueError as e:
        raise ValueError(f"trace {path}: synthetic is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"trace {path}: synthetic must be a JSON object, got {type(doc).__name__}")
    return doc


def _as_int(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as ``dtype`` when it is an integer array whose values all fit, else as it is (so that the checks see
    the stored values, not wrapped ones)."""
    if not np.issubdtype(a.dtype, np.integer):
        return a
    info = np.iinfo(dtype)
    if a.size and (int(a.min()) < info.min or int(a.max()) > info.max):
        return a
    return a.astype(dtype, copy=False)


def load_trace(path: str | os.PathLike, model: Optional[str] = None, *, facts: Optional[ModelFacts] = None,
               check_tokens: bool = True) -> RoutingTrace:
    """Loads a trace (.npz, version 0, 1 or 2) and validates it.

    ``model`` names an entry of :data:`MODEL_FACTS` (the trace's ``model`` then). Files without ``expert_bytes``
    (version 0) take them from ``facts`` (e.g. :func:`hybrimoe.model.facts.facts_from_gguf`), else from ``model``'s
    entry, else from the facts the file carries, else from the entry recognised by (experts, top_k, MoE layers).
    ``check_tokens=False`` leaves incomplete tokens (ids outside 0..E-1, repeated ids, scores not finite) in, for
    :meth:`RoutingTrace.drop_incomplete`.

    Raises:
        FileNotFoundError: a missing file.
        ValueError: not a readable .npz, an unknown model, a newer format version, missing fields, inconsistent
            shapes, bad carried model facts, or (``check_tokens``) an incomplete token: one line each, naming the
            token, its prompt and MoE layer for the last.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic not in (b"PK\x03\x04", b"PK\x05\x06"):  # a .npz is a zip archive
        raise ValueError(f"{path} is not a .npz trace (not a zip archive: it starts with {magic!r})")
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as e:  # zipfile/npz errors come in many types
        raise ValueError(f"{path} is not a readable .npz trace: {e}") from e
    with z:
        try:
            tr = _read_fields(z, path, model, facts)
        except ValueError:
            raise
        except Exception as e:  # a damaged member (bad CRC, truncated data) surfaces only when it is read
            raise ValueError(f"trace {path} is damaged: {type(e).__name__}: {e}") from None
    tr.validate(check_tokens=check_tokens)
    return tr


def _scalar(z, key: str, path, cast):
    """Field ``key`` of an open npz as one ``cast`` value; ValueError naming the file and field otherwise."""
    v = z[key]
    if v.ndim != 0:
        raise ValueError(f"trace {path}: field '{key}' must be a single value, got shape {v.shape}")
    try:
        return cast(v)
    except (TypeError, ValueError):
        raise ValueError(f"trace {path}: field '{key}' is not a {cast.__name__} ({v.dtype})") from None


def _read_fields(z, path, model, facts) -> RoutingTrace:
    """The RoutingTrace of an open npz (see :func:`load_trace`), not yet validated."""
    names = set(z.files)
    for need in ("expert_ids", "prompt_offsets", "num_experts", "top_k"):
        if need not in names:
            raise ValueError(f"trace {path} lacks the field '{need}'")
    version = _scalar(z, "format_version", path, int) if "format_version" in names else 0
    if version > FORMAT_VERSION:
        raise ValueError(f"trace {path} has format version {version}; this hybrimoe reads up to "
                         f"{FORMAT_VERSION}")
    ids = z["expert_ids"]
    num_experts, top_k = _scalar(z, "num_experts", path, int), _scalar(z, "top_k", path, int)
    if ids.ndim != 3:
        raise ValueError(f"trace {path}: expert_ids must be 3-D [tokens, moe_layers, top_k], got shape "
                         f"{ids.shape}")
    if model is not None and model not in MODEL_FACTS:
        raise ValueError(f"unknown model '{model}' (known: {', '.join(sorted(MODEL_FACTS))})")
    carried = _facts_field(z, path)
    name = model or (_scalar(z, "model", path, str) if "model" in names else "") or \
        (carried.name if carried is not None else _guess_model(num_experts, top_k, ids.shape[1]))
    if facts is None:
        facts = MODEL_FACTS[model] if model is not None else (carried or MODEL_FACTS.get(name))
    if "expert_bytes" in names:
        expert_bytes = z["expert_bytes"].astype(np.float64)
    elif facts is not None:
        expert_bytes = facts.per_layer_expert_bytes() if facts.n_moe_layers == ids.shape[1] else \
            np.full(ids.shape[1], facts.expert_bytes)
    else:
        raise ValueError(f"trace {path} has no expert_bytes and its model is unknown: give its GGUF (simulate -m, "
                         f"facts=facts_from_gguf(...)) or built-in facts (--model-facts, model=: "
                         f"{', '.join(sorted(MODEL_FACTS))})")
    if "n_dense_layers" in names:
        n_dense = _scalar(z, "n_dense_layers", path, int)
    elif "moe_layer_ids" in names:
        n_dense = int(np.min(z["moe_layer_ids"]))
    else:
        n_dense = facts.n_dense_layers if facts else 0
    tr = RoutingTrace(
        expert_ids=_as_int(ids, np.int16),
        prompt_offsets=z["prompt_offsets"].astype(np.int64), num_experts=num_experts, top_k=top_k,
        expert_bytes=expert_bytes, n_dense_layers=n_dense,
        moe_layer_ids=z["moe_layer_ids"] if "moe_layer_ids" in names else None,
        router_scores=z["router_scores"].astype(np.float32) if "router_scores" in names else None,
        model=name, format_version=version, path=str(path),
        phases=_as_int(z["phases"], np.int8) if "phases" in names else None,
        gating=_scalar(z, "gating", path, str) if "gating" in names else "",
        selection_bias=z["selection_bias"].astype(np.float32) if "selection_bias" in names else None,
        partial=_scalar(z, "partial", path, bool) if "partial" in names else False, facts=carried,
        synthetic=_synthetic_field(z, path))
    return tr
