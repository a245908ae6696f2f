"""Quantization of the tiny models through llama.cpp's own quantizer, and upstream's Q4_K_M type rules restated.

A ``quant`` argument of ``make_tiny_model`` is one of:

- ``None`` or ``"F32"``: the model is written as F32 directly, nothing is quantized;
- a llama.cpp file type name (``"F16"``, ``"Q8_0"``, ``"Q4_0"``, ``"Q4_K_M"``, ``"Q6_K"``, ...; the keys of
  ``FTYPES``), applied to every tensor llama.cpp quantizes (``"MXFP4_MOE"``: 3-D expert tensors MXFP4, the
  others Q8_0);
- the preset ``"mix"`` (``MIX_PRESETS``: base Q8_0 with ``ffn_gate_exps`` Q4_K, ``ffn_up_exps`` Q8_0,
  ``ffn_down_exps`` Q6_K);
- a dict mapping tensor-name patterns (regular expressions searched in the tensor name, e.g.
  ``"ffn_gate_exps"``) to ggml type names, with an optional ``"base"`` entry naming the file type of all other
  tensors (default ``"Q8_0"``).

:func:`parse_quant` turns it into a :class:`QuantSpec`; :func:`quantize_gguf` runs ``llama_model_quantize`` with
the base file type and the per-tensor types as its ``tt_overrides``. Types with 256-wide blocks (K-quants) need
rows (``n_embd``, ``n_ff_exp``) that are multiples of 256, 32-wide types multiples of 32: on other rows upstream
silently falls back to another type (``tensor_type_fallback`` in llama-quant.cpp), so :func:`check_rows` raises
``ValueError`` instead of letting a file with unexpected types be written.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import gguf

# llama.cpp file types reachable by name (value: suffix of llama_cpp.LLAMA_FTYPE_*).
FTYPES = {
    "F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16",
    "Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0",
    "Q5_1": "MOSTLY_Q5_1", "Q2_K": "MOSTLY_Q2_K", "Q3_K_S": "MOSTLY_Q3_K_S", "Q3_K_M": "MOSTLY_Q3_K_M",
    "Q3_K_L": "MOSTLY_Q3_K_L", "Q4_K_S": "MOSTLY_Q4_K_S", "Q4_K_M": "MOSTLY_Q4_K_M",
    "Q5_K_S": "MOSTLY_Q5_K_S", "Q5_K_M": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K",
    "MXFP4_MOE": "MOSTLY_MXFP4_MOE",
}
# block width (elements) of the ggml types each file type may produce for the (large, 2-D/3-D) weights, used for
# the row-size check; file types not listed (the K-quant mixes) produce 256-wide blocks
_FTYPE_BLOCK = {"F32": 1, "F16": 1, "BF16": 1, "Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32,
                "MXFP4_MOE": 32}
MIX_PRESETS = {
    "mix": {"base": "Q8_0", "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q6_K"},
}


class QuantSpec(NamedTuple):
    """A parsed ``quant`` argument: what :func:`quantize_gguf` is given, and the rows it needs."""

    base: str                  # llama.cpp file type name (a key of FTYPES) for tensors no override matches
    overrides: dict[str, str]  # {regex searched in tensor names: ggml type name}
    block: int                 # widest block (elements) among the types the spec may write: rows must be multiples


def _llama_cpp():
    """Return the ``llama_cpp`` module bound to hybrimoe's patched libllama (``hybrimoe._lib.llama_cpp_module``).

    There is no fallback to a plain ``import llama_cpp``: it would bind this process to upstream's libllama for
    good, so a later ``hybrimoe.Llama`` in it would fail with a misleading "llama_cpp was imported before
    hybrimoe" (the usual cause being a source checkout, which has no native part, shadowing the installed
    package on ``sys.path``). The error names the missing file instead.

    Raises:
        ImportError (``hybrimoe.HybrimoeImportError``): llama-cpp-python is not installed, llama_cpp was imported
            before hybrimoe, or the imported hybrimoe has no libllama (not built, or a source tree).
    """
    from hybrimoe._lib import llama_cpp_module

    return llama_cpp_module()


def parse_quant(quant) -> QuantSpec | None:
    """Normalise a ``quant`` argument (module doc) to a :class:`QuantSpec`, or None for F32 (nothing to quantize).

    Raises:
        ValueError: unknown file type or ggml type name, a tensor pattern that is not a regular expression, or a
            ``quant`` that is neither None, a name nor a dict.
    """
    if quant is None:
        return None
    if isinstance(quant, str):
        q = quant.upper() if quant.lower() != "mix" else "mix"
        if q == "F32":
            return None
        if q in MIX_PRESETS or quant in MIX_PRESETS:
            spec = dict(MIX_PRESETS[quant if quant in MIX_PRESETS else q])
        elif q in FTYPES:
            spec = {"base": q}
        else:
            raise ValueError(f"unknown quant {quant!r}; valid: {', '.join(list(FTYPES) + list(MIX_PRESETS))} "
                             "or a dict {tensor pattern: ggml type}")
    elif isinstance(quant, dict):
        spec = {str(k): str(v).upper() for k, v in quant.items()}
        spec.setdefault("base", "Q8_0")
    else:
        raise ValueError(f"quant must be None, a name or a dict, not {type(quant).__name__}")
    base = spec.pop("base").upper()
    if base not in FTYPES:
        raise ValueError(f"unknown base file type {base!r}; valid: {', '.join(FTYPES)}")
    blocks = [_FTYPE_BLOCK.get(base, 256)]
    for pat, tname in spec.items():
        try:
            re.compile(pat)
        except re.error as e:
            raise ValueError(f"bad tensor pattern {pat!r}: {e}") from None
        try:
            t = gguf.GGMLQuantizationType[tname]
        except KeyError:
            raise ValueError(f"unknown ggml type {tname!r} for {pat!r}") from None
        blocks.append(gguf.GGML_QUANT_SIZES[t][0])
    return QuantSpec(base, spec, max(blocks))


def check_rows(quant, spec: QuantSpec | None, rows) -> None:
    """Check that every row length fits the blocks of ``spec`` (parsed from ``quant``, named in the message).

    Args:
        rows: ``(name, row length in elements)`` pairs, e.g. ``[("n_embd", 64), ("n_ff_exp", 32)]``.

    Raises:
        ValueError: a row length that is not a multiple of ``spec.block`` (the message names it and the block).
    """
    if spec is None:
        return
    blk = spec.block
    for name, n in rows:
        if n % blk:
            raise ValueError(f"quant {quant!r} uses {blk}-wide blocks but {name}={n} is not a multiple of "
                             f"{blk}; llama.cpp would silently write another type. Use multiples of {blk}.")


#: ggml types llama.cpp's quantizer refuses to write without an importance matrix (tensor_requires_imatrix in
#: llama-quant.cpp; Q2_K only inside a Q2_K_S file, which FTYPES does not offer)
IMATRIX_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS")


def synthetic_imatrix(src, seed: int = 0) -> dict:
    """A synthetic importance matrix for the weights of GGUF ``src``: ``{tensor name: float32 [ne0 * ne2]}`` (per
    expert one weight per input column, as llama.cpp's quantizer reads it: ``ne[0] * ne[2]`` values), positive
    (uniform in [0.5, 1.5), seeded by ``seed`` and the tensor's position), for every tensor of 2 or more
    dimensions. The tiny models have no calibration data; the types that need one (``IMATRIX_TYPES``) only need
    some positive weighting of the columns."""
    import numpy as np

    r = gguf.GGUFReader(str(src))
    out = {}
    for i, t in enumerate(r.tensors):
        shape = [int(x) for x in t.shape]  # ggml order: ne0 first
        if len(shape) < 2:
            continue
        n = shape[0] * (shape[2] if len(shape) >= 3 else 1)
        out[t.name] = np.random.default_rng([seed, i]).uniform(0.5, 1.5, n).astype(np.float32)
    return out


def quantize_gguf(src, dst, base: str = "Q8_0", overrides: dict | None = None, nthread: int = 2,
                  verbose: bool = False, imatrix: dict | None = None) -> Path:
    """Quantize GGUF ``src`` into ``dst`` with llama.cpp's ``llama_model_quantize``; returns ``Path(dst)``.

    Args:
        base: llama.cpp file type name (key of ``FTYPES``) for all tensors not matched by ``overrides``.
        overrides: {regex searched in tensor names: ggml type name} (llama's ``tt_overrides``).
        nthread: quantizer threads (the output does not depend on it).
        verbose: also print llama.cpp's quantizer log (per-tensor types, fallbacks) to stderr; it is
            captured otherwise and its last lines go into the error message on failure.
        imatrix: {tensor name: float32 [ne0 * ne2]} importance matrix (llama's ``imatrix`` parameter); None: a
            :func:`synthetic_imatrix` when an override asks for one of ``IMATRIX_TYPES``, else none.

    Raises:
        ValueError: unknown type names. RuntimeError: the quantizer returned non-zero.
    """
    llama_cpp = _llama_cpp()
    if base not in FTYPES:
        raise ValueError(f"unknown file type {base!r}; valid: {', '.join(FTYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_" + FTYPES[base])
    params.nthread = nthread
    keep = []  # the patterns and the array must outlive the call: ctypes holds only pointers to them
    if overrides:
        arr = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
        for i, (pat, tname) in enumerate(overrides.items()):
            try:
                ttype = int(gguf.GGMLQuantizationType[tname.upper()])
            except KeyError:
                raise ValueError(f"unknown ggml type {tname!r}") from None
            b = pat.encode()
            keep.append(b)
            arr[i].pattern = b
            arr[i].type = ttype
        arr[len(overrides)].pattern = None  # the list ends with a null pattern
        keep.append(arr)
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    if imatrix is None and any(str(t).upper() in IMATRIX_TYPES for t in (overrides or {}).values()):
        imatrix = synthetic_imatrix(src)
    if imatrix:
        import numpy as np

        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, vals) in enumerate(imatrix.items()):
            a = np.ascontiguousarray(vals, dtype=np.float32)
            b = name.encode()
            keep.extend([a, b])
            entries[i].name = b
            entries[i].data = a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = a.size
        entries[len(imatrix)].name = None  # the list ends with a null name
        keep.append(entries)
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    with _captured_output() as log:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if verbose:
        sys.stderr.write(log.text)
    if rc != 0:
        tail = " | ".join(log.text.strip().splitlines()[-3:])
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {base}) failed with {rc}: {tail}")
    return Path(dst)


class _captured_output:
    """Context manager collecting what llama.cpp prints (through llama_cpp's Python log callback, or
    straight to file descriptors 1/2) into ``.text`` instead of the terminal."""

    def __enter__(self):
        import io

        self.text = ""
        self._buf = io.StringIO()
        self._old = sys.stdout, sys.stderr
        sys.stdout.flush()
        sys.stderr.flush()
        self._tmp = tempfile.TemporaryFile(mode="w+b")
        self._saved = [os.dup(1), os.dup(2)]
        os.dup2(self._tmp.fileno(), 1)
        os.dup2(self._tmp.fileno(), 2)
        sys.stdout = sys.stderr = self._buf
        return self

    def __exit__(self, *exc):
        sys.stdout, sys.stderr = self._old
        for fd, saved in zip((1, 2), self._saved):
            os.dup2(saved, fd)
            os.close(saved)
        self._tmp.seek(0)
        self.text = self._buf.getvalue() + self._tmp.read().decode(errors="replace")
        self._tmp.close()
        return False


# fallback of a 256-wide type when a row length is not a multiple of 256 (llama-quant.cpp, tensor_type_fallback)
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def fallback_type(type_name: str, ne0: int) -> str:
    """The type upstream's quantizer writes instead of ``type_name`` for rows of ``ne0`` elements
    (``tensor_type_fallback`` in llama-quant.cpp): ``type_name`` itself when its block width divides ``ne0``;
    else the 32-wide type that replaces a 256-wide one (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0) when 32
    divides ``ne0``; else F16. Only the types that :func:`q4_k_m_type` and the synthetic writer use have a
    restated fallback (a 256-wide type not in that list raises ``KeyError``)."""
    if ne0 % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0] == 0:
        return type_name
    t = _FALLBACK[type_name] if gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0] > 32 else type_name
    return t if ne0 % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0] == 0 else "F16"


def _use_more_bits(il: int, n_layer: int) -> bool:
    """Upstream's ``use_more_bits``: the blocks whose ``ffn_down`` (and ``attn_v``) Q4_K_M writes with Q6_K."""
    n8 = n_layer // 8
    return il < n8 or il >= 7 * n_layer // 8 or (il - n8) % 3 == 2


def q4_k_m_type(name: str, ne0: int, n_layer: int) -> str:
    """The ggml type upstream's ``Q4_K_M`` file type gives tensor ``name`` (row length ``ne0`` elements) of a
    deepseek2, qwen3moe or gpt-oss model with ``n_layer`` blocks; the rules of llama.cpp's
    ``llama_tensor_get_type`` that apply to those architectures, restated:

    - not quantized (F32): 1-D tensors (the caller's to check: the name does not tell), ``*_norm.weight``, the
      router ``ffn_gate_inp``, tensors not named ``*.weight`` (biases);
    - ``output.weight``: Q6_K; every other tensor Q4_K, except
    - ``ffn_down*`` (dense, ``_exps`` and ``_shexp``) and ``attn_v`` of the blocks where
      ``use_more_bits(il, n_layer)`` holds (``il < n/8``, ``il >= 7n/8`` or ``(il - n/8) % 3 == 2``): Q6_K
      (upstream counts ``attn_v`` tensors, one per block here, so the count is the block index);
    - then the row-length fallback (:func:`fallback_type`): a 256-wide type on rows that are not a multiple of
      256 becomes Q4_K -> Q5_0, Q6_K -> Q8_0 (DeepSeek-V2-Lite's ``ffn_down_exps``, rows of 1408; gpt-oss-20b's
      rows of 2880), and F16 if even 32 does not divide.

    Not restated: upstream's special case for models with exactly 8 experts (``attn_k``/``attn_v`` Q8_0,
    ``attn_output`` Q5_K), and the rules of fused ``attn_qkv``/``attn_kv_b`` tensors; ``make_synthetic_model``
    refuses ``n_expert == 8`` with Q4_K_M and writes neither.
    """
    if name.endswith("_norm.weight") or "ffn_gate_inp" in name or not name.endswith(".weight"):
        return "F32"
    if name == "output.weight":
        t = "Q6_K"
    elif "ffn_down" in name or name.endswith(".attn_v.weight"):
        t = "Q6_K" if _use_more_bits(int(name.split(".")[1]), n_layer) else "Q4_K"
    else:
        t = "Q4_K"
    return fallback_type(t, ne0)
