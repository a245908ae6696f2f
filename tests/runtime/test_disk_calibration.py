"""``hybrimoe calibrate --disk``: the disk figures measured on the model's own file, written as a disk file the
simulator takes (hybrimoe.runtime.disk_calibration)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybrimoe.policy.hardware import load_disk
from hybrimoe.runtime import disk_calibration as dc


@pytest.fixture(scope="module")
def model(tiny_model):
    # 16 experts of 256 x 1024 F16 per matrix (512 KiB reads), 48 MiB of experts
    return tiny_model("qwen3moe", "F16", n_embd=256, n_ff_exp=1024, n_expert=16)


def test_every_expert_matrix_is_a_read(model):
    from hybrimoe.model.reader import describe

    d = describe(model)
    reads = dc._expert_reads(model)
    assert len(reads) == len(d["moe_layers"]) * 3 * d["n_expert"]
    assert sum(nb for _, _, nb in reads) == d["routed_expert_bytes"]
    assert len({(p, off) for p, off, _ in reads}) == len(reads)


def test_measure_disk_reads_each_expert_once_and_gives_sane_figures(model):
    m = dc.measure_disk(model, depths=(1, 2, 4), bytes_per_depth=4 << 20)
    assert set(m.per_depth_Bps) == {1, 2, 4}
    assert m.read_bandwidth_Bps == max(m.per_depth_Bps.values()) > 0
    assert m.queue_depth in m.per_depth_Bps
    assert m.per_depth_Bps[m.queue_depth] >= dc.SATURATION * m.read_bandwidth_Bps
    assert 0 < m.read_latency_s < 1.0
    assert m.read_bytes == 256 * 1024 * 2
    # the RAM tier's reads: the throughput at its I/O workers' depth; where the passes were direct, the same reads
    # through the page cache at 1, 2 and 4 in flight, and their best
    assert m.tier_Bps == m.per_depth_Bps[dc.IO_WORKERS]
    passes = 3
    if m.direct:
        assert set(m.buffered_per_depth_Bps) == set(dc.BUFFERED_DEPTHS)
        assert m.buffered_Bps == max(m.buffered_per_depth_Bps.values()) > 0
        passes += len(dc.BUFFERED_DEPTHS)
    # at least the bytes asked for per pass, each expert once (the passes never reuse an expert)
    assert passes * (4 << 20) <= m.bytes_read <= passes * (4 << 20) + passes * m.read_bytes


def test_the_written_file_is_a_disk_the_simulator_takes(model, tmp_path):
    out = tmp_path / "disk.json"
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "calibrate", "--disk", "-m", str(model), "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout
    disk = load_disk(str(out))
    doc = json.loads(out.read_text())
    assert disk.facts["read_bandwidth_Bps"] == doc["facts"]["read_bandwidth_Bps"]["value"] > 0
    assert "cold O_DIRECT reads into 2 MiB-aligned huge-page staging buffers" in disk.sources["read_latency_s"]
    # the RAM tier's depth and the page cache's reads, as facts the simulator takes
    assert disk.facts["tier_read_Bps"] == doc["measured"]["per_depth_Bps"][str(dc.IO_WORKERS)] > 0
    assert disk.facts["buffered_read_Bps"] == max(doc["measured"]["buffered_per_depth_Bps"].values()) > 0
    assert "through the page cache" in disk.sources["buffered_read_Bps"]
    # with the RAM tier's reads buffered, the calibration's are too
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "calibrate", "--disk", "-m", str(model), "-o", str(out),
                        "--force"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HYBRIMOE_RAM_DIRECT_IO": "0"})
    assert r.returncode == 0, r.stderr
    assert "cold buffered preads" in load_disk(str(out)).sources["read_latency_s"]
    # this machine's costs around the reads: the tier's reads take CPU time (at least the copy into the slot), and
    # a fault through the mapping reads at least the bytes it faults in
    assert 0 < disk.facts["read_cpu_s_per_byte"] < 1e-6
    assert "the RAM tier's read path" in disk.sources["read_cpu_s_per_byte"]
    assert disk.facts["mmap_read_around"] >= 1 and disk.facts["mmap_fault_bytes"] >= 4096
    assert "major faults" in disk.sources["mmap_read_around"]
    trace = tmp_path / "t.npz"
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "trace", "-m", str(model), "-p", "hello world", "-n", "16",
                        "-o", str(trace)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    sim = subprocess.run([sys.executable, "-m", "hybrimoe", "simulate", "--trace", str(trace), "-m", str(model),
                          "--moe-cache", "0", "--moe-ram-cache", "50%", "--disk", str(out),
                          "--json", str(tmp_path / "s.json")], capture_output=True, text=True, timeout=600)
    assert sim.returncode == 0, sim.stderr
    text = (tmp_path / "s.json").read_text()
    assert '"disk"' in text and ("measured-" in text or str(out) in text), text[:2000]


def test_the_decode_probe_faults_each_token_s_experts_through_the_mapping(model):
    """The decode fault probe's body, here without a memory limit or warm-up, the page cache dropped first: each
    measured token touches its top-k experts' gate, up and down matrices in every MoE layer (top-k distinct ids,
    so k x the layer's three matrices), and cold experts fault, the kernel reading at least a page per fault."""
    from hybrimoe.model.facts import facts_from_gguf

    got = dc._decode_faults(str(model), "high", 2, 0, 0)
    layers = dc._layer_expert_tensors(model)
    assert all([nb for _, _, nb, _ in ts] == [ts[0][2]] * 3 for ts in layers.values())
    per_token = facts_from_gguf(model).top_k * sum(nb for ts in layers.values() for _, _, nb, _ in ts)
    assert got["tokens"] == dc.DECODE_PROBE_TOKENS and got["warm_tokens"] == 0
    assert got["touched"] == got["tokens"] * per_token
    assert got["faults"] > 0 and got["read"] >= 4096 * got["faults"]
    assert got["copy_s"] > 0


def test_the_decode_probe_runs_under_the_memory_limit(model):
    """Under a memory cgroup (root only: skipped where none can be made) the probe's child measures faults and
    their throughput; the figures come back with how they were measured."""
    from hybrimoe.runtime.cgroup import MemoryCgroup

    try:
        MemoryCgroup(1 << 30).close()
    except OSError as e:
        pytest.skip(f"no memory cgroup here: {e}")
    fault_bytes, fault_Bps, how = dc._mmap_decode_probe(model, 1 << 30, threads=2, warm_bytes=0)
    assert fault_bytes >= 4096 and fault_Bps > 0
    assert "1 GiB memory cgroup" in how and "major faults" in how


def test_a_memory_limit_that_holds_the_model_is_refused_before_any_read(model):
    with pytest.raises(ValueError, match="holds every routed expert"):
        dc.measure_disk(model, memory_limit=1 << 30)


@pytest.mark.parametrize("bad", ["10%", "100MiB", "lots"])
def test_a_bad_memory_limit_is_refused_naming_the_flag(model, bad, tmp_path):
    out = tmp_path / "disk.json"
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "calibrate", "--disk", "-m", str(model), "-o", str(out),
                        "--memory-limit", bad], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "--memory-limit" in r.stderr and "256 MiB" in r.stderr
    assert not out.exists()


def test_a_memory_limit_without_disk_is_refused(model, tmp_path):
    out = tmp_path / "cal.json"
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "calibrate", "-m", str(model), "-o", str(out),
                        "--memory-limit", "3GiB"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "--memory-limit goes with --disk" in r.stderr
    assert not out.exists()


def test_an_existing_output_is_kept_without_force(model, tmp_path):
    out = tmp_path / "disk.json"
    out.write_text("mine")
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "calibrate", "--disk", "-m", str(model), "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "exists" in r.stderr
    assert out.read_text() == "mine"


def test_a_file_that_is_not_a_gguf_model_is_refused(tmp_path):
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"nope" * 100)
    with pytest.raises(ValueError, match="not a GGUF file"):
        dc.measure_disk(bad)


def test_direct_reads_go_through_huge_page_aligned_staging(model):
    """The cold passes read as the RAM tier does: O_DIRECT into per-thread staging buffers aligned to 2 MiB (where
    transparent huge pages apply); every matrix of the model read that way, at two depths."""
    import ctypes
    import os

    bufs = dc._StagingBuffers(2, 3 << 20)
    try:
        for v in bufs.views:
            assert ctypes.addressof(ctypes.c_char.from_buffer(v)) % dc.HUGE_PAGE == 0 and len(v) == 4 << 20
    finally:
        bufs.close()
    reads = dc._expert_reads(model)
    fd = os.open(model, os.O_RDONLY | os.O_DIRECT)
    try:
        for depth in (1, 3):
            assert dc._timed_reads({reads[0][0]: fd}, reads, depth, direct=True) > 0
    finally:
        os.close(fd)


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_the_staging_buffers_get_huge_pages():
    """The staging buffers are huge pages where the kernel gives a process them on request (transparent huge pages
    "always" or "madvise"), as the RAM tier's are: private anonymous memory. Python's plain ``mmap.mmap(-1, n)`` is
    shared memory, which takes none under the default ``shmem_enabled`` "never", and a direct read into 4 KiB
    pages is split into many segments: this machine's cold reads measured 1.4-1.7 GB/s that way where the RAM tier
    read at 2.9 GB/s."""
    import ctypes
    from pathlib import Path

    thp = Path("/sys/kernel/mm/transparent_hugepage")
    if not thp.exists() or "[never]" in (thp / "enabled").read_text():
        pytest.skip("transparent huge pages are off on this kernel")
    if "[never]" in (thp / "defrag").read_text():
        pytest.skip("the kernel gives huge pages at a fault only where free ones exist (defrag never)")
    bufs = dc._StagingBuffers(2, 3 << 20)
    try:
        for v in bufs.views:
            assert _anon_huge_kb(ctypes.addressof(ctypes.c_char.from_buffer(v))) >= 2048
    finally:
        bufs.close()
