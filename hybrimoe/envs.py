"""Every ``HYBRIMOE_*`` environment variable and every package-wide default, in one table.

The package reads its environment only through the functions below (a test checks that no other module of the
package names a ``HYBRIMOE_`` variable in code). :data:`VARIABLES` also lists the variables that the build, the test
suite, CI and the patched ``ggml-rpc-server`` read, so that one table answers "what does this variable do?".

=================================== ======== ===============================================================
variable                            read by  meaning (default)
=================================== ======== ===============================================================
``HYBRIMOE_CACHE_DIR``              package  hybrimoe's cache directory (``$XDG_CACHE_HOME/hybrimoe``, else
                                             ``~/.cache/hybrimoe``): the default tiny model, stored calibrations,
                                             the fetched llama-cpp-python sdist
``HYBRIMOE_AUTO_CALIBRATE``         package  ``0``: no first-use calibration, the default hardware's cost model
``HYBRIMOE_PROGRESS``               package  set: progress bars even when stderr is not a terminal
``HYBRIMOE_TRACE``                  package  the DeepSeek-V2-Lite development trace (``shared/traces/...`` looked
                                             up beside the checkout and the working directory)
``HYBRIMOE_RPC_TIMEOUT_S``          package  seconds for the RPC handshake with a server (5)
``HYBRIMOE_MAX_BUFFER_BYTES``       package  caps one slot-pool device buffer (bytes; unset: the device's cap)
``HYBRIMOE_RAM_DIRECT_IO``          package  ``0``: the RAM tier reads the model with buffered reads, not O_DIRECT
``HYBRIMOE_RAM_TWO_PASS``           package  ``0``: the RAM tier's CPU share in one pass per layer, after every read
``HYBRIMOE_RAM_REPACK``             package  ``1``: the RAM tier repacks each expert after its read (off)
``HYBRIMOE_RPC_STATS``              server   set by :class:`hybrimoe.runtime.rpc.RPCServer`: the patched server
                                             tallies the commands it serves into this file
``HYBRIMOE_RPC_MEMORY``             server   set by ``RPCServer``: the device memory (bytes) the server reports
``HYBRIMOE_RPC_IO_TIMEOUT_S``       backend  seconds the patched RPC client waits for a reply (off)
``HYBRIMOE_LLAMA_SRC``              build    a local llama-cpp-python sdist or trimmed tree (offline builds)
``HYBRIMOE_TEST_WORKERS``           tests    processes for the simulator tables (the machine's cores)
``HYBRIMOE_TEST_RPC_LIB``           tests    another ``libggml-rpc.so`` for the RPC failure tests
``HYBRIMOE_CI_CACHE``               CI       CI's ccache and build folders (``~/.cache/hybrimoe-ci``)
``HYBRIMOE_CI_VULKAN``              CI       ``0``: leave the Vulkan stage out
``HYBRIMOE_VULKAN_VENV``            CI       the Vulkan stage's virtual environment
``HYBRIMOE_VULKAN_HEADERS_SUITE``   CI       the Debian suite the Vulkan headers come from
``HYBRIMOE_REQUIRE_VULKAN``         tests    ``1``: the Vulkan tests fail instead of skipping without a device
=================================== ======== ===============================================================
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its ``name``, who reads it (``package``, ``server``, ``backend``, ``build``,
    ``tests``, ``CI``), its ``default`` as text ("" when unset means off) and what it does."""

    name: str
    read_by: str
    default: str
    meaning: str


#: every HYBRIMOE_* variable, by name (the table of the module docstring)
VARIABLES = {v.name: v for v in (
    EnvVar("HYBRIMOE_CACHE_DIR", "package", "$XDG_CACHE_HOME/hybrimoe or ~/.cache/hybrimoe",
           "hybrimoe's cache directory: default tiny model, stored calibrations, fetched sdist"),
    EnvVar("HYBRIMOE_AUTO_CALIBRATE", "package", "1", "0: no first-use calibration (the default hardware's costs)"),
    EnvVar("HYBRIMOE_PROGRESS", "package", "", "set: progress bars even when stderr is not a terminal"),
    EnvVar("HYBRIMOE_TRACE", "package", "shared/traces/dsv2lite_dev.npz", "the development routing trace"),
    EnvVar("HYBRIMOE_RPC_TIMEOUT_S", "package", "5", "seconds for the RPC handshake with a server"),
    EnvVar("HYBRIMOE_MAX_BUFFER_BYTES", "package", "", "bytes: caps one slot-pool device buffer"),
    EnvVar("HYBRIMOE_RAM_DIRECT_IO", "package", "1", "0: the RAM tier's reads are buffered, not O_DIRECT"),
    EnvVar("HYBRIMOE_RAM_TWO_PASS", "package", "1", "0: the RAM tier's CPU share in one pass, after every read"),
    EnvVar("HYBRIMOE_RAM_REPACK", "package", "0", "1: the RAM tier repacks each expert after its read (upstream's "
           "CPU_REPACK kernels on its slots)"),
    EnvVar("HYBRIMOE_RPC_STATS", "server", "", "file the patched ggml-rpc-server tallies its commands into"),
    EnvVar("HYBRIMOE_RPC_MEMORY", "server", "", "bytes of device memory the patched ggml-rpc-server reports"),
    EnvVar("HYBRIMOE_RPC_IO_TIMEOUT_S", "backend", "", "seconds the patched RPC client waits for a reply"),
    EnvVar("HYBRIMOE_LLAMA_SRC", "build", "", "local llama-cpp-python sdist or trimmed tree (offline builds)"),
    EnvVar("HYBRIMOE_TEST_WORKERS", "tests", "the machine's cores", "processes for the simulator tables"),
    EnvVar("HYBRIMOE_TEST_RPC_LIB", "tests", "", "another libggml-rpc.so for the RPC failure tests"),
    EnvVar("HYBRIMOE_CI_CACHE", "CI", "~/.cache/hybrimoe-ci", "CI's ccache and build folders"),
    EnvVar("HYBRIMOE_CI_VULKAN", "CI", "1", "0: leave the Vulkan stage out"),
    EnvVar("HYBRIMOE_VULKAN_VENV", "CI", ".ci-vulkan-venv", "the Vulkan stage's virtual environment"),
    EnvVar("HYBRIMOE_VULKAN_HEADERS_SUITE", "CI", "trixie", "Debian suite of the Vulkan headers"),
    EnvVar("HYBRIMOE_REQUIRE_VULKAN", "tests", "", "1: the Vulkan tests fail instead of skipping"),
)}

# ---- defaults ---------------------------------------------------------------------------------------------------

#: MoE layers whose experts are predicted and prefetched ahead (HybriMoE §IV.C looks ahead over the next layers;
#: ``moe_prefetch_layers``, ``--moe-prefetch-layers``, ``hybrimoe simulate --prefetch-depth``)
PREFETCH_LAYERS = 3
#: the hardware file whose cost model the planner uses when no calibration is stored and none is measured
#: (``hybrimoe/policy/hardware_files``)
DEFAULT_COST_HARDWARE = "rtx4090-desktop"
#: ``moe_cache="auto"``: bytes of device memory left free besides the engine's own estimate (1/32 of what is free,
#: at least 256 MiB): allocations the estimate misses (the backend's scratch, other processes) must still fit
AUTO_MARGIN_FRACTION = 1.0 / 32.0
AUTO_MARGIN_MIN_BYTES = 256 * 1024 * 1024
#: seconds allowed for the RPC handshake when ``HYBRIMOE_RPC_TIMEOUT_S`` is unset or not a positive number
RPC_TIMEOUT_S = 5.0
#: seconds that SIGTERM/SIGINT leave ``hybrimoe serve``'s running requests to finish before they are cancelled
#: (uvicorn's ``timeout_graceful_shutdown``; streams end at once), and that closing the model then waits for a
#: decode still running
SERVER_GRACE_S = 10.0
#: the development trace's path relative to the folder that holds the checkout (``HYBRIMOE_TRACE`` overrides it)
DEFAULT_TRACE = Path("shared") / "traces" / "dsv2lite_dev.npz"

AUTO_CALIBRATE_ENV = "HYBRIMOE_AUTO_CALIBRATE"
CACHE_DIR_ENV = "HYBRIMOE_CACHE_DIR"
PROGRESS_ENV = "HYBRIMOE_PROGRESS"
TRACE_ENV = "HYBRIMOE_TRACE"
RPC_TIMEOUT_ENV = "HYBRIMOE_RPC_TIMEOUT_S"
MAX_BUFFER_ENV = "HYBRIMOE_MAX_BUFFER_BYTES"
RAM_DIRECT_IO_ENV = "HYBRIMOE_RAM_DIRECT_IO"
#: the RAM tier's CPU share in two passes per layer: 1 (the default) or 0 (ram_two_pass())
RAM_TWO_PASS_ENV = "HYBRIMOE_RAM_TWO_PASS"
#: the RAM tier repacks its slots after each read: 0 (the default) or 1 (ram_repack())
RAM_REPACK_ENV = "HYBRIMOE_RAM_REPACK"
RPC_STATS_ENV = "HYBRIMOE_RPC_STATS"
RPC_MEMORY_ENV = "HYBRIMOE_RPC_MEMORY"


# ---- readers ----------------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """hybrimoe's cache directory: ``$HYBRIMOE_CACHE_DIR``, else ``$XDG_CACHE_HOME/hybrimoe``, else
    ``~/.cache/hybrimoe`` (the XDG base directory rule). Holds the default tiny model (``models/``) and the stored
    calibrations (``calibration/``)."""
    root = os.environ.get(CACHE_DIR_ENV)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybrimoe"


def auto_calibrate() -> bool:
    """Whether a model's cost model is measured on first use: unless ``HYBRIMOE_AUTO_CALIBRATE`` is ``0``, ``no``,
    ``false`` or ``off``."""
    return os.environ.get(AUTO_CALIBRATE_ENV, "1").strip().lower() not in ("0", "no", "false", "off")


def _switch(name: str, default: bool = True) -> bool:
    """An on/off variable: unset or empty is ``default``; ``1``, ``yes``, ``true`` or ``on`` (any case, spaces
    around) is on; ``0``, ``no``, ``false`` or ``off`` is off.

    Raises:
        ValueError: anything else, naming the variable (a typo must not leave a switch as it was silently).
    """
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "yes", "true", "on"):
        return True
    if raw in ("0", "no", "false", "off"):
        return False
    on, off = ("1 (on, the default)", "0 (off)") if default else ("1 (on)", "0 (off, the default)")
    raise ValueError(f"{name}={raw!r}: give {on} or {off}")


def ram_direct_io() -> bool:
    """Whether the RAM tier reads the model's experts with O_DIRECT (the default; buffered where the file system
    refuses it): unless ``HYBRIMOE_RAM_DIRECT_IO`` is ``0``, ``no``, ``false`` or ``off``. Buffered reads cost the
    CPU a copy out of the page cache and the page cache's bookkeeping (about 1-1.5 s of system time per GB read on
    this project's 2-core machine, against 0.2 s direct: docs/benchmarks.md).

    Raises:
        ValueError: the variable is set to something else.
    """
    return _switch(RAM_DIRECT_IO_ENV)


def ram_two_pass() -> bool:
    """Whether the RAM tier's CPU share runs in two passes per MoE layer (the default): the experts already in RAM
    slots at the layer's plan while the reads of the others end, then those, so that the CPU computes while the disk
    reads. ``HYBRIMOE_RAM_TWO_PASS`` set to ``0`` / ``off`` waits for every read first (one pass), for comparisons
    (bench/bench_ram_real.py's ``hybrimoe-one-pass``); ``1`` / ``on`` is the default. The numbers are the same either
    way.

    Raises:
        ValueError: the variable is set to something else.
    """
    return _switch(RAM_TWO_PASS_ENV)


def ram_repack() -> bool:
    """Whether the RAM tier repacks each expert matrix after its read into upstream's CPU_REPACK layout (where
    llama.cpp would repack that CPU weight), so that its CPU share runs the repacked kernels. Off by default: a RAM
    slot's expert serves a few tokens before it is evicted, and the repack (a pass over the matrix on the I/O
    thread, which shares the cores with the CPU share) costs more than the repacked kernels save: on this project's
    2-core machine, prefill 13.2 against 15.8 tokens/s and decode 2.9 against 3.9 with it (docs/benchmarks.md).
    ``HYBRIMOE_RAM_REPACK`` set to ``1`` / ``on`` turns it on.

    Raises:
        ValueError: the variable is set to something else.
    """
    return _switch(RAM_REPACK_ENV, default=False)


def progress_on() -> bool:
    """Whether commands draw progress bars: on a terminal (stderr), or anywhere with ``HYBRIMOE_PROGRESS`` set;
    never into a redirected file or pipe otherwise."""
    return sys.stderr.isatty() or bool(os.environ.get(PROGRESS_ENV))


def trace_override() -> Path | None:
    """``$HYBRIMOE_TRACE`` as a path, or None when unset (:func:`hybrimoe.traces.format.default_trace_path`)."""
    env = os.environ.get(TRACE_ENV)
    return Path(env) if env else None


def rpc_timeout_s() -> float:
    """Seconds allowed to connect to an RPC server and get its HELLO reply: ``$HYBRIMOE_RPC_TIMEOUT_S`` when it is a
    positive number, else :data:`RPC_TIMEOUT_S`."""
    try:
        t = float(os.environ.get(RPC_TIMEOUT_ENV) or RPC_TIMEOUT_S)
    except ValueError:
        t = RPC_TIMEOUT_S
    return t if t > 0 else RPC_TIMEOUT_S


def max_buffer_bytes() -> int:
    """``$HYBRIMOE_MAX_BUFFER_BYTES`` as bytes (0 when unset: the device's own cap only).

    Raises:
        ValueError: set to something other than a positive integer.
    """
    raw = os.environ.get(MAX_BUFFER_ENV, "").strip()
    if not raw:
        return 0
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"{MAX_BUFFER_ENV} must be a positive number of bytes, got {raw!r}")
    return n
