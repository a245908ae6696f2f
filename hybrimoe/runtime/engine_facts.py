"""What the engine needs to know about a GGUF MoE model (:class:`EngineFacts`), read once from the file.

The sizes are the file's own (expert matrices, bias rows and scales per MoE layer, as ggml stores them); the GPU
slot size is the native slot pool's rule (``hybrimoe._engine.Engine.slot_bytes_for``), so that budgets in bytes are
whole slots as the engine allocates them.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Optional, Union

import gguf
import numpy as np

from hybrimoe._lib import llama_cpp_module
from hybrimoe.model.facts import ModelFacts, facts_from_description
from hybrimoe.model.reader import GGUFFile, describe, open_gguf


def engine_module():
    """``hybrimoe._engine``, after our libllama is loaded (the module links it and resolves its symbols there)."""
    llama_cpp_module()
    return importlib.import_module("hybrimoe._engine")


#: quant types that ggml-cpu's repack.cpp has repacked kernels for on some CPU (which ones a machine gets depends on
#: its features: :func:`cpu_repacked_types`)
REPACK_CANDIDATES = ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "IQ4_NL", "MXFP4", "Q8_0")


def cpu_repacked_types() -> list[str]:
    """The quant types (ggml names, of :data:`REPACK_CANDIDATES`) whose weight matrices upstream llama.cpp repacks on
    this CPU when they are CPU weights (its default; ``no_repack`` turns it off), asked of ggml-cpu's CPU_REPACK
    buffer type for a matrix of 8 rows of 256 values (``hybrimoe._engine.cpu_repacks``: a matrix needs a row count
    that is a multiple of its kernel's interleave, 4 or 8). The engine's CPU share computes those experts from the
    repacked tensors with upstream's repacked kernels."""
    m = engine_module()
    return [name for name in REPACK_CANDIDATES if m.cpu_repacks(int(gguf.GGMLQuantizationType[name]), 256, 8)]


@dataclass
class EngineFacts:
    """What the engine needs to know about a GGUF MoE model.

    ``expert_bytes``: per MoE layer, bytes of one expert's (gate or fused gate_up, up, down) matrices as stored
    (ggml ``nb[2]``), 0 for one the layer lacks (up beside a fused gate_up, gate in an ungated FFN);
    ``expert_types``: per MoE layer, their ggml type ids (down's for an absent one);
    ``bias_bytes``: per MoE layer, bytes of one expert's (gate or gate_up, up, down) F32 bias rows
    (``ffn_*_exps.bias``, gpt-oss), 0 where the layer has none; empty when no layer has biases (the slot pool
    carries them per slot); ``scale_bytes``: the same for the per-expert scales (``ffn_{gate,up,down}_exps.scale``,
    4 bytes each); ``variants``: per MoE layer, the expert variant's name
    (:func:`hybrimoe.model.reader.expert_variant`); ``routers``: per MoE layer, F32 ``[n_expert, n_embd]`` router
    weights (empty array when the file's router is not F32); ``router_bias``: per MoE layer, F32 ``[n_expert]``
    selection bias (DeepSeek-V3 ``exp_probs_b``) or empty.
    """

    path: str
    arch: str
    n_layer: int
    n_expert: int
    top_k: int
    n_embd: int
    moe_layers: list
    expert_bytes: list
    expert_types: list = field(default_factory=list)
    bias_bytes: list = field(default_factory=list)
    scale_bytes: list = field(default_factory=list)
    variants: dict = field(default_factory=dict)
    weight_before_ffn: bool = False
    clamped: bool = False
    routers: list = field(default_factory=list)
    router_bias: list = field(default_factory=list)
    sigmoid_gating: bool = False
    model: Optional[ModelFacts] = None

    @property
    def slot_bytes(self) -> int:
        """Bytes of one GPU expert slot: the largest gate, up and down matrix over the layers (each rounded up to
        its types' block sizes) plus the largest gate, up and down bias rows (each rounded up to 16 bytes) plus 4
        bytes per kind of per-expert scale."""
        return int(engine_module().Engine.slot_bytes_for([tuple(b) for b in self.expert_bytes],
                                                          [tuple(t) for t in self.expert_types],
                                                          [tuple(b) for b in self.bias_bytes],
                                                          [tuple(b) for b in self.scale_bytes]))

    @property
    def ram_slot_bytes(self) -> int:
        """Bytes of one RAM-tier expert slot: as :attr:`slot_bytes`, but a matrix kind that some layer stores in whole
        4 KiB pages (the tier's direct-read alignment, ``Engine.ram_direct_align``) holds the largest matrix plus 4 KiB,
        rounded up to 4 KiB (4-8 KiB more): an O_DIRECT read lands in the slot, the matrix at its file offset's phase,
        with no copy. Other kinds (gpt-oss's MXFP4 shapes, say) keep the GPU slot's size."""
        E = engine_module().Engine
        return int(E.slot_bytes_for([tuple(b) for b in self.expert_bytes], [tuple(t) for t in self.expert_types],
                                    [tuple(b) for b in self.bias_bytes], [tuple(b) for b in self.scale_bytes],
                                    direct_align=E.ram_direct_align))

    @property
    def total_expert_bytes(self) -> int:
        """Bytes of all routed experts of all MoE layers, as stored (matrices, expert biases and scales)."""
        return int((sum(sum(b) for b in self.expert_bytes) + sum(sum(b) for b in self.bias_bytes)
                    + sum(sum(b) for b in self.scale_bytes)) * self.n_expert)


def _matrix_regions(il: int, kinds: dict) -> tuple[list, list, tuple]:
    """(bytes, ggml type ids, kind names) of MoE layer ``il``'s three slot-pool matrix regions: gate or fused gate_up,
    up (none with gate_up), down; gate is absent in an ungated FFN. An absent matrix has 0 bytes and down's type (any
    valid type does)."""
    fused = il in kinds.get("gate_up", {}).get("layers", {})
    names = ("gate_up" if fused else "gate", None if fused else "up", "down")
    down = kinds["down"]["layers"].get(il)
    down_t = int(gguf.GGMLQuantizationType[down["type"]]) if down else 0
    row_b, row_t = [], []
    for k in names:
        v = kinds.get(k, {}).get("layers", {}).get(il) if k else None
        row_b.append(0 if v is None else int(v["bytes_per_expert"]))
        row_t.append(down_t if v is None else int(gguf.GGMLQuantizationType[v["type"]]))
    return row_b, row_t, names


def _per_expert_rows(tensors: dict, il: int, names, what: str, E: int) -> list:
    """Bytes of one expert's ``ffn_<name>_exps.<what>`` tensor (bias rows, scales) per name, 0 where absent."""
    out = []
    for k in names:
        t = tensors.get(f"blk.{il}.ffn_{k}_exps.{what}") if k else None
        out.append(0 if t is None else int(t.n_bytes) // E)
    return out


def _read_f32(where: dict, name: str, count: int) -> np.ndarray:
    """Tensor ``name``'s ``count`` F32 values read with pread on a descriptor advised POSIX_FADV_RANDOM: not through
    the reader's mapping, whose page fault the kernel answers with a read-around (``read_ahead_kb``, megabytes) that
    would bring the neighbouring expert tensors into the page cache, the RAM a model larger than RAM lacks."""
    path, off = where[name]
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        raw = os.pread(fd, 4 * count, off)
    finally:
        os.close(fd)
    if len(raw) != 4 * count:
        raise ValueError(f"{path}: {name} ends past the end of the file")
    return np.frombuffer(raw, dtype=np.float32).copy()


def _routers(g: GGUFFile, moe_layers: list, n_expert: int, n_embd: int) -> tuple[list, list]:
    """Per MoE layer: the F32 router ``[n_expert, n_embd]`` (empty when the file's router is not F32) and the
    selection bias ``[n_expert]`` (DeepSeek-V3 ``exp_probs_b``; empty without one)."""
    tensors, where = g.tensors, g.tensor_shard
    routers, biases = [], []
    for il in moe_layers:
        name = f"blk.{il}.ffn_gate_inp.weight"
        t = tensors.get(name)
        if t is not None and int(t.tensor_type) == int(gguf.GGMLQuantizationType.F32):
            routers.append(_read_f32(where, name, n_expert * n_embd).reshape(n_expert, n_embd))
        else:
            routers.append(np.zeros(0, np.float32))
        name = f"blk.{il}.exp_probs_b.bias"
        b = tensors.get(name)
        biases.append(_read_f32(where, name, int(b.n_elements)) if b is not None and
                      int(b.tensor_type) == int(gguf.GGMLQuantizationType.F32)
                      else np.asarray(b.data, dtype=np.float32).ravel().copy() if b is not None
                      else np.zeros(0, np.float32))
    return routers, biases


def engine_facts(path: Union[str, os.PathLike, GGUFFile]) -> EngineFacts:
    """Reads the facts the engine needs from a GGUF file (one validated reader,
    :func:`hybrimoe.model.reader.open_gguf`).

    Raises:
        FileNotFoundError, ValueError: as :func:`hybrimoe.model.reader.open_gguf`; not a MoE model, or its experts
            have no up (or fused gate_up) and down matrices.
    """
    g = path if isinstance(path, GGUFFile) else open_gguf(path)
    d = describe(g)
    if not d["has_experts"]:
        raise ValueError(f"{g.path}: not a Mixture-of-Experts model (no ffn_*_exps tensors): the MoE engine has "
                         "nothing to do")
    kinds = d["expert_tensors"]
    if "down" not in kinds or not ("up" in kinds or "gate_up" in kinds):
        raise ValueError(f"{g.path}: no up and down expert matrices ({', '.join(kinds)}): not supported by the MoE "
                         "engine")
    moe_layers = list(d["moe_layers"])
    E = int(d["n_expert"])
    eb, et, bb, sb = [], [], [], []
    for il in moe_layers:
        row_b, row_t, names = _matrix_regions(il, kinds)
        eb.append(row_b)
        et.append(row_t)
        # one expert's bias row as the engine copies it (ggml_add_id reads F32 rows; another type keeps the layer on
        # upstream's path, and its size here only makes the slot larger)
        bb.append(_per_expert_rows(g.tensors, il, names, "bias", E))
        # per-expert scales (build_lora_mm_id's w_s, one value per expert) of the gate, up and down products
        sb.append(_per_expert_rows(g.tensors, il, ("gate", "up", "down"), "scale", E))
    routers, biases = _routers(g, moe_layers, E, int(d["n_embd"]))
    variants = d["expert_variants"].values()
    return EngineFacts(path=os.fspath(g.path), arch=d["architecture"], n_layer=int(d["n_layer"]), n_expert=E,
                       top_k=int(d["n_expert_used"]), n_embd=int(d["n_embd"]), moe_layers=moe_layers,
                       expert_bytes=eb, expert_types=et, bias_bytes=bb if any(any(r) for r in bb) else [],
                       scale_bytes=sb if any(any(r) for r in sb) else [], routers=routers, router_bias=biases,
                       sigmoid_gating=d["gating"] == "sigmoid",
                       # for the hardware files' cost model (hybrimoe.policy.hardware.cost_model_from_hardware)
                       model=facts_from_description(d),
                       variants={il: v["name"] for il, v in d["expert_variants"].items()},
                       weight_before_ffn=any(v["weight_before_ffn"] for v in variants),
                       clamped=any(v["clamp_form"] for v in variants))


def ram_slot_bytes(model_path: Union[str, os.PathLike]) -> int:
    """Bytes of one RAM-tier expert slot of the model at ``model_path`` (:attr:`EngineFacts.ram_slot_bytes`): the unit
    ``moe_ram_cache`` budgets in bytes are rounded down to. Raises as :func:`engine_facts`."""
    return engine_facts(model_path).ram_slot_bytes


def slot_bytes(model_path: Union[str, os.PathLike]) -> int:
    """Bytes of one GPU expert slot for a model: ``moe_cache`` budgets are whole slots of this size."""
    return engine_facts(model_path).slot_bytes
