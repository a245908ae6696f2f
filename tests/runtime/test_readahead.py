"""The block device read-ahead the RAM benchmarks set (hybrimoe.runtime.readahead): set where the process may, the
value in force recorded, the original put back; no block device (tmpfs) is said, not an error."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hybrimoe.runtime.readahead import ReadAhead, disk_busy_ms, read_ahead_file, read_ahead_kb


def test_a_file_without_a_block_device_says_so(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    f = shm / f"hybrimoe-ra-{os.getpid()}"
    f.write_bytes(b"x")
    try:
        assert read_ahead_file(f) is None and read_ahead_kb(f) is None and disk_busy_ms(f) is None
        with ReadAhead(f) as ra:
            assert ra.set(128) is None
            assert ra.log == [{"asked_kb": 128, "in_force_kb": None, "set": False,
                               "why": "no block device read-ahead for this file (no sysfs queue)"}]
    finally:
        f.unlink()


def test_set_and_put_back(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    knob = read_ahead_file(f)
    if knob is None:
        pytest.skip(f"{tmp_path} is on no block device with a read-ahead")
    before = read_ahead_kb(f)
    assert before == int(knob.read_text())
    other = 256 if before != 256 else 512
    with ReadAhead(f) as ra:
        now = ra.set(other)
        entry = ra.log[-1]
        if os.access(knob, os.W_OK):
            assert now == other and entry["set"] and entry["why"] == ""
        else:
            assert now == before and not entry["set"] and entry["why"]
    assert read_ahead_kb(f) == before  # put back


def test_disk_busy_counts_a_direct_read(tmp_path):
    """The disk's busy milliseconds (io_ticks) are the device's own counter: they never go back, and a read that
    reaches the disk (O_DIRECT, 64 MiB) leaves them at least where they were; the sysfs file is read as the kernel's
    block/stat documentation lays it out (the tenth field)."""
    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(1 << 20) * 64)
    knob = read_ahead_file(f)
    if knob is None:
        pytest.skip(f"{tmp_path} is on no block device")
    fields = (knob.parent.parent / "stat").read_text().split()
    before = disk_busy_ms(f)
    assert before is not None and int(fields[9]) <= before
    try:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("no O_DIRECT here")
    try:
        import mmap
        buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT needs
        for off in range(0, 64 << 20, 1 << 20):
            os.preadv(fd, [buf], off)
    finally:
        os.close(fd)
    assert disk_busy_ms(f) >= before
