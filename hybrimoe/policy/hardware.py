"""Hardware files: the machines the simulator times and the planner's default costs come from, and the cost model
and truth model derived from one for a model.

Hardware JSON, schema ``hybrimoe.hardware/1`` (the bundled files are in ``hybrimoe/policy/hardware_files/``; users
name them with ``--hardware NAME`` or give a path): ``name``, ``description`` and ``facts``: ``{fact: {"value":
number, "source": str}}`` with the facts in :data:`HARDWARE_FACTS`. :func:`cost_model_from_hardware` turns one and a
model's facts into a CostModel; :func:`resolve_cost_model` is the one place a ``moe_cost_model`` /
``--moe-cost-model`` value (a hardware name or file, a cost-model file, a CostModel) becomes the planner's costs.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hybrimoe import _core
from hybrimoe.envs import DEFAULT_COST_HARDWARE
from hybrimoe.model.facts import ModelFacts
from hybrimoe.policy.cost_model import COST_MODEL_SCHEMAS, CostModelError, cost_model_from_dict

HARDWARE_DIR = Path(__file__).resolve().parent / "hardware_files"
HARDWARE_SCHEMA = "hybrimoe.hardware/1"
HARDWARE_FACTS = ("gpu_mem_bandwidth_Bps", "gpu_mem_efficiency", "gpu_effective_flops", "gpu_kernel_launch_s",
                  "gpu_kernels_per_expert", "gpu_kernels_per_layer", "cpu_mem_bandwidth_Bps", "cpu_mem_efficiency",
                  "cpu_effective_flops", "cpu_startup_s", "h2d_bandwidth_Bps", "h2d_latency_s", "gpu_memory_bytes")
#: facts a hardware file may leave out (files written before them load): the host's RAM, bytes; ``gpu_count``, the
#: GPUs of the host (1 when left out), each as the GPU facts describe it; ``gpus_per_link``, how many of them share
#: one host link (1 when left out: each its own; more: all copy over one, e.g. behind one PCIe switch)
HARDWARE_OPTIONAL_FACTS = ("host_memory_bytes", "gpu_count", "gpus_per_link")
DISK_DIR = Path(__file__).resolve().parent / "disk_files"
DISK_SCHEMA = "hybrimoe.disk/1"
#: a disk file's facts: sequential read bytes/s, seconds before one read's data flows, reads in flight that gain
DISK_FACTS = ("read_bandwidth_Bps", "read_latency_s", "queue_depth")
#: facts a disk file may leave out, measured by ``hybrimoe calibrate --disk`` on the machine itself:
#: ``read_cpu_s_per_byte``, wall seconds by which each byte the RAM tier reads delays a CPU share running beside it
#: (its I/O workers' CPU time per byte over the host's cores; left out: 0, spare cores absorb it);
#: ``mmap_read_around``, bytes the kernel reads per byte of an expert faulted in through a mapping (>= 1; left out:
#: 1); ``mmap_fault_bytes``, bytes one such page fault reads (left out: 128 KiB, Linux's default read_ahead_kb);
#: ``mmap_fault_Bps``, bytes per second the disk delivers to a decode's page faults under memory pressure (their
#: latency and the kernel's work per fault included; left out: the queued figures above, a latency per fault);
#: ``tier_read_Bps``, bytes per second of cold reads as the RAM tier makes them (O_DIRECT where the file system
#: takes it) with its I/O workers in flight (the engine's own reads; left out: read_bandwidth_Bps);
#: ``buffered_read_Bps``, bytes per second of cold reads through the page cache (the reads of systems that read that
#: way: a prefill's faults through a mapping, preads that warm the page cache; left out: read_bandwidth_Bps). The
#: two differ where direct reads land in huge pages and the page cache's in 4 KiB ones: on this project's machine
#: 3.1 against 1.3-1.6 GB/s.
DISK_OPTIONAL_FACTS = ("read_cpu_s_per_byte", "mmap_read_around", "mmap_fault_bytes", "mmap_fault_Bps",
                       "tier_read_Bps", "buffered_read_Bps")


def hardware_names() -> list[str]:
    """Names of the bundled hardware files (``hybrimoe/policy/hardware_files/*.json``)."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))


@dataclass
class Hardware:
    """A hardware file's contents: ``facts[name] = value`` (SI units) and ``sources[name]`` (why that number)."""

    name: str
    description: str
    facts: dict
    sources: dict


def _read_facts(name_or_path: str, directory: Path, schema: str, required: tuple, optional: tuple = (),
                what: str = "hardware preset") -> tuple[Path, dict, dict, dict]:
    """(path, document, facts, sources) of a facts file: a bundled name in ``directory`` or a ``.json`` path, of
    ``schema``, with every ``required`` fact (and those of ``optional`` it has) a positive finite ``value`` with a
    ``source`` string. Raises ValueError for an unknown name, CostModelError naming the file and the problem."""
    p = Path(name_or_path)
    if not p.suffix == ".json":
        p = directory / f"{name_or_path}.json"
        if not p.is_file():
            known = ", ".join(sorted(q.stem for q in directory.glob("*.json")))
            raise ValueError(f"unknown {what} '{name_or_path}' (known: {known}), and no such file either (a "
                             f"{what} or cost-model file is a .json path)")
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise CostModelError(f"cannot read {what} {p}: {e}") from e
    except json.JSONDecodeError as e:
        raise CostModelError(f"{what} {p} is not valid JSON: {e}") from e
    if not isinstance(d, dict) or d.get("schema") != schema or not isinstance(d.get("facts"), dict):
        raise CostModelError(f"{what} {p}: expected schema '{schema}' with a 'facts' object")
    facts, sources = {}, {}
    for f in required + tuple(o for o in optional if o in d["facts"]):
        entry = d["facts"].get(f)
        if not isinstance(entry, dict) or "value" not in entry:
            raise CostModelError(f"{what} {p}: missing fact '{f}' ({{'value': ..., 'source': ...}})")
        v = entry["value"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise CostModelError(f"{what} {p}: fact '{f}' must be a positive number, got {v!r}")
        if not isinstance(entry.get("source"), str) or not entry["source"].strip():
            raise CostModelError(f"{what} {p}: fact '{f}' has no source")
        facts[f], sources[f] = float(v), entry["source"]
    return p, d, facts, sources


def load_hardware(name_or_path: str) -> Hardware:
    """Loads a bundled hardware file by name (see :func:`hardware_names`) or a hardware JSON file by path.
    :data:`HARDWARE_OPTIONAL_FACTS` (the host's RAM) are in ``facts`` only where the file has them.

    Raises ValueError naming an unknown preset, and CostModelError for corrupt JSON, a wrong schema, or a fact
    that is missing, not a positive finite number, or without a source string.
    """
    p, d, facts, sources = _read_facts(name_or_path, HARDWARE_DIR, HARDWARE_SCHEMA, HARDWARE_FACTS,
                                       HARDWARE_OPTIONAL_FACTS)
    return Hardware(name=str(d.get("name", p.stem)), description=str(d.get("description", "")), facts=facts,
                    sources=sources)


def disk_names() -> list[str]:
    """Names of the bundled disk files (``hybrimoe/policy/disk_files/*.json``)."""
    return sorted(p.stem for p in DISK_DIR.glob("*.json"))


def load_disk(name_or_path: str) -> Hardware:
    """Loads a bundled disk file by name (see :func:`disk_names`) or a disk JSON file by path (schema
    ``hybrimoe.disk/1``: ``name``, ``description`` and ``facts`` as a hardware file's, the facts
    :data:`DISK_FACTS`: sequential read bandwidth in bytes/s, the latency of one read in seconds, and how many reads
    in flight still gain throughput), and those of :data:`DISK_OPTIONAL_FACTS` it has. Returned as a
    :class:`Hardware` record of those facts.

    Raises ValueError naming an unknown disk, and CostModelError for corrupt JSON, a wrong schema, or a fact that is
    missing, not a positive finite number (queue depth: at least 1), or without a source string.
    """
    p, d, facts, sources = _read_facts(name_or_path, DISK_DIR, DISK_SCHEMA, DISK_FACTS, DISK_OPTIONAL_FACTS,
                                       what="disk")
    if facts["queue_depth"] < 1:
        raise CostModelError(f"disk {p}: fact 'queue_depth' must be >= 1, got {facts['queue_depth']!r}")
    if facts.get("mmap_read_around", 1.0) < 1:
        raise CostModelError(f"disk {p}: fact 'mmap_read_around' must be >= 1 (bytes read per byte faulted), got "
                             f"{facts['mmap_read_around']!r}")
    if facts.get("mmap_fault_bytes", 4096.0) < 4096:
        raise CostModelError(f"disk {p}: fact 'mmap_fault_bytes' must be >= 4096 (one page), got "
                             f"{facts['mmap_fault_bytes']!r}")
    return Hardware(name=str(d.get("name", p.stem)), description=str(d.get("description", "")), facts=facts,
                    sources=sources)


def set_disk(cm: "_core.CostModel", disk: Optional[Hardware]) -> "_core.CostModel":
    """Puts a disk's figures (:func:`load_disk`) into ``cm`` (``disk_bandwidth_Bps``, ``disk_latency_s``,
    ``disk_queue_depth``), or no disk figures for None; returns ``cm``, validated."""
    if disk is None:
        cm.disk_bandwidth_Bps, cm.disk_latency_s, cm.disk_queue_depth = 0.0, 0.0, 1.0
    else:
        cm.disk_bandwidth_Bps = disk.facts["read_bandwidth_Bps"]
        cm.disk_latency_s = disk.facts["read_latency_s"]
        cm.disk_queue_depth = disk.facts["queue_depth"]
    cm.validate()
    return cm


def cost_model_from_hardware(hw: Hardware, model: ModelFacts, disk: Optional[Hardware] = None) -> "_core.CostModel":
    """Derives a CostModel for ``model`` on ``hw`` (docs/design.md §1 and §6), with ``disk``'s figures
    (:func:`load_disk`; None: no disk figures, every expert in RAM).

    - CPU expert: reading its bytes at the effective host bandwidth (a decode-time expert is bandwidth bound), plus
      2*params FLOP per token at the effective CPU throughput; start-up from the preset.
    - GPU expert: kernel launches + reading its bytes at effective GPU bandwidth, plus 2*params FLOP per token.
    - Copy: the preset's effective link bandwidth and latency.
    - Activations: hidden state (fp32, n_embd) to the GPU and back per token, plus two link latencies.
    - Non-expert work of a layer (attention, router, shared experts, norms) and dense layers: launches + weight
      bytes at GPU bandwidth, plus 2*params FLOP per token; counts and bytes are the model's facts (a GGUF's real
      tensors with :func:`hybrimoe.model.facts.facts_from_gguf`; params x bytes per param where only counts are known).
    - Copies overlap compute (``copy_overlap`` 1): an assumption for discrete GPUs, whose copy engines run beside the
      compute queue (the engine copies on a second stream).
    - What copies cost the CPU share (``cpu_copy_overlap = 1 - h2d bandwidth / effective host bandwidth``, at
      least 0): an assumption of the planner: a copy's DMA reads host memory at the link's bandwidth, which a
      bandwidth-bound CPU expert running beside it loses (the copy-aware planner charges that share of every copy
      queued for a layer to its CPU share). The simulator's truth model charges the same physics in another form,
      per overlapped second (:func:`truth_model_for`); HybriMoE §IV.B itself keeps PCIe on a timeline of its own.
    """
    f = hw.facts
    gpu_bw = f["gpu_mem_bandwidth_Bps"] * f["gpu_mem_efficiency"]
    cpu_bw = f["cpu_mem_bandwidth_Bps"] * f["cpu_mem_efficiency"]
    launch = f["gpu_kernel_launch_s"]
    cm = _core.CostModel()
    cm.cpu_a_s = model.expert_bytes / cpu_bw
    cm.cpu_b_s = 2.0 * model.expert_params / f["cpu_effective_flops"]
    cm.cpu_c_s = 0.0
    cm.cpu_startup_s = f["cpu_startup_s"]
    cm.gpu_a_s = f["gpu_kernels_per_expert"] * launch + model.expert_bytes / gpu_bw
    cm.gpu_b_s = 2.0 * model.expert_params / f["gpu_effective_flops"]
    cm.h2d_bandwidth_Bps = f["h2d_bandwidth_Bps"]
    cm.h2d_latency_s = f["h2d_latency_s"]
    cm.act_a_s = 2.0 * f["h2d_latency_s"]
    cm.act_b_s = 2.0 * model.n_embd * 4 / f["h2d_bandwidth_Bps"]
    ne_bytes = model.moe_layer_other_bytes()
    cm.layer_a_s = f["gpu_kernels_per_layer"] * launch + ne_bytes / gpu_bw
    cm.layer_b_s = 2.0 * model.non_expert_params_per_moe_layer / f["gpu_effective_flops"]
    dense_bytes = model.dense_bytes()
    cm.dense_a_s = f["gpu_kernels_per_layer"] * launch + dense_bytes / gpu_bw
    cm.dense_b_s = 2.0 * model.dense_layer_params / f["gpu_effective_flops"]
    cm.copy_overlap = 1.0
    cm.cpu_copy_overlap = max(0.0, 1.0 - f["h2d_bandwidth_Bps"] / cpu_bw)
    return set_disk(cm, disk)


def truth_model_for(hw: Hardware, seed: int = 1) -> "_core.TruthModel":
    """The simulator's "truth" (what the planner does not see), documented assumptions:

    per-task log-normal noise (CPU 10%, GPU 5%, copy 5%, activations 10%, non-expert 3%), an extra first-CPU-expert
    overhead of half the planned start-up, and memory-bandwidth contention: while the link copies from host memory,
    CPU experts slow by (link bandwidth / effective host bandwidth) of the overlapped time.
    """
    t = _core.TruthModel()
    t.seed = int(seed)
    t.cpu_startup_extra_s = 0.5 * hw.facts["cpu_startup_s"]
    t.contention = hw.facts["h2d_bandwidth_Bps"] / (hw.facts["cpu_mem_bandwidth_Bps"] *
                                                    hw.facts["cpu_mem_efficiency"])
    t.validate()
    return t


def resolve_cost_model(spec, model: Optional[ModelFacts]) -> "_core.CostModel":
    """The planner's cost model for ``model``: ``spec`` None (the default hardware,
    :data:`hybrimoe.envs.DEFAULT_COST_HARDWARE`), a bundled hardware name or a hardware JSON file (schema
    ``hybrimoe.hardware/1``: :func:`cost_model_from_hardware`), a cost-model JSON file (schema
    ``hybrimoe.cost_model/4``, ``/3``, ``/2`` or ``/1``), or a CostModel (validated).

    Raises:
        ValueError (CostModelError): another type; an unknown name, a missing or unreadable file, a file of neither
            schema, an invalid cost model; a hardware spec without ``model`` facts to derive costs for.
    """
    if isinstance(spec, _core.CostModel):
        spec.validate()
        return spec
    if spec is not None and not isinstance(spec, (str, os.PathLike)):
        raise ValueError(f"moe_cost_model must be a hardware name, a JSON file path or a CostModel, not "
                         f"{type(spec).__name__}")
    name = DEFAULT_COST_HARDWARE if spec is None else os.fspath(spec)
    looks_like_file = name.endswith(".json") or os.sep in name
    if looks_like_file and not os.path.isfile(name):
        what = "is a directory" if os.path.isdir(name) else "does not exist"
        raise CostModelError(f"cost model {name} {what} (give a cost-model or hardware-preset JSON file, or a "
                             f"preset name: {', '.join(hardware_names())})")
    if os.path.isfile(name):
        try:
            with open(name) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise CostModelError(f"{name}: cannot read the cost model: {e}") from None
        schema = doc.get("schema") if isinstance(doc, dict) else None
        if schema in COST_MODEL_SCHEMAS:
            return cost_model_from_dict(doc, f"cost model {name}")  # the document read above, not again
        if schema != HARDWARE_SCHEMA:
            got = f"schema {schema!r}" if isinstance(doc, dict) and "schema" in doc else "no schema"
            raise CostModelError(f"{name}: {got}: neither a cost model ({', '.join(COST_MODEL_SCHEMAS)}) "
                                 f"nor a hardware preset ({HARDWARE_SCHEMA})")
    hw = load_hardware(name)
    if model is None:
        raise CostModelError(f"{name}: a hardware file gives costs for a model's facts, and none are known")
    return cost_model_from_hardware(hw, model)
