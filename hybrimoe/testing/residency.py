"""Which file pages of a model are in RAM: the oracle of the tests that say the loader or the engine did not read
the routed experts (mincore(2) on this process's mappings of the file, found in /proc/self/maps).

Count only pages wholly inside an expert tensor (:func:`expert_pages`), so that a neighbour's pages, which the
loader pre-reads, do not blur the figure; drop the file from the page cache first
(:func:`hybrimoe.runtime.disk_calibration.drop_from_page_cache`)."""
from __future__ import annotations

import ctypes
import mmap
import os

PAGE = mmap.PAGESIZE


def expert_pages(path) -> list[tuple[int, int]]:
    """File offset ranges ``[begin, end)`` (bytes) of the whole pages inside routed-expert weight tensors
    (``*_exps.weight``) of the GGUF file ``path``."""
    from gguf import GGUFReader

    out = []
    for t in GGUFReader(str(path)).tensors:
        if t.name.endswith("_exps.weight"):
            begin = -(-int(t.data_offset) // PAGE) * PAGE
            end = (int(t.data_offset) + int(t.n_bytes)) // PAGE * PAGE
            if end > begin:
                out.append((begin, end))
    return out


def mappings(path) -> list[tuple[int, int, int]]:
    """This process's mappings of ``path``: ``(address, end address, file offset)``."""
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, int(parts[2], 16)))
    return out


def resident_pages(path, ranges) -> tuple[set, int]:
    """``(resident pages, page count)`` of the file offset ``ranges`` that this process maps: the resident ones as
    file offsets (bytes), by mincore(2).

    Raises:
        AssertionError: the process does not map ``path``.
        OSError: mincore failed.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    maps = mappings(path)
    assert maps, f"{path} is not mapped by this process"
    resident, total = set(), 0
    for begin, end in ranges:
        for lo, hi, off in maps:
            a, b = max(begin, off), min(end, off + (hi - lo))
            if a >= b:
                continue
            n = (b - a) // PAGE
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(ctypes.c_void_p(lo + (a - off)), b - a, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            resident.update(a + i * PAGE for i in range(n) if vec[i] & 1)
            total += n
    return resident, total


def cold_expert_pages(path) -> tuple[list[tuple[int, int]], set, int]:
    """The starting point of a residency test: ``(expert page ranges, pages resident after hybrimoe's own header
    check, page count)``. Drops ``path`` from the page cache, parses its header as hybrimoe does (``open_gguf``,
    whose reads may bring a few expert pages in), measures, and drops the file again, so that the run under test
    starts cold and its residency can be compared with the check's.

    Raises:
        OSError: the file cannot be read or dropped.
    """
    from hybrimoe.model.reader import open_gguf
    from hybrimoe.runtime.disk_calibration import drop_from_page_cache

    pages = expert_pages(path)
    drop_from_page_cache(path)
    g = open_gguf(path)
    by_check, total = resident_pages(path, pages)
    del g
    drop_from_page_cache(path)
    return pages, by_check, total
