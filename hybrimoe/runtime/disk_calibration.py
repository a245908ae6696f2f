"""Measures the disk a model is read from, on the model's own file: the three figures the simulator's disk model
takes (docs/design.md §17; ``hybrimoe.policy.hardware.load_disk``): sequential read bandwidth (bytes/s), the
latency of one read (seconds) and how many reads in flight still gain throughput; and two costs of this machine
around them (``hybrimoe.policy.hardware.DISK_OPTIONAL_FACTS``): the CPU time the RAM tier's reads take (its own
read path: O_DIRECT straight into the slot, or into an aligned staging buffer and a copy where a matrix is not a
whole number of 4 KiB pages, by its 4 I/O workers), and what a
page fault through the file's mapping reads (upstream llama.cpp's mmap: the kernel's read-around of a fault).

Every read is cold: the model's files are dropped from the page cache first (POSIX_FADV_DONTNEED, which drops the
clean pages no process maps) and no byte is read twice, so the figures are the device's, not the page cache's. The
reads are the RAM tier's own: whole experts' matrices (one ``ffn_*_exps`` expert slice, ggml ``nb[2]`` bytes, at a
random expert of a random MoE layer), by ``depth`` threads at once, read as the RAM tier reads them: O_DIRECT into
a 2 MiB-aligned staging buffer on transparent huge pages per thread (buffered ``os.pread`` where O_DIRECT is off or
refused). A virtual disk can
still be served from the host's cache, which this process cannot drop: the result then says so when cold reads run
about as fast as warm ones.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import random
import resource
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hybrimoe.model.reader import open_gguf
from hybrimoe.model.tables import EXPERT_TENSOR_RE

#: reads in flight tried (threads issuing preads at once)
DEPTHS = (1, 2, 4, 8, 16)
#: a depth reaches the bandwidth when it gets this fraction of the best depth's throughput
SATURATION = 0.9
#: cold reads of 4 KiB timed one at a time for the latency
LATENCY_READS = 32
#: cold reads slower than warm ones by less than this factor: probably served from a cache below this machine
HOST_CACHE_RATIO = 1.5


@dataclass
class DiskMeasurement:
    """What :func:`measure_disk` found. Bandwidths in bytes/s, times in seconds."""

    read_bandwidth_Bps: float
    read_latency_s: float
    queue_depth: int
    per_depth_Bps: dict = field(default_factory=dict)   # depth -> cold throughput
    warm_Bps: float = 0.0                                # the last pass's reads again, from the page cache
    read_bytes: int = 0                                  # bytes per read (one expert matrix, the median)
    bytes_read: int = 0                                  # cold bytes read in all
    files: list = field(default_factory=list)
    host_cache_suspected: bool = False
    read_cpu_s_per_byte: float = 0.0                     # wall seconds a CPU share loses per byte the tier reads
    read_cpu_source: str = ""
    mmap_read_around: float = 0.0                        # bytes read per byte faulted through a mapping (0: none)
    mmap_fault_bytes: float = 0.0                        # bytes read per major fault
    mmap_fault_Bps: float = 0.0                          # bytes/s read for a decode's faults (0: not measured)
    mmap_source: str = ""
    direct: bool = False                                 # the cold passes read O_DIRECT (the RAM tier's way)
    tier_Bps: float = 0.0                                # cold throughput at the RAM tier's IO_WORKERS in flight
    buffered_Bps: float = 0.0                            # cold throughput through the page cache (best over depths)
    buffered_per_depth_Bps: dict = field(default_factory=dict)

    def to_disk_file(self, name: str) -> dict:
        """A ``hybrimoe.disk/1`` document (``hybrimoe simulate --disk FILE`` reads it), sources naming the run."""
        when = time.strftime("%Y-%m-%d")
        where = ", ".join(str(f) for f in self.files)
        how = ("cold O_DIRECT reads into 2 MiB-aligned huge-page staging buffers (the RAM tier's reads)" if
               self.direct else "cold buffered preads")
        base = (f"measured by hybrimoe calibrate --disk on {when}: {how} of {self.read_bytes} B expert matrices of "
                f"{where}")
        note = (" (cold reads ran at nearly page-cache speed: probably served from a cache below this machine)"
                if self.host_cache_suspected else "")
        depths = ", ".join(f"{d}: {v / 1e9:.3g} GB/s" for d, v in sorted(self.per_depth_Bps.items()))
        buffered = ", ".join(f"{d}: {v / 1e9:.3g} GB/s" for d, v in sorted(self.buffered_per_depth_Bps.items()))
        return {
            "schema": "hybrimoe.disk/1",
            "name": name,
            "description": f"the disk holding {where}, as measured" + note,
            "facts": {
                "read_bandwidth_Bps": {"value": self.read_bandwidth_Bps,
                                       "source": f"{base}; best throughput over reads in flight ({depths}){note}"},
                "read_latency_s": {"value": self.read_latency_s,
                                   "source": f"{base}; median of {LATENCY_READS} cold 4 KiB reads, one at a time"},
                "queue_depth": {"value": self.queue_depth,
                                "source": f"{base}; fewest reads in flight reaching {SATURATION:.0%} of the best "
                                          f"throughput"},
                **({"read_cpu_s_per_byte": {"value": self.read_cpu_s_per_byte, "source": self.read_cpu_source}}
                   if self.read_cpu_s_per_byte > 0 else {}),
                **({"mmap_read_around": {"value": self.mmap_read_around, "source": self.mmap_source},
                    "mmap_fault_bytes": {"value": self.mmap_fault_bytes, "source": self.mmap_source}}
                   if self.mmap_read_around >= 1 and self.mmap_fault_bytes >= 4096 else {}),
                **({"mmap_fault_Bps": {"value": self.mmap_fault_Bps, "source": self.mmap_source}}
                   if self.mmap_fault_Bps > 0 else {}),
                **({"tier_read_Bps": {"value": self.tier_Bps,
                                      "source": f"{base}; the throughput with {IO_WORKERS} reads in flight, the RAM "
                                                f"tier's I/O workers{note}"}}
                   if self.tier_Bps > 0 else {}),
                **({"buffered_read_Bps": {"value": self.buffered_Bps,
                                          "source": f"measured by hybrimoe calibrate --disk on {when}: cold buffered "
                                                    f"preads (through the page cache) of {self.read_bytes} B expert "
                                                    f"matrices of {where}; best throughput over reads in flight "
                                                    f"({buffered})"}}
                   if self.buffered_Bps > 0 else {}),
            },
            "measured": {"per_depth_Bps": {str(k): v for k, v in self.per_depth_Bps.items()},
                         "buffered_per_depth_Bps": {str(k): v for k, v in self.buffered_per_depth_Bps.items()},
                         "warm_Bps": self.warm_Bps, "bytes_read": self.bytes_read,
                         "host_cache_suspected": self.host_cache_suspected},
        }


def _expert_tensors(model_path):
    """The model's routed-expert weight tensors (``ffn_*_exps``), each as (MoE layer, kind as named: "gate_exps",
    ..., file, offset, bytes per expert, experts, bytes per row)."""
    g = open_gguf(model_path)
    for name, (path, off) in g.tensor_shard.items():
        m = EXPERT_TENSOR_RE.match(name)
        if not m or m.group(3) != "weight":
            continue
        t = g.tensors[name]
        n_expert = int(t.shape[2]) if len(t.shape) > 2 else 1
        nb = int(t.n_bytes) // n_expert
        yield int(m.group(1)), m.group(2), Path(path), off, nb, n_expert, nb // max(1, int(t.shape[1]))


def _expert_reads(model_path) -> list[tuple[Path, int, int]]:
    """Every expert matrix of the model as (file, offset, bytes): what the RAM tier reads."""
    out = [(path, off + e * nb, nb) for _, _, path, off, nb, n_expert, _ in _expert_tensors(model_path)
           for e in range(n_expert)]
    if not out:
        raise ValueError(f"{model_path}: no routed-expert tensors (ffn_*_exps) to read: not a MoE model")
    return out


def disk_file_path(model_path) -> Path:
    """Where ``hybrimoe calibrate --disk`` stores the disk measured under ``model_path`` (beside the cost-model
    calibrations: hybrimoe's cache directory, ``calibration/disk--<model key>.json``)."""
    from hybrimoe.runtime.calibration import _store_dir, model_key

    return _store_dir() / f"disk--{model_key(model_path)}.json"


def drop_from_page_cache(path) -> None:
    """Asks the kernel to drop ``path``'s unmapped pages from the page cache: written pages are flushed first (fsync),
    so that they are clean, then POSIX_FADV_DONTNEED drops them.

    Raises:
        OSError: the file cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


#: the RAM tier's O_DIRECT staging buffers lie on 2 MiB transparent huge pages (src/runtime/ram_tier.cpp)
HUGE_PAGE = 2 << 20


def _anonymous(n: int) -> mmap.mmap:
    """``n`` bytes of private anonymous memory, as the RAM tier's C++ allocates (Python's ``mmap.mmap(-1, n)`` maps
    MAP_SHARED: shared memory, which takes transparent huge pages only where the kernel's ``shmem_enabled`` allows,
    "never" by default, so MADV_HUGEPAGE would do nothing on it)."""
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class _StagingBuffers:
    """One O_DIRECT staging buffer per thread as the RAM tier's workers have them: ``span`` bytes of private
    anonymous memory aligned to a 2 MiB huge page and advised MADV_HUGEPAGE (a direct read is one scatter-gather
    segment per physically contiguous run of its pages, so 4 KiB pages scattered in memory split a 2 MiB read into
    several requests: on this project's machine, 4 threads of 1.9 MB reads went at 1.43 GB/s into 4 KiB pages and
    3.08 GB/s into huge pages)."""

    def __init__(self, n: int, span: int):
        import ctypes

        want = (span + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        self._maps, self.views = [], []
        for _ in range(n):
            m = _anonymous(want + HUGE_PAGE)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            start = (-addr) % HUGE_PAGE
            if hasattr(mmap, "MADV_HUGEPAGE"):
                m.madvise(mmap.MADV_HUGEPAGE, start, want)
            view = memoryview(m)[start:start + want]
            view[:] = bytes(want)  # fault the pages in before any read is timed
            self._maps.append(m)
            self.views.append(view)

    def close(self) -> None:
        for v in self.views:
            v.release()
        for m in self._maps:
            m.close()


def _open_cold(files) -> tuple[dict, bool]:
    """The files opened for cold reads the RAM tier's way: ``({path: fd}, direct)``, O_DIRECT unless
    ``HYBRIMOE_RAM_DIRECT_IO`` is off or a file refuses it (then every file buffered: one mode for all)."""
    from hybrimoe.envs import ram_direct_io

    fds = {}
    if ram_direct_io() and hasattr(os, "O_DIRECT"):
        try:
            for p in files:
                fds[p] = os.open(p, os.O_RDONLY | os.O_DIRECT)
            return fds, True
        except OSError:
            for fd in fds.values():
                os.close(fd)
            fds = {}
    return {p: os.open(p, os.O_RDONLY) for p in files}, False


def _read_span(fd: int, buf: memoryview, path, off: int, nb: int, direct: bool) -> int:
    """Reads bytes [off, off + nb) of ``path`` (open as ``fd``) into ``buf``: with ``direct`` the page-aligned span
    around them (O_DIRECT's rule), else the bytes alone. Returns where they start in ``buf``.

    Raises:
        OSError: a short read (the file changed under us), naming the file and offset.
    """
    page = mmap.PAGESIZE
    head = off % page if direct else 0
    n = (head + nb + page - 1) // page * page if direct else nb
    got = os.preadv(fd, [buf[:n]], off - head)
    if got < head + nb:
        raise OSError(f"{path}: short read at offset {off}: {max(0, got - head)} of {nb} bytes")
    return head


def _timed_reads(fds: dict, reads: list, depth: int, direct: bool = False) -> float:
    """Seconds to pread every (file, offset, bytes) of ``reads`` with ``depth`` threads: buffered, or with
    ``direct`` (``fds`` opened O_DIRECT) the page-aligned span around each into the thread's huge-page staging
    buffer, as the RAM tier reads. Raises OSError on a short read (the file changed under us) naming the file and
    offset."""
    page = mmap.PAGESIZE
    bufs = None
    if direct:
        span = max(((off % page) + nb + page - 1) // page * page for _, off, nb in reads)
        bufs = _StagingBuffers(depth, span)
    mine = threading.local()  # each thread's staging buffer
    taken = [0]
    lock = threading.Lock()

    def one(r):
        path, off, nb = r
        if bufs is None:
            got = len(os.pread(fds[path], nb, off))
            if got != nb:
                raise OSError(f"{path}: short read at offset {off}: {got} of {nb} bytes")
            return
        if not hasattr(mine, "i"):
            with lock:
                mine.i = taken[0]
                taken[0] += 1
        _read_span(fds[path], bufs.views[mine.i], path, off, nb, True)

    try:
        t0 = time.perf_counter()
        if depth == 1:
            for r in reads:
                one(r)
        else:
            with ThreadPoolExecutor(max_workers=depth) as ex:
                list(ex.map(one, reads))
        return time.perf_counter() - t0
    finally:
        if bufs is not None:
            bufs.close()


#: the RAM tier's I/O workers (src/runtime/ram_tier.h RamTierFacts::io_threads)
IO_WORKERS = 4
#: reads in flight of the buffered cold passes (a decode's or prefill's threads fault one read each; 4: the I/O
#: workers of a system that warms the page cache with preads)
BUFFERED_DEPTHS = (1, 2, 4)
#: bytes of expert matrices read to measure the reads' CPU time, and at most this many matrices faulted in through
#: a mapping to measure its read-around
CPU_PROBE_BYTES = 256 << 20
MMAP_PROBE_MATRICES = 48
#: bytes each thread of the mmap probe copies at a time (about 64 rows of a 2048-wide Q4_K matrix)
MMAP_PROBE_CHUNK = 64 << 10


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, every thread's."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _read_cpu(reads: list) -> tuple[float, str]:
    """(CPU seconds per byte, how) of reading ``reads`` (cold (file, offset, bytes) expert matrices) the RAM tier's
    way (src/runtime/ram_tier.cpp): :data:`IO_WORKERS` threads, each an O_DIRECT pread of the page-aligned span into
    an aligned buffer, with no copy for a matrix that is a whole number of 4 KiB pages (the tier reads those straight
    into its slots), else into a staging buffer and a copy of the matrix into a slot buffer; buffered preads followed
    by POSIX_FADV_DONTNEED where O_DIRECT is off (``HYBRIMOE_RAM_DIRECT_IO=0``) or the file system refuses it.

    Raises:
        OSError: a read failed or came back short (the message names the file and offset).
    """
    page = mmap.PAGESIZE
    largest = max(nb for _, _, nb in reads)
    span = (largest + 2 * page - 1) // page * page
    fds, direct = _open_cold(sorted({p for p, _, _ in reads}))
    try:
        # the workers' staging buffers as the tier has them (huge pages), and a slot each, faulted in beforehand
        stage = _StagingBuffers(IO_WORKERS, span)
        slots = [_anonymous(largest) for _ in range(IO_WORKERS)]
        for m in slots:
            m.write(bytes(largest))
        bufs = list(zip(stage.views, (memoryview(m) for m in slots)))
        # ram_tier.cpp's into_slot_: a direct read of a whole number of 4 KiB pages lands in its slot, no copy
        n_in_place = sum(1 for _, _, nb in reads if direct and nb % 4096 == 0)

        def one(i_r):
            i, (path, off, nb) = i_r
            staging, slot = bufs[i % IO_WORKERS]
            head = _read_span(fds[path], staging, path, off, nb, direct)
            if not (direct and nb % 4096 == 0):
                slot[:nb] = staging[head:head + nb]  # one copy, view to view, as the tier's memcpy
            if not direct:
                os.posix_fadvise(fds[path], off, nb, os.POSIX_FADV_DONTNEED)

        for p in fds:
            drop_from_page_cache(p)
        c0 = _cpu_seconds()
        # one worker per slice of the list: the pairs (worker, read) keep each worker on its own buffers
        with ThreadPoolExecutor(max_workers=IO_WORKERS) as ex:
            for k in range(0, len(reads), IO_WORKERS):
                list(ex.map(one, enumerate(reads[k:k + IO_WORKERS])))
        cpu = _cpu_seconds() - c0
        for _, slot in bufs:
            slot.release()
        for m in slots:
            m.close()
        stage.close()
    finally:
        for fd in fds.values():
            os.close(fd)
    nbytes = sum(nb for _, _, nb in reads)
    how = (f"{'O_DIRECT' if direct else 'buffered'} reads of {nbytes / 1e6:.0f} MB of expert matrices by "
           f"{IO_WORKERS} threads, {n_in_place} of {len(reads)} in place, the others with a copy into a slot (the "
           f"RAM tier's read path): {cpu:.2f} CPU seconds "
           f"(user + system); a CPU share whose threads use every core loses it all, as ggml's threads meet at a "
           f"barrier after every op")
    return cpu / max(nbytes, 1), how


def _io_read_bytes() -> int:
    """``read_bytes`` of /proc/self/io: what this process had the block layer read (read-ahead included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise OSError("/proc/self/io has no read_bytes")


@contextlib.contextmanager
def _cold_mappings(paths):
    """{file: address of a read-only mapping of it}, each file dropped from the page cache first and advised
    POSIX_FADV_SEQUENTIAL, as llama_mmap advises the model file (Linux then doubles its read-ahead,
    mm/fadvise.c); the mappings are closed on exit."""
    import numpy as np

    maps, base = {}, {}
    try:
        for p in sorted(set(paths)):
            drop_from_page_cache(p)
            with open(p, "rb") as f:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                maps[p] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            base[p] = np.frombuffer(maps[p], dtype=np.uint8).ctypes.data
        yield base
    finally:
        for m in maps.values():
            try:
                m.close()
            except BufferError:  # a numpy view still refers to it: closed when collected
                pass


def _mmap_read_around(reads: list, threads: int) -> tuple[float, float, str]:
    """(bytes read per byte faulted, bytes read per major fault, how) of faulting ``reads`` (cold expert matrices)
    in through a mapping of their file, as upstream llama.cpp's mmap does when a routed expert is not in the page
    cache: the file advised POSIX_FADV_SEQUENTIAL first, as llama_mmap does (Linux then doubles the file's
    read-ahead, mm/fadvise.c), and ``threads`` threads sweeping each matrix in order, taking chunks of
    :data:`MMAP_PROBE_CHUNK` bytes in turn (ggml_compute_forward_mul_mat_id's threads taking chunks of rows).
    Both figures 0 where /proc/self/io cannot be read.
    """
    import ctypes

    import numpy as np

    try:
        _io_read_bytes()
    except OSError:
        return 0.0, 0.0, ""
    largest = max(nb for _, _, nb in reads)
    dst = np.empty(largest, dtype=np.uint8)
    touched = read = faults = 0
    with _cold_mappings(p for p, _, _ in reads) as base:

        def sweep(src, nb, chunks):
            # ctypes releases the GIL: the threads' faults overlap
            for k in iter(lambda: next(chunks, None), None):
                ctypes.memmove(dst.ctypes.data + k, src + k, min(MMAP_PROBE_CHUNK, nb - k))

        with ThreadPoolExecutor(max_workers=threads) as ex:
            r0, f0 = _io_read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            for path, off, nb in reads:
                chunks = iter(range(0, nb, MMAP_PROBE_CHUNK))  # next() on a range iterator is atomic under the GIL
                list(ex.map(lambda _: sweep(base[path] + off, nb, chunks), range(threads)))
                touched += nb
            read = _io_read_bytes() - r0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0
    if faults <= 0 or touched <= 0:
        return 0.0, 0.0, ""
    how = (f"{len(reads)} cold expert matrices ({touched / 1e6:.0f} MB) faulted in through a mapping of the file, "
           f"file advised POSIX_FADV_SEQUENTIAL as llama_mmap does, {threads} threads sweeping each in "
           f"{MMAP_PROBE_CHUNK // 1024} KiB chunks: {read / 1e6:.0f} MB read in {faults} major faults "
           f"(/proc/self/io read_bytes, getrusage)")
    return max(1.0, read / touched), max(4096.0, read / faults), how


#: decode tokens the decode fault probe measures at most, and the bytes it wants read by then (at least 8 tokens)
DECODE_PROBE_TOKENS = 24
DECODE_PROBE_BYTES = 2 << 30
#: the decode probe's warm-up touches at least the first and at most the second multiple of its bytes to read (the
#: memory limit): the page cache is full and has settled to what the routing keeps using, and a routing whose
#: working set the page cache holds, which reads little, still stops
DECODE_PROBE_WARM_TOUCH = (4, 8)
#: rows of an expert matrix a ggml thread takes at a time in a one-token mul_mat_id (ggml-cpu.c,
#: ggml_compute_forward_mul_mat_id: chunk_size 64 when one column)
DECODE_CHUNK_ROWS = 64


def _layer_expert_tensors(model_path) -> dict:
    """{MoE layer: [(file, offset, bytes per expert, bytes per row) of its gate, up, down ``ffn_*_exps`` tensors,
    in that order]} (the order a layer's MoE ops run in)."""
    out = {}
    for layer, kind, path, off, nb, _, row in _expert_tensors(model_path):
        rank = next((i for i, k in enumerate(("gate", "up", "down")) if k in kind), 3)
        out.setdefault(layer, []).append((rank, path, off, nb, row))
    return {layer: [r[1:] for r in sorted(v, key=lambda r: r[0])] for layer, v in sorted(out.items())}


def _decode_faults(model_path: str, locality: str, threads: int, seed: int, warm_bytes: int) -> dict:
    """The decode fault probe's body, in the process whose memory limit applies (see :func:`_mmap_decode_probe`):
    the file dropped from the page cache, decode tokens until the kernel read ``warm_bytes`` for them and they
    touched :data:`DECODE_PROBE_WARM_TOUCH` times that (at most the second figure), then the measured ones. Returns
    the measured tokens' counts: tokens, warm_tokens, touched and read (bytes), faults, wall and copy_s (seconds)."""
    import ctypes

    import numpy as np

    from hybrimoe.model.facts import facts_from_gguf
    from hybrimoe.traces.synthetic import synthetic_trace

    layers = _layer_expert_tensors(model_path)
    facts = facts_from_gguf(model_path)
    largest = max(nb for ts in layers.values() for _, _, nb, _ in ts)
    per_token = facts.top_k * sum(nb for ts in layers.values() for _, _, nb, _ in ts)
    min_warm, max_warm = (-(-k * warm_bytes // max(per_token, 1)) for k in DECODE_PROBE_WARM_TOUCH)
    ids = synthetic_trace(facts, max_warm + DECODE_PROBE_TOKENS + 2, locality=locality, seed=seed, scores=False,
                          n_prompts=1).expert_ids
    dst = np.empty(largest, dtype=np.uint8)
    base = {}

    def sweep(src, nb, chunk, todo):
        # ctypes releases the GIL: the threads' faults overlap, as ggml's threads' do
        for k in iter(lambda: next(todo, None), None):
            ctypes.memmove(dst.ctypes.data + k, src + k, min(chunk, nb - k))

    def token(t, ex) -> int:
        touched = 0
        for i, ts in enumerate(layers.values()):
            experts = sorted({int(e) for e in ids[t, i]})  # mul_mat_id runs the used experts in id order
            for path, off, nb, row in ts:
                chunk = DECODE_CHUNK_ROWS * row
                for e in experts:
                    todo = iter(range(0, nb, chunk))  # next() on a range iterator is atomic under the GIL
                    list(ex.map(lambda _: sweep(base[path] + off + e * nb, nb, chunk, todo), range(threads)))
                    touched += nb
        return touched

    with _cold_mappings(p for ts in layers.values() for p, _, _, _ in ts) as mapped:
        base.update(mapped)
        with ThreadPoolExecutor(max_workers=threads) as ex:
            # the page cache at the limit, holding what the routing keeps using
            r_warm, n_warm = _io_read_bytes(), 0
            while n_warm < max_warm and (n_warm < min_warm or _io_read_bytes() - r_warm < warm_bytes):
                token(n_warm, ex)
                n_warm += 1
            r0, f0, t0 = _io_read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt, time.perf_counter()
            touched = n = 0
            while n < DECODE_PROBE_TOKENS and (n < 8 or _io_read_bytes() - r0 < DECODE_PROBE_BYTES):
                touched += token(n_warm + n, ex)
                n += 1
            wall = time.perf_counter() - t0
            read, faults = _io_read_bytes() - r0, resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0
            # the copies' own time, from memory: the same sweep over an anonymous buffer, not faulting
            src = np.ones(largest, dtype=np.uint8)
            row = layers[next(iter(layers))][0][3]
            reps = max(1, (64 << 20) // largest)
            c0 = time.perf_counter()
            for _ in range(reps):
                todo = iter(range(0, largest, DECODE_CHUNK_ROWS * row))
                list(ex.map(lambda _: sweep(src.ctypes.data, largest, DECODE_CHUNK_ROWS * row, todo),
                            range(threads)))
            copy_Bps = reps * largest / max(time.perf_counter() - c0, 1e-9)
    return {"tokens": n, "warm_tokens": n_warm, "touched": touched, "read": read, "faults": faults, "wall": wall,
            "copy_s": touched / copy_Bps}


def _decode_faults_child(conn, cgroup_dir: Optional[str], args: tuple) -> None:
    """A probe child: joins the memory cgroup (when given), runs :func:`_decode_faults`, sends its dict (or the
    error's text) back."""
    try:
        if cgroup_dir:
            (Path(cgroup_dir) / "cgroup.procs").write_text(str(os.getpid()))
        conn.send(_decode_faults(*args))
    except Exception as e:  # noqa: BLE001 - sent to the parent, which raises it with its context
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def _memory_cgroup(limit: int):
    """A :class:`hybrimoe.runtime.cgroup.MemoryCgroup` of ``limit`` bytes; OSError saying what the probe needs."""
    from hybrimoe.runtime.cgroup import MemoryCgroup

    try:
        return MemoryCgroup(int(limit))
    except OSError as e:
        raise OSError(f"timing mmap faults under a memory limit (calibrate --memory-limit) needs a memory cgroup "
                      f"of its own: root, and cgroup v1 or a v2 parent that delegates the memory controller ({e})"
                      ) from None


def _mmap_decode_probe(model_path, memory_limit: int, threads: int, locality: str = "high", seed: int = 0,
                       warm_bytes: Optional[int] = None) -> tuple[float, float, str]:
    """(bytes read per major fault, bytes per second read for faults, how) of a decode through a mapping of the
    model under a memory limit, as upstream llama.cpp's mmap runs a model larger than RAM: a child process in a
    memory cgroup of ``memory_limit`` bytes (the page cache counted) replays the decode tokens of a synthetic trace
    of the model's shape (``locality``, ``seed``): for each MoE layer, its gate, up and down experts of the token in
    id order, ``threads`` threads (the compute threads upstream would run) taking :data:`DECODE_CHUNK_ROWS` rows at
    a time (ggml_compute_forward_mul_mat_id), the file advised POSIX_FADV_SEQUENTIAL as llama_mmap does. Tokens
    first until the kernel read ``warm_bytes`` for them (None: the limit) and they touched 4 times that (at most 8:
    :data:`DECODE_PROBE_WARM_TOUCH`), so that the page cache is full and holds what the routing keeps using, then
    8 to :data:`DECODE_PROBE_TOKENS` measured. The throughput is the bytes the
    kernel read (read-around and read-ahead included) over the wall time less the copies' own time: it holds each
    fault's latency, the few faults in flight (one per thread) and the kernel's work per fault (reclaim at the
    limit included), which a cold probe outside the limit misses (its faults read 2-4x as much each here).

    Raises:
        OSError: no memory cgroup could be made (needs root, cgroup v1 or a v2 parent delegating memory), or
            /proc/self/io cannot be read; RuntimeError: the child failed (its error named), or its copies took
            all of its time (nothing faulted to time).
    """
    import multiprocessing as mp

    _io_read_bytes()
    cg = _memory_cgroup(memory_limit)
    proc = None
    try:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_decode_faults_child,
                           args=(child, str(cg.dir), (str(model_path), locality, threads, seed,
                                                      int(memory_limit if warm_bytes is None else warm_bytes))))
        proc.start()
        child.close()
        try:
            got = parent.recv()
        except EOFError:
            proc.join()
            got = f"the probe process ended with status {proc.exitcode}" + (
                " (killed: the memory limit may be too small for the process itself)" if proc.exitcode == -9 else "")
        proc.join()
    finally:
        if proc is not None and proc.is_alive():  # interrupted: the child goes too, so the cgroup can go
            proc.kill()
            proc.join()
        cg.close()
    if isinstance(got, str):
        raise RuntimeError(f"mmap decode probe: {got}")
    fault_s = got["wall"] - got["copy_s"]
    if got["faults"] <= 0 or got["touched"] <= 0 or got["read"] <= 0 or fault_s <= 0:
        raise RuntimeError(f"mmap decode probe: nothing faulted to time ({got}): is the model's file larger than the "
                           "memory limit?")
    how = (f"a decode through a mapping of the file under a {memory_limit / 2**30:.3g} GiB memory cgroup "
           f"(page cache counted): {got['tokens']} tokens of a synthetic trace of the model's routing ({locality} "
           f"locality) after {got['warm_tokens']} to fill the page cache, each MoE layer's gate, up and down experts "
           f"swept by {threads} threads in {DECODE_CHUNK_ROWS}-row chunks as ggml's mul_mat_id takes them, the file "
           f"advised POSIX_FADV_SEQUENTIAL as llama_mmap does: {got['read'] / 1e6:.0f} MB read for "
           f"{got['touched'] / 1e6:.0f} MB touched in {got['faults']} major faults, {fault_s:.2f} s faulting "
           f"({got['wall']:.2f} s less {got['copy_s']:.2f} s of copies; /proc/self/io read_bytes, getrusage)")
    return max(4096.0, got["read"] / got["faults"]), got["read"] / fault_s, how


def measure_disk(model_path, *, depths=DEPTHS, bytes_per_depth: int = 128 << 20,
                 seed: Optional[int] = None, memory_limit: Optional[int] = None, locality: str = "high",
                 fault_threads: Optional[int] = None) -> DiskMeasurement:
    """Measures the disk under ``model_path`` (a GGUF MoE model; a split model's shards too) with cold reads of its
    expert matrices: ``bytes_per_depth`` bytes for each number of reads in flight in ``depths`` (an equal share of
    the experts each when the model has fewer), and :data:`LATENCY_READS` 4 KiB reads for the latency. Distinct
    experts throughout, in a random order (``seed``; None: a fresh one per call, so that calibrations run one after
    another do not read the same experts, which a cache below a virtual machine may still hold), each file dropped
    from the page cache before each pass. ``memory_limit`` (bytes): also time a decode's page faults under a memory
    cgroup of that size (:func:`_mmap_decode_probe`, routing of ``locality``, ``fault_threads`` compute threads,
    default the cores, as upstream llama.cpp's CLI runs): their bytes per fault and throughput replace the cold
    probe's bytes per fault, and upstream's mmap is then predicted at that throughput.

    Raises:
        FileNotFoundError, ValueError: as :func:`hybrimoe.model.reader.open_gguf`; not a MoE model; ``depths`` empty
            or not positive; ``bytes_per_depth`` not positive.
        OSError: a read failed or came back short (the message names the file and offset); with ``memory_limit``,
            no memory cgroup could be made (not root, or no memory controller to use).
        ValueError: ``memory_limit`` holds every routed expert of the model (nothing would fault).
        RuntimeError: the decode fault probe's process failed (its error named).
    """
    if memory_limit:  # what the decode probe needs, checked before minutes of reads
        experts = sum(nb for _, _, nb in _expert_reads(model_path))
        if memory_limit >= experts:
            raise ValueError(f"a memory limit of {memory_limit / 2**30:.3g} GiB holds every routed expert of "
                             f"{model_path} ({experts / 2**30:.3g} GiB): upstream's mmap would not fault there; the "
                             "probe needs a model whose experts are larger than the limit it runs under")
        _memory_cgroup(memory_limit).close()
    depths = sorted({int(d) for d in depths})
    if not depths or depths[0] < 1:
        raise ValueError(f"depths must be positive integers, got {depths!r}")
    if bytes_per_depth <= 0:
        raise ValueError(f"bytes_per_depth must be positive, got {bytes_per_depth}")
    reads = _expert_reads(model_path)
    random.Random(seed).shuffle(reads)
    files = sorted({p for p, _, _ in reads})
    fds = {p: os.open(p, os.O_RDONLY) for p in files}
    # the cold passes read the RAM tier's way: O_DIRECT where it reads so (buffered where the file system refuses)
    cold, direct = _open_cold(files)
    try:
        # latency first: single 4 KiB reads, page-aligned inside experts, from the end of the shuffled list
        lat_reads = [(p, (off + 4095) // 4096 * 4096, 4096) for p, off, nb in reads[-LATENCY_READS:] if nb >= 8192]
        reads = reads[:len(reads) - LATENCY_READS] if len(reads) > 2 * LATENCY_READS else reads
        for p in files:
            drop_from_page_cache(p)
        lat = []
        for r in lat_reads:
            lat.append(_timed_reads(cold, [r], 1, direct))
        # throughput per depth, each over experts no earlier pass read (a small file: an equal share each)
        passes = len(depths) + (len(BUFFERED_DEPTHS) if direct else 0)
        bytes_per_depth = min(bytes_per_depth, sum(r[2] for r in reads) // passes)
        per, used, pos, last = {}, 0, 0, []

        def cold_pass(d: int, pass_fds: dict, pass_direct: bool):
            """The next experts no pass read, at least bytes_per_depth and d of them, read cold with d in flight:
            (throughput, the reads), or None where none are left."""
            nonlocal pos, used
            batch, nbytes = [], 0
            while pos < len(reads) and (nbytes < bytes_per_depth or len(batch) < d):
                batch.append(reads[pos])
                nbytes += reads[pos][2]
                pos += 1
            if not batch:
                return None
            for p in files:
                drop_from_page_cache(p)
            used += nbytes
            return nbytes / max(_timed_reads(pass_fds, batch, d, pass_direct), 1e-9), batch

        for d in depths:
            got = cold_pass(d, cold, direct)
            if got is None:
                break
            per[d], last = got
        if not per:
            raise ValueError(f"{model_path}: too few experts to measure")
        # the same cold reads through the page cache (buffered preads), where the passes above were direct: what the
        # disk gives a system that reads that way (a mapping's faults, preads that warm the page cache)
        buffered = {}
        for d in BUFFERED_DEPTHS if direct else ():
            got = cold_pass(d, fds, False)
            if got is None:
                break
            buffered[d] = got[0]
        best = max(per.values())
        qd = min(d for d, v in per.items() if v >= SATURATION * best)
        # the last pass's reads again, in the page cache (read once more buffered first where the passes were
        # direct), at the best depth: what a page-cache hit costs
        if direct:
            _timed_reads(fds, last, max(per, key=per.get))
        warm = sum(r[2] for r in last) / max(_timed_reads(fds, last, max(per, key=per.get)), 1e-9)
    finally:
        for fd in list(fds.values()) + list(cold.values()):
            os.close(fd)
    # this machine's costs around the reads, on experts no pass above read (the same ones again where the model
    # has too few)
    rest = reads[pos:] if len(reads) - pos >= 2 * IO_WORKERS else reads
    cpu_reads, nbytes = [], 0
    for r in rest:
        if nbytes >= CPU_PROBE_BYTES:
            break
        cpu_reads.append(r)
        nbytes += r[2]
    cpu_per_byte, cpu_how = _read_cpu(cpu_reads)
    mm_reads = rest[len(cpu_reads):len(cpu_reads) + MMAP_PROBE_MATRICES] or rest[:MMAP_PROBE_MATRICES]
    around, fault_bytes, mm_how = _mmap_read_around(mm_reads, threads=min(2, os.cpu_count() or 1))
    fault_Bps = 0.0
    if memory_limit:
        fault_bytes, fault_Bps, dec_how = _mmap_decode_probe(
            model_path, memory_limit, threads=fault_threads or os.cpu_count() or 1, locality=locality)
        mm_how = f"read-around: {mm_how}; bytes per fault and their throughput: {dec_how}"
    latency = statistics.median(lat) if lat else 1.0 / best * 4096
    return DiskMeasurement(read_bandwidth_Bps=best, read_latency_s=max(latency, 1e-9), queue_depth=qd,
                           per_depth_Bps=per, warm_Bps=warm, tier_Bps=per.get(IO_WORKERS, 0.0),
                           buffered_Bps=max(buffered.values(), default=0.0), buffered_per_depth_Bps=buffered,
                           read_bytes=int(statistics.median(r[2] for r in reads)), bytes_read=used,
                           files=files, host_cache_suspected=warm < HOST_CACHE_RATIO * best, direct=direct,
                           read_cpu_s_per_byte=cpu_per_byte, read_cpu_source=f"measured by hybrimoe calibrate "
                           f"--disk on {time.strftime('%Y-%m-%d')}: {cpu_how}",
                           mmap_read_around=around, mmap_fault_bytes=fault_bytes, mmap_fault_Bps=fault_Bps,
                           mmap_source=f"measured by hybrimoe calibrate --disk on {time.strftime('%Y-%m-%d')}: "
                           f"{mm_how}" if mm_how else "")
