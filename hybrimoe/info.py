"""``hybrimoe info MODEL.gguf``: the MoE structure and expert bytes of a GGUF file, read with the gguf package.

``describe(path)`` returns a dict (see its docstring); ``run(args)`` prints it. Bytes are real tensor sizes in the
file (``ReaderTensor.n_bytes``, i.e. ggml row size x rows for the tensor's type); bytes per expert are a routed
expert tensor's bytes divided by its expert count (ne2).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# routed-expert weight tensors, by kind
EXPERT_KINDS = ("gate", "up", "down", "gate_up")
_EXPS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.(weight|bias|scale)$")
_BLK_RE = re.compile(r"^blk\.(\d+)\.")
#: the parts of a block's other (non-routed-expert) tensors, as :func:`describe` sorts them (``layer_parts``)
LAYER_PARTS = ("attention", "shared_experts", "router", "norms", "dense_ffn", "other")
#: upstream's llama_expert_gating_func_type (src/llama-hparams.h), by the value of ``<arch>.expert_gating_func``
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}
#: architectures whose graph gates with another function than softmax when the key is absent (upstream's
#: models/openai-moe.cpp and models/llama4.cpp pass it to llm_graph_context::build_moe_ffn)
_ARCH_GATING = {"gpt-oss": "softmax_weight", "llama4": "sigmoid"}
#: the expert activation (build_moe_ffn's type_op) each architecture's graph passes, where it is not SiLU
#: (upstream's src/models/*.cpp)
ARCH_ACTIVATION = {"gpt-oss": "swiglu_oai", "minimax-m3": "swiglu_oai", "grok": "gelu", "gemma4": "gelu",
                   "nomic-bert-moe": "gelu", "nemotron_h": "relu_sqr", "nemotron_h_moe": "relu_sqr",
                   "smallthinker": "relu", "kimi-k3": "situ"}
#: architectures that read ``<arch>.swiglu_clamp_exp``, and of those the ones build_moe_ffn clamps with
#: ggml_swiglu_clamp (the others: clamp, silu, clamp, mul)
_CLAMP_ARCHS = ("bailingmoe3", "deepseek4", "dflash", "glm5-next", "hy_v4", "maple", "step35")
_CLAMP_FUSED = ("deepseek4", "glm5-next", "hy_v4", "maple", "dflash")


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        v = f.contents()
    except Exception:  # malformed field: treat as absent
        return default
    return v


def _open(path):
    import gguf

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file")
    if not p.is_file():
        raise ValueError(f"{p}: not a regular file")
    size = p.stat().st_size
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{p}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # truncated header/metadata surfaces as assorted numpy/struct errors
        raise ValueError(f"{p}: truncated or corrupt GGUF ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ValueError(f"{p}: truncated GGUF: tensor {t.name} ends at byte {end} but the file has {size}")
    return p, size, reader


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
    name = _ARCH_GATING.get(arch, "softmax")
    return name, f"{key} absent: {name}, the gating upstream's {arch} graph uses"


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
    form = ("swiglu_clamp" if arch in _CLAMP_FUSED else "clamp_silu_mul") if lim > 1e-6 else ""
    before = arch == "llama4"
    why = ""
    if "down" not in have or not ("up" in have or fused):
        why = "no up and down expert matrices"
    elif fused and ("gate" in have or "up" in have):
        why = "both fused gate_up and separate gate/up matrices"
    elif act == "relu_sqr" and gated:
        why = "gated squared ReLU (upstream aborts on it)"
    elif act in ("swiglu_oai", "situ") and not gated:
        why = f"{act} without a gate"
    elif any(biases[k]["layers"][il]["type"] != "F32" for k in b):
        why = "expert biases that are not F32"
    elif any(scales[k]["layers"][il]["type"] != "F32" for k in sc):
        why = "per-expert scales that are not F32"
    names = {"silu": "SiLU", "swiglu_oai": "SwiGLU-OAI", "gelu": "GELU", "relu": "ReLU", "relu_sqr": "squared ReLU",
             "situ": "SITU"}
    parts = [names[act] + ("-GLU" if gated and act not in ("swiglu_oai", "situ") else "")]
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


def _ranges(ids):
    ids = sorted(ids)
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(out) if out else "none"


def describe(path) -> dict:
    """Describe a GGUF model's MoE structure.

    Returns a dict with keys:
        path, file_size (bytes), architecture, name, file_type (e.g. "MOSTLY_Q8_0" or None), n_layer, n_embd,
        n_vocab, has_experts (bool), moe_layers / dense_layers (lists of block ids), n_expert, n_expert_used
        (top-k), shared: {"count", "ff" (width), "gated" (has ffn_gate_inp_shexp)} or None,
        expert_tensors: {kind: {"types": [ggml type names], "bytes_per_expert": int or None when it differs
            between layers, "shape": [ne0, ne1] of one expert (the first layer's), "layers": {block id: {"type",
            "bytes", "bytes_per_expert", "n_expert", "shape"}}}} for kind in gate/up/down/gate_up present
            (weights only),
        expert_biases: {kind: {"types", "bytes_per_expert", "shape": [ne0] of one expert's row, "layers": {block
            id: {"type", "bytes", "bytes_per_expert", "n_expert", "shape"}}}} for the ``ffn_*_exps.bias`` tensors
            (gpt-oss; empty when the file has none): the engine's slot pool carries one row of each per slot,
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
        the routed experts) summed per part of :data:`LAYER_PARTS` (attention, shared experts and their gate,
        router and selection bias, norms, a dense FFN, other).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a GGUF file, truncated or corrupt.
    """
    import gguf

    p, size, r = _open(path)
    arch = _field(r, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{p}: GGUF without general.architecture")
    ft = _field(r, "general.file_type")
    try:
        ft_name = gguf.LlamaFileType(int(ft)).name if ft is not None else None
    except ValueError:
        ft_name = str(ft)
    n_layer = _field(r, f"{arch}.block_count")
    n_embd = _field(r, f"{arch}.embedding_length")
    n_expert = _field(r, f"{arch}.expert_count")
    n_used = _field(r, f"{arch}.expert_used_count")
    tokens = r.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else _field(r, f"{arch}.vocab_size")

    routed = other = 0
    kinds: dict = {}
    bias_kinds: dict = {}
    scale_kinds: dict = {}
    moe_layers: set = set()
    all_layers: set = set()
    types: dict = {}
    sh = {"ff": None, "gated": False, "present": False}
    parts: dict = {}
    for t in r.tensors:
        tname = gguf.GGMLQuantizationType(int(t.tensor_type)).name
        types[tname] = types.get(tname, 0) + 1
        nb = int(t.n_bytes)
        mb = _BLK_RE.match(t.name)
        if mb:
            all_layers.add(int(mb.group(1)))
        m = _EXPS_RE.match(t.name)
        if m:
            routed += nb
            il, kind, what = int(m.group(1)), m.group(2), m.group(3)
            moe_layers.add(il)
            if what == "scale":
                shape = [int(x) for x in t.shape]
                k = scale_kinds.setdefault(kind, {"types": [], "layers": {}})
                if tname not in k["types"]:
                    k["types"].append(tname)
                k["layers"][il] = {"type": tname, "bytes": nb, "n_expert": shape[0] if shape else 1}
            if what == "bias":
                shape = [int(x) for x in t.shape]
                ne = shape[1] if len(shape) >= 2 else 1
                k = bias_kinds.setdefault(kind, {"types": [], "bytes_per_expert": None, "shape": shape[:1],
                                                 "layers": {}})
                if tname not in k["types"]:
                    k["types"].append(tname)
                k["layers"][il] = {"type": tname, "bytes": nb, "bytes_per_expert": nb // ne if ne else nb,
                                   "n_expert": ne, "shape": shape[:1]}
            if what == "weight":
                shape = [int(x) for x in t.shape]
                ne = shape[2] if len(shape) >= 3 else 1
                k = kinds.setdefault(kind, {"types": [], "bytes_per_expert": None, "shape": shape[:2], "layers": {}})
                if tname not in k["types"]:
                    k["types"].append(tname)
                k["layers"][il] = {"type": tname, "bytes": nb, "bytes_per_expert": nb // ne if ne else nb,
                                   "n_expert": ne, "shape": shape[:2]}
                if n_expert is None:
                    n_expert = ne
            continue
        other += nb
        if mb:
            acc = parts.setdefault(int(mb.group(1)), {}).setdefault(_layer_part(t.name[mb.end():]), [0, 0])
            acc[0] += int(t.n_elements)
            acc[1] += nb
        if ".ffn_up_shexp.weight" in t.name or ".ffn_down_shexp.weight" in t.name:
            sh["present"] = True
            if ".ffn_up_shexp." in t.name:
                sh["ff"] = int(t.shape[1])
        if ".ffn_gate_inp_shexp." in t.name:
            sh["gated"] = True
    for k in list(kinds.values()) + list(bias_kinds.values()):
        per = {v["bytes_per_expert"] for v in k["layers"].values()}
        k["bytes_per_expert"] = per.pop() if len(per) == 1 else None
    shared = None
    if sh["present"]:
        count = _field(r, f"{arch}.expert_shared_count")
        shared = {"count": int(count) if count is not None else 1, "ff": sh["ff"], "gated": sh["gated"]}
    if n_layer is None:
        n_layer = (max(all_layers) + 1) if all_layers else 0
    has_experts = bool(moe_layers)
    n_vocab = None if n_vocab is None else int(n_vocab)
    nextn = _field(r, f"{arch}.nextn_predict_layers")
    nextn = int(nextn) if isinstance(nextn, int) else 0
    gating, gating_source = expert_gating(arch, _field(r, f"{arch}.expert_gating_func"), int(n_layer) - nextn,
                                          n_vocab)
    clamp = _field(r, f"{arch}.swiglu_clamp_exp") if arch in _CLAMP_ARCHS else None
    variants = {il: expert_variant(arch, il, kinds, bias_kinds, scale_kinds, clamp) for il in sorted(moe_layers)}
    return {
        "path": str(p), "file_size": size, "architecture": arch, "name": _field(r, "general.name"),
        "file_type": ft_name, "n_layer": int(n_layer), "n_embd": None if n_embd is None else int(n_embd),
        "n_vocab": n_vocab, "has_experts": has_experts,
        "moe_layers": sorted(moe_layers), "dense_layers": [i for i in range(int(n_layer)) if i not in moe_layers],
        "n_expert": int(n_expert) if (n_expert and has_experts) else 0,
        "n_expert_used": int(n_used) if (n_used and has_experts) else 0,
        "shared": shared, "expert_tensors": kinds, "expert_biases": bias_kinds, "expert_scales": scale_kinds,
        "expert_variants": variants, "routed_expert_bytes": routed, "other_bytes": other,
        "tensor_bytes": routed + other, "tensor_types": types,
        "n_head": _count(_field(r, f"{arch}.attention.head_count")),
        "n_head_kv": _count(_field(r, f"{arch}.attention.head_count_kv")), "n_layer_nextn": nextn,
        "gating": gating, "gating_source": gating_source, "layer_parts": parts,
    }


def gguf_type_bytes(tname: str) -> int:
    """Bytes of one element of an unquantized ggml type by name (F32 4, F16/BF16 2; a scale is one element)."""
    import gguf

    bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tname]]
    return ts // bs


def _mib(n):
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def format_info(d: dict) -> str:
    """Human-readable text for a ``describe`` dict."""
    lines = [
        f"file:          {d['path']} ({d['file_size']} bytes, {_mib(d['file_size'])})",
        f"architecture:  {d['architecture']}" + (f" (name: {d['name']})" if d.get("name") else ""),
        f"file type:     {d['file_type'] or 'unknown'}",
        f"layers:        {d['n_layer']}  (MoE: {_ranges(d['moe_layers'])}; dense: {_ranges(d['dense_layers'])})",
        f"n_embd:        {d['n_embd']}   n_vocab: {d['n_vocab']}",
    ]
    if not d["has_experts"]:
        lines.append("experts:       none (dense model, no routed-expert tensors)")
        lines.append(f"tensor bytes:  {d['tensor_bytes']} ({_mib(d['tensor_bytes'])}); types: "
                     + ", ".join(f"{k} x{v}" for k, v in sorted(d["tensor_types"].items())))
        return "\n".join(lines)
    sh = d["shared"]
    shs = "none" if sh is None else (f"{sh['count']} (width {sh['ff']}" + (", sigmoid-gated)" if sh["gated"] else ")"))
    lines.append(f"experts:       {d['n_expert']} routed per MoE layer, top-{d['n_expert_used']}, shared: {shs}")
    lines.append("expert tensors (bytes per expert, per layer):")
    lines.append(f"  {'tensor':<18}{'type':<10}{'bytes/expert':>14}  {'expert shape':<14}layers")
    for kind in EXPERT_KINDS:
        k = d["expert_tensors"].get(kind)
        if k is None:
            continue
        shape = "x".join(str(x) for x in k["shape"])
        groups: dict = {}
        for il, v in sorted(k["layers"].items()):
            groups.setdefault((v["type"], v["bytes_per_expert"]), []).append(il)
        for (tname, bpe), ils in groups.items():
            lines.append(f"  {'ffn_' + kind + '_exps':<18}{tname:<10}{bpe:>14}  {shape:<14}{_ranges(ils)}")
    for kind in EXPERT_KINDS:
        # expert biases: one row per expert, carried per GPU slot with the matrices
        k = d.get("expert_biases", {}).get(kind)
        if k is None:
            continue
        shape = "x".join(str(x) for x in k["shape"])
        groups = {}
        for il, v in sorted(k["layers"].items()):
            groups.setdefault((v["type"], v["bytes_per_expert"]), []).append(il)
        for (tname, bpe), ils in groups.items():
            lines.append(f"  {'ffn_' + kind + '_exps.b':<18}{tname:<10}{bpe:>14}  {shape:<14}{_ranges(ils)}")
    for kind in EXPERT_KINDS:
        k = d.get("expert_scales", {}).get(kind)
        if k is None:
            continue
        groups = {}
        for il, v in sorted(k["layers"].items()):
            groups.setdefault(v["type"], []).append(il)
        for tname, ils in groups.items():
            bpe = gguf_type_bytes(tname)
            lines.append(f"  {'ffn_' + kind + '_exps.s':<18}{tname:<10}{bpe:>14}  {'1':<14}{_ranges(ils)}")
    variants: dict = {}
    for il, v in sorted(d.get("expert_variants", {}).items()):
        variants.setdefault((v["name"], v["engine"], v["why"]), []).append(il)
    for (name, ok, why), ils in variants.items():
        lines.append(f"expert variant:      {name} (layers {_ranges(ils)}): "
                     + ("the engine runs it" if ok else f"upstream's path ({why})"))
    per_layer = {}
    for group in ("expert_tensors", "expert_biases"):
        for k in d.get(group, {}).values():
            for il, v in k["layers"].items():
                m, bias = per_layer.get(il, (0, 0))
                per_layer[il] = (m + v["bytes_per_expert"], bias) if group == "expert_tensors" else \
                    (m, bias + v["bytes_per_expert"])
    for k in d.get("expert_scales", {}).values():
        for il, v in k["layers"].items():
            m, bias = per_layer.get(il, (0, 0))
            per_layer[il] = (m, bias + gguf_type_bytes(v["type"]))
    if per_layer:
        # what one expert moves to a GPU slot: its matrices, (gpt-oss) its bias rows and its scales
        m, bias = max(per_layer.values(), key=lambda mb: mb[0] + mb[1])
        extra = "biases and scales" if d.get("expert_scales") else "biases"
        lines.append(f"bytes per expert:    {m + bias} (matrices {m} + {extra} {bias}; the largest MoE layer's)")
    tot = d["tensor_bytes"] or 1
    lines.append(f"routed-expert bytes: {d['routed_expert_bytes']} ({_mib(d['routed_expert_bytes'])}, "
                 f"{100.0 * d['routed_expert_bytes'] / tot:.1f}% of tensor bytes)")
    lines.append(f"other bytes:         {d['other_bytes']} ({_mib(d['other_bytes'])}, "
                 f"{100.0 * d['other_bytes'] / tot:.1f}%)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``info`` arguments to ``parser``."""
    parser.add_argument("model", metavar="MODEL.gguf", help="GGUF model file")
    parser.add_argument("--json", action="store_true", help="print the describe() dict as JSON")


def run(args) -> int:
    """Print the model's MoE facts; 0 on success, 1 with a one-line error on stderr for a bad file."""
    try:
        d = describe(args.model)
    except (OSError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"hybrimoe info: error: {msg}", file=sys.stderr)
        return 1
    if getattr(args, "json", False):
        import json

        print(json.dumps(d, indent=1, default=str))
    else:
        print(format_info(d))
    return 0


def main(argv=None) -> int:
    """Stand-alone entry (``python -m hybrimoe.info MODEL.gguf``)."""
    ap = argparse.ArgumentParser(prog="hybrimoe info")
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
