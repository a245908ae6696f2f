"""The read-ahead of the block device a file lives on, which sets how much upstream's mmap reads per page fault.

Linux reads ``read_ahead_kb`` around a faulting page of a mapping (mm/filemap.c ``page_cache_sync_ra``, doubled
after ``POSIX_FADV_SEQUENTIAL`` as llama.cpp's ``llama_mmap`` advises; mm/fadvise.c) and starts the next window
asynchronously. A distribution gives an NVMe drive 128 KiB; this project's virtual disk has 8 MiB. A benchmark of a
model larger than RAM compares at the value users have (128 KiB) and at the one best for upstream, so it sets the
value through sysfs (``/sys/dev/block/MAJOR:MINOR/queue/read_ahead_kb``, the whole disk's for a partition) where the
process may, and puts the old one back (:class:`ReadAhead`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def read_ahead_file(path) -> Optional[Path]:
    """The sysfs ``read_ahead_kb`` of the block device under ``path``, or None (no block device: tmpfs, overlay
    without one, a system without sysfs)."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for queue in (dev / "queue", dev / ".." / "queue"):  # a whole disk, or a partition's disk
        knob = queue / "read_ahead_kb"
        if knob.is_file():
            return knob.resolve()
    return None


def disk_busy_ms(path) -> Optional[int]:
    """Milliseconds the block device under ``path`` has had I/O in flight since boot (``io_ticks``, the tenth field
    of its sysfs ``stat``; Documentation/block/stat.rst), or None where it cannot be read. Two readings a time apart
    give the share of that time the disk was busy: near 1 means the run waited for the disk."""
    knob = read_ahead_file(path)
    try:
        return int((knob.parent.parent / "stat").read_text().split()[9]) if knob else None
    except (OSError, ValueError, IndexError):
        return None


def read_ahead_kb(path) -> Optional[int]:
    """The read-ahead (KiB) in force for ``path``'s block device, or None where it cannot be read."""
    knob = read_ahead_file(path)
    try:
        return int(knob.read_text()) if knob else None
    except (OSError, ValueError):
        return None


class ReadAhead:
    """Sets the read-ahead of ``path``'s block device for a while: ``set(kb)`` writes it where the process may and
    returns the value in force after the attempt; ``close()`` (or leaving the ``with`` block) puts back the value it
    found. ``log`` records every attempt: ``{"asked_kb", "in_force_kb", "set": bool, "why"}`` (why it could not)."""

    def __init__(self, path):
        self.knob = read_ahead_file(path)
        self.original = read_ahead_kb(path)
        self.log: list[dict] = []

    def set(self, kb: int) -> Optional[int]:
        """Asks for ``kb`` KiB of read-ahead; returns the value in force afterwards (None: unknown)."""
        why = ""
        if self.knob is None:
            why = "no block device read-ahead for this file (no sysfs queue)"
        else:
            try:
                self.knob.write_text(str(int(kb)))
            except OSError as e:
                why = f"cannot write {self.knob}: {e.strerror or e}"
        now = int(self.knob.read_text()) if self.knob else None
        self.log.append({"asked_kb": int(kb), "in_force_kb": now, "set": now == int(kb) and not why, "why": why})
        return now

    def close(self) -> None:
        """Puts back the read-ahead found at the start (where it was read and can be written)."""
        if self.knob is not None and self.original is not None:
            try:
                self.knob.write_text(str(self.original))
            except OSError:
                pass

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
