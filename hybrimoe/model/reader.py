"""The one reader of GGUF files: validation (:func:`open_gguf`, :func:`check_gguf`) and the MoE structure of a model
(:func:`describe`), read with the ``gguf`` package.

Bytes are real tensor sizes in the file (``ReaderTensor.n_bytes``, i.e. ggml row size x rows for the tensor's type);
bytes per expert are a routed expert tensor's bytes divided by its expert count (ne2). Every other module that needs
a GGUF's contents goes through :class:`GGUFFile` (one validated, memory-mapped reader per file).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Union

import gguf

from hybrimoe.model.tables import (
    ACTIVATION_NAMES,
    ARCH_ACTIVATION,
    ARCH_GATING,
    BLOCK_RE,
    CLAMP_ARCHS,
    CLAMP_FUSED,
    EXPERT_TENSOR_RE,
    EXPS_REGEX,
    GATING_FUNCS,
    WEIGHT_BEFORE_FFN_ARCHS,
)

PathLike = Union[str, os.PathLike]


#: llama.cpp's shard file name: ``<prefix>-<no, from 1>-of-<count>.gguf`` (llama_split_path in llama.cpp's llama.cpp)
SHARD_NAME_FORMAT = "{}-{:05d}-of-{:05d}.gguf"


@dataclass(frozen=True)
class GGUFFile:
    """A validated GGUF model: ``path`` (the file given: a split model's first shard), ``size`` (bytes, all shards
    together) and the ``gguf`` package's ``reader`` (memory-mapped) of that file, whose metadata is the model's.
    A split model (``split.count`` > 1, as llama.cpp's gguf-split and ``convert_hf_to_gguf.py --split-max-*``
    write it) also has ``shards``: every shard's ``(path, reader)``, the first included, in ``split.no`` order
    (empty for a single file)."""

    path: Path
    size: int
    reader: gguf.GGUFReader = field(repr=False)
    shards: tuple = field(default=(), repr=False)

    def field(self, key: str, default=None):
        """The value of metadata key ``key``, or ``default`` when absent or malformed."""
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception:  # a malformed field reads as absent
            return default

    @property
    def files(self) -> list:
        """The model's files: ``[path]``, or every shard's path of a split model in ``split.no`` order."""
        return [p for p, _ in self.shards] if self.shards else [self.path]

    @cached_property
    def all_tensors(self) -> list:
        """Every tensor of the model (``gguf`` ReaderTensor; offsets are within its own shard), shard by shard."""
        return [t for _, r in (self.shards or ((self.path, self.reader),)) for t in r.tensors]

    @cached_property
    def tensors(self) -> dict:
        """``{name: gguf ReaderTensor}`` of every tensor of the model (every shard's)."""
        return {t.name: t for t in self.all_tensors}

    @cached_property
    def tensor_shard(self) -> dict:
        """``{name: (shard path, absolute data offset in that file)}`` of every tensor of the model."""
        return {t.name: (p, int(t.data_offset)) for p, r in (self.shards or ((self.path, self.reader),))
                for t in r.tensors}


def _split_field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return int(f.contents())
    except Exception:
        return None


def _shard_paths(p: Path, reader) -> list[Path]:
    """The shard files of a split model whose first shard is ``p`` (llama.cpp's naming: llama_split_prefix and
    llama_split_path), or ``[p]`` for a single file."""
    count = _split_field(reader, gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
    if count is None or count <= 1:
        return [p]
    no = _split_field(reader, gguf.Keys.Split.LLM_KV_SPLIT_NO) or 0
    if no != 0:
        raise ValueError(f"{p}: shard {no + 1} of a model split in {count} files; give the first shard "
                         f"(its name ends in -00001-of-{count:05d}.gguf)")
    suffix = f"-00001-of-{count:05d}.gguf"
    if not p.name.endswith(suffix):
        raise ValueError(f"{p}: the first shard of a model split in {count} files, but its name does not end in "
                         f"{suffix!r}, so llama.cpp cannot find the other shards; rename it as gguf-split names it")
    prefix = p.name[: -len(suffix)]
    return [p.with_name(SHARD_NAME_FORMAT.format(prefix, i + 1, count)) for i in range(count)]


def open_gguf(path: PathLike) -> GGUFFile:
    """Opens and validates a GGUF model: the file exists, is a regular readable file, starts with the GGUF magic,
    its header parses, and no tensor's data ends past the end of the file. A split model (``split.count`` > 1) is
    opened by its first shard (``<prefix>-00001-of-<N>.gguf``, as llama.cpp loads it) and every shard is checked
    the same way, and for its ``split.no`` and the model's tensor count (``split.tensors.count``).

    Raises:
        FileNotFoundError: no such file, or a shard of a split model is missing (named).
        ValueError: not a regular file, unreadable, not a GGUF file, or truncated or corrupt (names the file and
            the tensor that ends past its end); a later shard given instead of the first; a shard of another
            split; tensors missing from the shards.
    """
    first = _open_one(Path(os.fspath(path)))
    paths = _shard_paths(first.path, first.reader)
    if len(paths) == 1:
        return first
    shards = [(first.path, first.reader)]
    size = first.size
    for i, sp in enumerate(paths[1:], start=1):
        if not sp.exists():
            raise FileNotFoundError(f"{sp}: no such file (shard {i + 1} of {len(paths)} of the model {first.path})")
        one = _open_one(sp)
        no = _split_field(one.reader, gguf.Keys.Split.LLM_KV_SPLIT_NO)
        count = _split_field(one.reader, gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
        if count != len(paths):
            raise ValueError(f"{sp}: split.count is {count}, but {first.path} is split in {len(paths)} files: a shard "
                             "of another split")
        if no != i:
            raise ValueError(f"{sp}: split.no is {no}, expected {i} (shard {i + 1} of {len(paths)} of {first.path})")
        shards.append((sp, one.reader))
        size += one.size
    expected = _split_field(first.reader, gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    have = sum(len(r.tensors) for _, r in shards)
    if expected is not None and have != expected:
        raise ValueError(f"{first.path}: the model's {len(paths)} shards hold {have} tensors, its split.tensors.count "
                         f"says {expected}")
    return GGUFFile(path=first.path, size=size, reader=first.reader, shards=tuple(shards))


def _open_one(p: Path) -> GGUFFile:
    """One GGUF file, validated as :func:`open_gguf` says (its shards, if any, not opened)."""
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file (GGUF model file not found)")
    if not p.is_file():
        raise ValueError(f"{p}: not a regular file")
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise ValueError(f"{p}: cannot read the model file: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ValueError(f"{p}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # a truncated header surfaces as assorted numpy, struct and value errors
        raise ValueError(f"{p}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ValueError(f"{p}: truncated GGUF file: tensor {t.name} ends at byte {end} but the file has {size}")
    return GGUFFile(path=p, size=size, reader=reader, shards=())


def check_gguf(path: PathLike) -> None:
    """Fails early, with the problem named, on a path that is not a complete GGUF file (:func:`open_gguf`).

    Raises:
        FileNotFoundError, ValueError: as :func:`open_gguf`.
    """
    open_gguf(path)


def _as_gguf(src: Union[PathLike, GGUFFile]) -> GGUFFile:
    return src if isinstance(src, GGUFFile) else open_gguf(src)


def _layer_part(kind: str) -> str:
    """The part of a block tensor (its name after ``blk.N.``, e.g. ``attn_q.weight``): one of LAYER_PARTS."""
    if "norm" in kind:
        return "norms"
    stem = kind.rsplit(".", 1)[0]
    if stem.endswith("_shexp"):
        return "shared_experts"
    if stem in ("ffn_gate_inp", "exp_probs_b"):
        return "router"
    if stem.startswith("attn"):
        return "attention"
    if stem in ("ffn_gate", "ffn_up", "ffn_down", "ffn_gate_up"):
        return "dense_ffn"
    return "other"


def _count(v):
    """A head count as stored: an int, or per layer an array (its largest value); None when absent or not a
    number."""
    try:
        if isinstance(v, (list, tuple)):
            return max((int(x) for x in v), default=None)
        return None if v is None or isinstance(v, str) else int(v)
    except (TypeError, ValueError):
        return None


def expert_gating(arch: str, raw, n_layer: int, n_vocab) -> tuple[str, str]:
    """(gating function name, where it came from) of a MoE model's router.

    ``raw``: the value of ``<arch>.expert_gating_func`` or None (absent; 0, upstream's NONE, reads as absent).
    Names: ``"softmax"``, ``"sigmoid"``, ``"softmax_weight"`` (softmax over the selected experts' logits, gpt-oss),
    ``"sqrt_softplus"``, or ``""`` for a value this hybrimoe does not know. Absent: deepseek2 follows upstream's
    loader (src/models/deepseek2.cpp: sigmoid for GLM 4.7 Lite, 47 or 48 layers and 154880 tokens, else softmax),
    gpt-oss and llama4 the function their graph passes to build_moe_ffn, every other architecture softmax.
    """
    key = f"{arch}.expert_gating_func"
    if isinstance(raw, int) and not isinstance(raw, bool) and raw != 0:
        if raw not in GATING_FUNCS:
            return "", f"GGUF key {key} = {raw}, a value this hybrimoe does not know"
        return GATING_FUNCS[raw], f"GGUF key {key} = {raw}"
    if raw is not None and not isinstance(raw, int):
        return "", f"GGUF key {key} is not an integer"
    if arch == "deepseek2" and n_layer in (47, 48) and n_vocab == 154880:
        return "sigmoid", (f"{key} absent: upstream's deepseek2 loader takes 47/48 layers and 154880 tokens "
                           "for GLM 4.7 Lite, sigmoid")
    name = ARCH_GATING.get(arch, "softmax")
    return name, f"{key} absent: {name}, the gating upstream's {arch} graph uses"


def _variant_problem(have: set, act: str, gated: bool, fused: bool, biases: dict, scales: dict, il: int,
                     b: list, sc: list) -> str:
    """Why the engine cannot run a layer of this variant ("" when it can)."""
    if "down" not in have or not ("up" in have or fused):
        return "no up and down expert matrices"
    if fused and ("gate" in have or "up" in have):
        return "both fused gate_up and separate gate/up matrices"
    if act == "relu_sqr" and gated:
        return "gated squared ReLU (upstream aborts on it)"
    if act in ("swiglu_oai", "situ") and not gated:
        return f"{act} without a gate"
    if any(biases[k]["layers"][il]["type"] != "F32" for k in b):
        return "expert biases that are not F32"
    if any(scales[k]["layers"][il]["type"] != "F32" for k in sc):
        return "per-expert scales that are not F32"
    return ""


def expert_variant(arch: str, il: int, kinds: dict, biases: dict, scales: dict, clamp=None) -> dict:
    """What upstream's build_moe_ffn builds for MoE layer ``il`` (from the file's tensors and the architecture) and
    whether hybrimoe's engine runs it (its build_expert_ffn mirrors every variant below; a layer it does not run stays
    on upstream's path, as the MoE hook's unsupported reason says at run time).

    Returns ``{"activation", "gated", "fused_gate_up", "biases" (kinds), "scales" (kinds), "clamp" (the layer's
    swiglu_clamp_exp or 0), "clamp_form" ("swiglu_clamp", "clamp_silu_mul" or ""), "weight_before_ffn",
    "name" (one line), "engine" (bool), "why" ("" when the engine runs it)}``. LoRA adapters, which also keep a
    layer on upstream's path, are a property of the context, not of the file.
    """
    have = {k for k, v in kinds.items() if il in v["layers"]}
    b = sorted(k for k, v in biases.items() if il in v["layers"])
    sc = sorted(k for k, v in scales.items() if il in v["layers"])
    act = ARCH_ACTIVATION.get(arch, "silu")
    fused = "gate_up" in have
    gated = fused or "gate" in have
    lim = 0.0
    if clamp is not None and act == "silu" and "gate" in have:
        try:
            lim = float(clamp[il] if isinstance(clamp, (list, tuple)) else clamp)
        except (TypeError, ValueError, IndexError):
            lim = 0.0
    form = ("swiglu_clamp" if arch in CLAMP_FUSED else "clamp_silu_mul") if lim > 1e-6 else ""
    before = arch in WEIGHT_BEFORE_FFN_ARCHS
    why = _variant_problem(have, act, gated, fused, biases, scales, il, b, sc)
    parts = [ACTIVATION_NAMES[act] + ("-GLU" if gated and act not in ("swiglu_oai", "situ") else "")]
    if fused:
        parts.append("fused gate_up")
    if b:
        parts.append("biases " + "/".join(b))
    if sc:
        parts.append("scales " + "/".join(sc))
    if form:
        parts.append(f"clamp {lim:g} ({form})")
    if before:
        parts.append("weights before the FFN")
    return {"activation": act, "gated": gated, "fused_gate_up": fused, "biases": b, "scales": sc, "clamp": lim,
            "clamp_form": form, "weight_before_ffn": before, "name": ", ".join(parts), "engine": not why,
            "why": why}


@dataclass
class _Scan:
    """What one pass over a GGUF's tensors collects for :func:`describe`."""

    routed: int = 0
    other: int = 0
    kinds: dict = field(default_factory=dict)
    biases: dict = field(default_factory=dict)
    scales: dict = field(default_factory=dict)
    moe_layers: set = field(default_factory=set)
    all_layers: set = field(default_factory=set)
    types: dict = field(default_factory=dict)
    shared: dict = field(default_factory=lambda: {"ff": None, "gated": False, "present": False})
    parts: dict = field(default_factory=dict)
    n_expert_seen: int | None = None

    def expert_tensor(self, t, il: int, kind: str, what: str, tname: str, nb: int) -> None:
        """One ``blk.il.ffn_<kind>_exps.<what>`` tensor."""
        self.routed += nb
        self.moe_layers.add(il)
        shape = [int(x) for x in t.shape]
        if what == "scale":
            k = self.scales.setdefault(kind, {"types": [], "layers": {}})
            entry = {"type": tname, "bytes": nb, "n_expert": shape[0] if shape else 1}
        else:
            # weights [ne0, ne1, experts]; bias rows [ne0, experts]
            dims = 2 if what == "weight" else 1
            ne = shape[dims] if len(shape) > dims else 1
            table = self.kinds if what == "weight" else self.biases
            k = table.setdefault(kind, {"types": [], "bytes_per_expert": None, "shape": shape[:dims], "layers": {}})
            entry = {"type": tname, "bytes": nb, "bytes_per_expert": nb // ne if ne else nb, "n_expert": ne,
                     "shape": shape[:dims]}
            if what == "weight" and self.n_expert_seen is None:
                self.n_expert_seen = ne
        if tname not in k["types"]:
            k["types"].append(tname)
        k["layers"][il] = entry

    def other_tensor(self, t, block: int | None, rest: str, nb: int) -> None:
        """Any tensor that is not a routed expert (``rest``: its name after ``blk.N.``)."""
        self.other += nb
        if block is not None:
            acc = self.parts.setdefault(block, {}).setdefault(_layer_part(rest), [0, 0])
            acc[0] += int(t.n_elements)
            acc[1] += nb
        if ".ffn_up_shexp.weight" in t.name or ".ffn_down_shexp.weight" in t.name:
            self.shared["present"] = True
            if ".ffn_up_shexp." in t.name:
                self.shared["ff"] = int(t.shape[1])
        if ".ffn_gate_inp_shexp." in t.name:
            self.shared["gated"] = True


def _scan(g: GGUFFile) -> _Scan:
    s = _Scan()
    for t in g.all_tensors:
        tname = gguf.GGMLQuantizationType(int(t.tensor_type)).name
        s.types[tname] = s.types.get(tname, 0) + 1
        nb = int(t.n_bytes)
        mb = BLOCK_RE.match(t.name)
        if mb:
            s.all_layers.add(int(mb.group(1)))
        m = EXPERT_TENSOR_RE.match(t.name)
        if m:
            s.expert_tensor(t, int(m.group(1)), m.group(2), m.group(3), tname, nb)
        else:
            s.other_tensor(t, int(mb.group(1)) if mb else None, t.name[mb.end():] if mb else "", nb)
    for k in list(s.kinds.values()) + list(s.biases.values()):
        per = {v["bytes_per_expert"] for v in k["layers"].values()}
        k["bytes_per_expert"] = per.pop() if len(per) == 1 else None
    return s


def describe(src: Union[PathLike, GGUFFile]) -> dict:
    """Describe a GGUF model's MoE structure (``src``: a path, or a :class:`GGUFFile` already open).

    Returns a dict with keys:
        path, file_size (bytes; a split model's: all shards), n_shards (1 for a single file), architecture, name,
        file_type (e.g. "MOSTLY_Q8_0" or None), n_layer, n_embd, n_vocab, has_experts (bool), moe_layers /
        dense_layers (lists of block ids), n_expert, n_expert_used (top-k), shared: {"count", "ff" (width),
        "gated" (has ffn_gate_inp_shexp)} or None,
        expert_tensors: {kind: {"types": [ggml type names], "bytes_per_expert": int or None when it differs
            between layers, "shape": [ne0, ne1] of one expert (the first layer's), "layers": {block id: {"type",
            "bytes", "bytes_per_expert", "n_expert", "shape"}}}} for kind in gate/up/down/gate_up present
            (weights only),
        expert_biases: the same for the ``ffn_*_exps.bias`` tensors (gpt-oss; "shape": [ne0] of one expert's row;
            empty when the file has none): the engine's slot pool carries one row of each per slot,
        expert_scales: {kind: {"types", "layers": {block id: {"type", "bytes", "n_expert"}}}} for the
            ``ffn_*_exps.scale`` tensors (one F32 per expert; the slot pool carries it per slot),
        expert_variants: {block id: :func:`expert_variant`} per MoE layer: what build_moe_ffn builds and whether the
            engine runs it,
        routed_expert_bytes (all ``ffn_*_exps`` tensors, biases included), other_bytes (every other tensor),
        tensor_bytes (sum of both), tensor_types ({ggml type name: tensor count}),
        n_head / n_head_kv (``attention.head_count`` / ``_kv``; the largest when stored per layer; None when
        absent), n_layer_nextn (``nextn_predict_layers``, trailing blocks that inference does not run; 0 when
        absent), gating / gating_source (:func:`expert_gating`),
        layer_parts: {block id: {part: [params, bytes]}}, the block's other tensors (weights and biases, not
        the routed experts) summed per part of :data:`hybrimoe.model.tables.LAYER_PARTS`.

    Raises:
        FileNotFoundError: ``src`` does not exist.
        ValueError: not a GGUF file, truncated or corrupt, or without ``general.architecture``.
    """
    g = _as_gguf(src)
    arch = g.field("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{g.path}: GGUF without general.architecture")
    ft = g.field("general.file_type")
    try:
        ft_name = gguf.LlamaFileType(int(ft)).name if ft is not None else None
    except ValueError:
        ft_name = str(ft)
    n_embd = g.field(f"{arch}.embedding_length")
    n_used = g.field(f"{arch}.expert_used_count")
    tokens = g.reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else g.field(f"{arch}.vocab_size")
    n_vocab = None if n_vocab is None else int(n_vocab)
    s = _scan(g)
    n_expert = g.field(f"{arch}.expert_count", s.n_expert_seen)
    n_layer = g.field(f"{arch}.block_count")
    if n_layer is None:
        n_layer = (max(s.all_layers) + 1) if s.all_layers else 0
    n_layer = int(n_layer)
    shared = None
    if s.shared["present"]:
        count = g.field(f"{arch}.expert_shared_count")
        shared = {"count": int(count) if count is not None else 1, "ff": s.shared["ff"], "gated": s.shared["gated"]}
    has_experts = bool(s.moe_layers)
    nextn = g.field(f"{arch}.nextn_predict_layers")
    nextn = int(nextn) if isinstance(nextn, int) else 0
    gating, gating_source = expert_gating(arch, g.field(f"{arch}.expert_gating_func"), n_layer - nextn, n_vocab)
    clamp = g.field(f"{arch}.swiglu_clamp_exp") if arch in CLAMP_ARCHS else None
    variants = {il: expert_variant(arch, il, s.kinds, s.biases, s.scales, clamp) for il in sorted(s.moe_layers)}
    return {
        "path": str(g.path), "file_size": g.size, "n_shards": max(1, len(g.shards)), "architecture": arch,
        "name": g.field("general.name"),
        "file_type": ft_name, "n_layer": n_layer, "n_embd": None if n_embd is None else int(n_embd),
        "n_vocab": n_vocab, "has_experts": has_experts,
        "moe_layers": sorted(s.moe_layers), "dense_layers": [i for i in range(n_layer) if i not in s.moe_layers],
        "n_expert": int(n_expert) if (n_expert and has_experts) else 0,
        "n_expert_used": int(n_used) if (n_used and has_experts) else 0,
        "shared": shared, "expert_tensors": s.kinds, "expert_biases": s.biases, "expert_scales": s.scales,
        "expert_variants": variants, "routed_expert_bytes": s.routed, "other_bytes": s.other,
        "tensor_bytes": s.routed + s.other, "tensor_types": s.types,
        "n_head": _count(g.field(f"{arch}.attention.head_count")),
        "n_head_kv": _count(g.field(f"{arch}.attention.head_count_kv")), "n_layer_nextn": nextn,
        "gating": gating, "gating_source": gating_source, "layer_parts": s.parts,
    }


def gguf_type_bytes(tname: str) -> int:
    """Bytes of one element of an unquantized ggml type by name (F32 4, F16/BF16 2; a scale is one element)."""
    bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tname]]
    return ts // bs


def layer_bytes(src: Union[PathLike, GGUFFile]) -> dict:
    """``{"layers": {model layer: (all tensor bytes, routed-expert bytes)}, "outside": bytes of the tensors outside
    the blocks}`` of a GGUF (routed experts: upstream's ``exps`` rule, :data:`hybrimoe.model.tables.EXPS_REGEX`).

    Raises:
        FileNotFoundError, ValueError: as :func:`open_gguf`.
    """
    import re

    exps = re.compile(EXPS_REGEX)
    per: dict = {}
    outside = 0
    for t in _as_gguf(src).all_tensors:
        m = BLOCK_RE.match(t.name)
        if not m:
            outside += int(t.n_bytes)
            continue
        a, e = per.get(int(m.group(1)), (0, 0))
        per[int(m.group(1))] = (a + int(t.n_bytes), e + (int(t.n_bytes) if exps.search(t.name) else 0))
    return {"layers": per, "outside": outside}
