"""Measures the disk a model is read from, on the model's own file: the three figures the simulator's disk model
takes (docs/design.md §17; ``hybrimoe.policy.hardware.load_disk``): sequential read bandwidth (bytes/s), the
latency of one read (seconds) and how many reads in flight still gain throughput.

Every read is cold: the model's files are dropped from the page cache first (POSIX_FADV_DONTNEED, which drops the
clean pages no process maps) and no byte is read twice, so the figures are the device's, not the page cache's. The
reads are the RAM tier's own: whole experts' matrices (one ``ffn_*_exps`` expert slice, ggml ``nb[2]`` bytes, at a
random expert of a random MoE layer), by ``depth`` threads at once with ``os.pread`` (buffered). A virtual disk can
still be served from the host's cache, which this process cannot drop: the result then says so when cold reads run
about as fast as warm ones.
"""
from __future__ import annotations

import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

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

    def to_disk_file(self, name: str) -> dict:
        """A ``hybrimoe.disk/1`` document (``hybrimoe simulate --disk FILE`` reads it), sources naming the run."""
        when = time.strftime("%Y-%m-%d")
        where = ", ".join(str(f) for f in self.files)
        base = (f"measured by hybrimoe calibrate --disk on {when}: cold buffered preads of {self.read_bytes} B "
                f"expert matrices of {where}")
        note = (" (cold reads ran at nearly page-cache speed: probably served from a cache below this machine)"
                if self.host_cache_suspected else "")
        depths = ", ".join(f"{d}: {v / 1e9:.3g} GB/s" for d, v in sorted(self.per_depth_Bps.items()))
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
            },
            "measured": {"per_depth_Bps": {str(k): v for k, v in self.per_depth_Bps.items()},
                         "warm_Bps": self.warm_Bps, "bytes_read": self.bytes_read,
                         "host_cache_suspected": self.host_cache_suspected},
        }


def _expert_reads(model_path) -> list[tuple[Path, int, int]]:
    """Every expert matrix of the model as (file, offset, bytes): what the RAM tier reads."""
    g = open_gguf(model_path)
    out = []
    for name, (path, off) in g.tensor_shard.items():
        m = EXPERT_TENSOR_RE.match(name)
        if not m or m.group(3) != "weight":
            continue
        t = g.tensors[name]
        n_expert = int(t.shape[2]) if len(t.shape) > 2 else 1
        nb = int(t.n_bytes) // n_expert
        out.extend((Path(path), off + e * nb, nb) for e in range(n_expert))
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


def _timed_reads(fds: dict, reads: list, depth: int) -> float:
    """Seconds to pread every (file, offset, bytes) of ``reads`` with ``depth`` threads. Raises OSError on a short
    read (the file changed under us) naming the file and offset."""
    def one(r):
        path, off, nb = r
        data = os.pread(fds[path], nb, off)
        if len(data) != nb:
            raise OSError(f"{path}: short read at offset {off}: {len(data)} of {nb} bytes")

    t0 = time.perf_counter()
    if depth == 1:
        for r in reads:
            one(r)
    else:
        with ThreadPoolExecutor(max_workers=depth) as ex:
            list(ex.map(one, reads))
    return time.perf_counter() - t0


def measure_disk(model_path, *, depths=DEPTHS, bytes_per_depth: int = 128 << 20, seed: int = 0) -> DiskMeasurement:
    """Measures the disk under ``model_path`` (a GGUF MoE model; a split model's shards too) with cold reads of its
    expert matrices: ``bytes_per_depth`` bytes for each number of reads in flight in ``depths`` (an equal share of
    the experts each when the model has fewer), and :data:`LATENCY_READS` 4 KiB reads for the latency. Distinct
    experts throughout, in a random order (``seed``), each file dropped from the page cache before each pass.

    Raises:
        FileNotFoundError, ValueError: as :func:`hybrimoe.model.reader.open_gguf`; not a MoE model; ``depths`` empty
            or not positive; ``bytes_per_depth`` not positive.
        OSError: a read failed or came back short (the message names the file and offset).
    """
    depths = sorted({int(d) for d in depths})
    if not depths or depths[0] < 1:
        raise ValueError(f"depths must be positive integers, got {depths!r}")
    if bytes_per_depth <= 0:
        raise ValueError(f"bytes_per_depth must be positive, got {bytes_per_depth}")
    reads = _expert_reads(model_path)
    random.Random(seed).shuffle(reads)
    files = sorted({p for p, _, _ in reads})
    fds = {p: os.open(p, os.O_RDONLY) for p in files}
    try:
        # latency first: single 4 KiB reads, page-aligned inside experts, from the end of the shuffled list
        lat_reads = [(p, (off + 4095) // 4096 * 4096, 4096) for p, off, nb in reads[-LATENCY_READS:] if nb >= 8192]
        reads = reads[:len(reads) - LATENCY_READS] if len(reads) > 2 * LATENCY_READS else reads
        for p in files:
            drop_from_page_cache(p)
        lat = []
        for r in lat_reads:
            lat.append(_timed_reads(fds, [r], 1))
        # throughput per depth, each over experts no earlier pass read (a small file: an equal share each)
        bytes_per_depth = min(bytes_per_depth, sum(r[2] for r in reads) // len(depths))
        per, used, pos, last = {}, 0, 0, []
        for d in depths:
            batch, nbytes = [], 0
            while pos < len(reads) and (nbytes < bytes_per_depth or len(batch) < d):
                batch.append(reads[pos])
                nbytes += reads[pos][2]
                pos += 1
            if not batch:
                break
            for p in files:
                drop_from_page_cache(p)
            per[d] = nbytes / max(_timed_reads(fds, batch, d), 1e-9)
            used += nbytes
            last = batch
        if not per:
            raise ValueError(f"{model_path}: too few experts to measure")
        best = max(per.values())
        qd = min(d for d, v in per.items() if v >= SATURATION * best)
        # the last pass's reads again, now in the page cache, at the best depth: what a page-cache hit costs
        warm = sum(r[2] for r in last) / max(_timed_reads(fds, last, max(per, key=per.get)), 1e-9)
    finally:
        for fd in fds.values():
            os.close(fd)
    latency = statistics.median(lat) if lat else 1.0 / best * 4096
    return DiskMeasurement(read_bandwidth_Bps=best, read_latency_s=max(latency, 1e-9), queue_depth=qd,
                           per_depth_Bps=per, warm_Bps=warm,
                           read_bytes=int(statistics.median(r[2] for r in reads)), bytes_read=used,
                           files=files, host_cache_suspected=warm < HOST_CACHE_RATIO * best)
