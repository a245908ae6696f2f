"""The RAM expert tier's set-up (``Llama(moe_ram_cache=...)``, ``--moe-ram-cache``): for a model larger than RAM.

The routed experts stay unread at load (patch 0007, ``lazy_experts``); the engine keeps ``n_slots`` of them in a host
slot pool chosen by a cache policy of its own (MRS by default) and reads the others from the GGUF file, on demand
and ahead of their layer by the router look-ahead (``src/runtime/ram_tier.h``). This module turns the user's budget
into RAM slots, finds where each expert lies in the file (every shard of a split model), and says what the machine
has. Units: bytes.

Rules: the budget is for the routed experts only (``"40%"`` of their bytes, ``"12GiB"``, bytes, or ``"auto"``); a
prefill ubatch can route to every expert of a layer, and a layer's experts must all be in RAM while it computes, so
the smallest budget is ``min(n_expert, n_ubatch * top_k)`` slots (refused below, with the number); a budget above
the machine's memory (or the process's memory cgroup limit) is refused with both numbers. ``use_mlock`` is refused
(it would lock every expert page of the mapping). The weights outside the experts are read into RAM at load
(``use_mmap=False`` is the tier's default; the experts' mapping is never touched): left in the page cache, memory
pressure would evict them and every ubatch would fault them back in. CPU weights are placed as upstream places them
(repacked where ggml-cpu has kernels for their type, unless ``no_repack``), the RAM slots included: each expert matrix
is repacked after its read, so the CPU share runs upstream's repacked kernels; under a GPU cache the slots keep the
file's layout (the GPU copies read them).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from hybrimoe.model.reader import open_gguf
from hybrimoe.policy.budget import parse_budget
from hybrimoe.runtime.engine_facts import EngineFacts

#: I/O workers reading experts from the file (reads in flight at most): ``hybrimoe calibrate --disk`` found this
#: machine's virtual disk best at queue depths 4-16 (docs/benchmarks.md)
IO_THREADS = 4
#: ``"auto"`` leaves this share of the memory it finds free (at least AUTO_MARGIN_MIN_BYTES) to everything else
AUTO_MARGIN_FRACTION = 0.10
AUTO_MARGIN_MIN_BYTES = 512 << 20


def _cgroup_limit() -> tuple[Optional[int], Optional[int]]:
    """(limit, usage) in bytes of this process's memory cgroup (v2 ``memory.max``/``memory.current``, else v1's
    ``memory.limit_in_bytes``/``memory.usage_in_bytes``); None where there is no limit or it cannot be read."""
    try:
        rel_v1 = rel_v2 = None
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            if parts[0] == "0":
                rel_v2 = parts[2]
            elif "memory" in parts[1].split(","):
                rel_v1 = parts[2]
        for base, rel, lim, cur in (("/sys/fs/cgroup/memory", rel_v1, "memory.limit_in_bytes", "memory.usage_in_bytes"),
                                    ("/sys/fs/cgroup", rel_v2, "memory.max", "memory.current")):
            if rel is None:
                continue
            d = Path(base + rel)
            if (d / lim).exists():
                raw = (d / lim).read_text().strip()
                if raw == "max" or not raw.isdigit() or int(raw) >= 1 << 60:
                    return None, None
                return int(raw), int((d / cur).read_text().strip())
    except OSError:
        pass
    return None, None


def machine_memory() -> dict:
    """What memory this process can have: ``total`` (MemTotal, or the memory cgroup's limit when lower),
    ``available`` (MemAvailable, or what the cgroup has left when lower), ``source`` (a phrase naming which),
    ``cgroup`` (whether the cgroup's figures were taken: its usage counts the page cache the process brought in).

    Raises:
        OSError: /proc/meminfo cannot be read.
    """
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        m = re.match(r"(\w+):\s+(\d+) kB", line)
        if m:
            info[m.group(1)] = int(m.group(2)) * 1024
    total, avail = info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    source, cgroup = "MemTotal / MemAvailable (/proc/meminfo)", False
    limit, usage = _cgroup_limit()
    if limit is not None and limit < total:
        total, cgroup = limit, True
        source = "the process's memory cgroup limit less its usage"
        avail = min(avail, max(0, limit - (usage or 0)))
    return {"total": int(total), "available": int(avail), "source": source, "cgroup": cgroup}


def expert_file_ranges(facts: EngineFacts) -> dict:
    """Where each MoE layer's routed experts lie in the model's files, as the engine's RAM tier reads them.

    Returns ``files`` (paths: the one file, or every shard of a split model), ``sizes`` and ``mtimes_ns`` (each
    file's now: the engine refuses a file that changed since), ``file_of`` (per MoE layer, per matrix region: gate or
    fused gate_up, up, down, the file index or -1 where the layer has no such matrix) and ``offset_of`` (the byte
    offset of expert 0's matrix; expert e's is ``facts.expert_bytes[layer][region]`` further per expert).

    Raises:
        ValueError: a matrix the facts name is not in the file, or its size is not ``n_expert`` experts' bytes.
    """
    g = open_gguf(facts.path)
    where = g.tensor_shard
    files: list[str] = []
    index: dict[str, int] = {}
    file_of, offset_of = [], []
    for ml, il in enumerate(facts.moe_layers):
        fused = f"blk.{il}.ffn_gate_up_exps.weight" in where
        names = (f"blk.{il}.ffn_gate_up_exps.weight" if fused else f"blk.{il}.ffn_gate_exps.weight",
                 None if fused else f"blk.{il}.ffn_up_exps.weight", f"blk.{il}.ffn_down_exps.weight")
        fo, oo = [], []
        for r, name in enumerate(names):
            eb = int(facts.expert_bytes[ml][r])
            if eb == 0:
                fo.append(-1)
                oo.append(0)
                continue
            if name not in where:
                raise ValueError(f"{facts.path}: MoE layer {il} has no tensor {name}")
            path, off = where[name]
            n_bytes = int(g.tensors[name].n_bytes)
            if n_bytes != eb * facts.n_expert:
                raise ValueError(f"{facts.path}: {name} has {n_bytes} bytes, not {facts.n_expert} experts of {eb}")
            key = os.fspath(path)
            if key not in index:
                index[key] = len(files)
                files.append(key)
            fo.append(index[key])
            oo.append(int(off))
        file_of.append(tuple(fo))
        offset_of.append(tuple(oo))
    stats = [os.stat(f) for f in files]
    return {"files": files, "sizes": [int(s.st_size) for s in stats], "mtimes_ns": [int(s.st_mtime_ns) for s in stats],
            "file_of": file_of, "offset_of": offset_of}


def min_ram_slots(facts: EngineFacts, n_ubatch: int) -> int:
    """The fewest RAM slots the tier runs with: every expert one layer's ubatch of ``n_ubatch`` tokens can route to
    (``min(n_expert, n_ubatch * top_k)``), which must all be in RAM while the layer computes."""
    return int(min(facts.n_expert, max(1, int(n_ubatch)) * facts.top_k))


def ram_slots(spec, facts: EngineFacts, n_ubatch: int, memory: Optional[dict] = None,
              ubatch_hint: bool = True) -> tuple[int, str]:
    """RAM expert slots for a ``moe_ram_cache`` budget that is not ``"auto"``: ``(slots, why)``.

    ``spec``: ``"40%"`` (of the routed experts' bytes), ``"12GiB"``, ``"512MB"`` or bytes; rounded down to whole
    slots of ``facts.ram_slot_bytes``, at most one per expert. ``memory``: :func:`machine_memory` (read when None).
    ``ubatch_hint``: a budget below the minimum suggests a smaller ``n_ubatch`` where one would help (False where the
    caller's ubatch is not the user's to choose).

    Raises:
        ValueError: unparsable or negative; below :func:`min_ram_slots` (the number of slots and bytes named); more
            than the machine's (or the cgroup's) memory (both numbers named).
    """
    sb = facts.ram_slot_bytes
    n_all = len(facts.moe_layers) * facts.n_expert
    try:
        b = parse_budget(spec, float(n_all * sb), sb, allow_zero=False)
    except ValueError as e:
        raise ValueError(f"moe_ram_cache: {e}") from None
    mem = memory or machine_memory()
    if b > mem["total"]:
        raise ValueError(f"moe_ram_cache={spec!r} is {b:.0f} bytes, more than the {mem['total']} bytes this machine "
                         f"has ({mem['source']})")
    n = min(n_all, int(b // sb + 1e-9))
    need = min_ram_slots(facts, n_ubatch)
    if n < need:
        fewer = ubatch_hint and min_ram_slots(facts, 1) < need  # a smaller ubatch routes to fewer experts
        raise ValueError(f"moe_ram_cache={spec!r} holds {n} expert{'' if n == 1 else 's'} of {sb} bytes; a ubatch of "
                         f"{n_ubatch} token{'' if n_ubatch == 1 else 's'} can "
                         f"route to {need} experts of one layer, which must all be in RAM while it computes: give at "
                         f"least {need * sb} bytes, {need} RAM slots of {sb} bytes ({100.0 * need / n_all:.1f}% of the "
                         "routed experts)"
                         + (", or a smaller n_ubatch" if fewer else ""))
    return n, f"moe_ram_cache={spec!r}: {n} of {n_all} experts in RAM slots of {sb} bytes"


def staging_bytes(facts: EngineFacts, io_threads: int = IO_THREADS) -> int:
    """Bytes of the I/O workers' O_DIRECT staging buffers (src/runtime/ram_tier.cpp's StagingBuffer): one per
    worker, the largest expert matrix rounded out to 4 KiB at both ends, in whole 2 MiB huge pages."""
    largest = max((int(b) for eb in facts.expert_bytes for b in eb), default=0)
    huge = 2 << 20
    return int(io_threads) * ((largest + 2 * 4096 + huge - 1) // huge * huge)


def auto_ram_slots(facts: EngineFacts, n_ubatch: int, other_bytes: int, memory: Optional[dict] = None
                   ) -> tuple[int, str]:
    """``moe_ram_cache="auto"``, once the model is loaded: the memory available now (:func:`machine_memory`: the
    KV cache and compute buffers are allocated by then, so already out of it) less the I/O workers' staging buffers
    (:func:`staging_bytes`), less ``other_bytes`` (the model's
    weights outside the routed experts, which stay in RAM or in the page cache; not subtracted under a memory
    cgroup, whose usage counts them already) and a margin
    (:data:`AUTO_MARGIN_FRACTION`, at least :data:`AUTO_MARGIN_MIN_BYTES`), in whole slots, at most one per
    expert. Returns ``(slots, why)``.

    Raises:
        ValueError: fewer slots than :func:`min_ram_slots` fit (the numbers named).
    """
    mem = memory or machine_memory()
    sb = facts.ram_slot_bytes
    n_all = len(facts.moe_layers) * facts.n_expert
    margin = max(AUTO_MARGIN_MIN_BYTES, int(mem["available"] * AUTO_MARGIN_FRACTION))
    # MemAvailable counts the page cache as free, the other weights' pages among it; a cgroup's usage counts them
    if mem.get("cgroup"):
        other_bytes = 0
    staging = staging_bytes(facts)
    room = int(mem["available"]) - int(other_bytes) - margin - staging
    n = max(0, min(n_all, room // sb)) if room > 0 else 0
    other = ("the weights outside the routed experts counted in its usage" if mem.get("cgroup") else
             f"less {other_bytes} for the weights outside the routed experts")
    why = (f"auto: {mem['available']} bytes available ({mem['source']}) after the load, {other}, {staging} for the "
           f"I/O workers' staging buffers and a margin of {margin}: {n} of {n_all} experts in RAM slots of {sb} bytes")
    need = min_ram_slots(facts, n_ubatch)
    if n < need:
        fewer = min_ram_slots(facts, 1) < need
        raise ValueError(f"moe_ram_cache='auto' found room for {n} experts ({why}); a ubatch of {n_ubatch} tokens "
                         f"needs {need} of one layer in RAM at once: free memory"
                         + (", or give a smaller n_ubatch" if fewer else ""))
    return int(n), why
