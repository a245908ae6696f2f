"""A memory cgroup for a child process: the RAM benchmarks and tests run a model larger than the memory they give it,
and ``calibrate --disk --memory-limit`` times upstream's page faults under one (Linux's memory controller counts the
page cache too: Documentation/admin-guide/cgroup-v2.rst, "Memory")."""
from __future__ import annotations

import os
from pathlib import Path


class MemoryCgroup:
    """A memory cgroup under this process's own (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``) with a limit
    of ``limit`` bytes; :meth:`enter` moves the calling process into it (a child's ``preexec_fn``), :meth:`close`
    removes it once its processes ended.

    Raises:
        OSError: no memory cgroup to make a child of, or the process may not make one or set its limit (not
            root, a v2 parent that does not delegate the memory controller); nothing is left behind then.
    """

    def __init__(self, limit: int):
        rel_v1 = rel_v2 = None
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hier, ctrls, rel = line.split(":", 2)
            if hier == "0":
                rel_v2 = rel
            elif "memory" in ctrls.split(","):
                rel_v1 = rel
        if rel_v1 is not None and Path(f"/sys/fs/cgroup/memory{rel_v1}").is_dir():
            self.dir, knob = Path(f"/sys/fs/cgroup/memory{rel_v1}") / f"hybrimoe-bench-{os.getpid()}", \
                "memory.limit_in_bytes"
        elif rel_v2 is not None:
            # v2: the limit file exists only where the parent enables the memory controller for its children
            self.dir, knob = Path(f"/sys/fs/cgroup{rel_v2}") / f"hybrimoe-bench-{os.getpid()}", "memory.max"
        else:
            raise OSError("no memory cgroup to make a child of")
        self.dir.mkdir()
        try:
            (self.dir / knob).write_text(str(limit))
        except OSError:
            self.close()  # no limit could be set: leave no empty cgroup behind
            raise
        self.limit = limit

    def enter(self) -> None:
        """Moves the calling process into the cgroup (in a child: ``subprocess.run(..., preexec_fn=cg.enter)``)."""
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        """Removes the cgroup (a no-op while a process is still in it, or when it is gone)."""
        try:
            self.dir.rmdir()
        except OSError:
            pass
