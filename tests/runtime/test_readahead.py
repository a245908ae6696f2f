"""The block device read-ahead the RAM benchmarks set (hybrimoe.runtime.readahead): set where the process may, the
value in force recorded, the original put back; no block device (tmpfs) is said, not an error."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hybrimoe.runtime.readahead import ReadAhead, read_ahead_file, read_ahead_kb


def test_a_file_without_a_block_device_says_so(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    f = shm / f"hybrimoe-ra-{os.getpid()}"
    f.write_bytes(b"x")
    try:
        assert read_ahead_file(f) is None and read_ahead_kb(f) is None
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
