"""Start and stop a local ``ggml-rpc-server``: a separate-memory "GPU" device for machines without one.

The ggml RPC backend (upstream ``tools/rpc``) with ``--device CPU`` serves a CPU as a device whose memory is
reached only through the RPC protocol, like a GPU's. hybrimoe's tests and benchmarks use it as the accelerator
stand-in (docs/design.md §12). It binds to 127.0.0.1 only and serves one client at a time (a second client's
handshake waits until the first disconnects), so each process that needs one starts its own.

With ``stats_path`` the server tallies the commands it serves (hybrimoe patch 0004, ``HYBRIMOE_RPC_STATS`` in its
environment): device-side counts of host-to-device and device-to-host transfers. :func:`read_stats` reads them.
With ``memory_bytes`` it reports a device of that size (hybrimoe patch 0006, ``HYBRIMOE_RPC_MEMORY``): free memory
is that less the buffers the client holds, as a GPU's would be.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

from hybrimoe import _ggml
from hybrimoe._lib import LIB_DIR, server_env
from hybrimoe.envs import RPC_MEMORY_ENV as MEMORY_ENV
from hybrimoe.envs import RPC_STATS_ENV as STATS_ENV

SERVER_BIN = LIB_DIR / "ggml-rpc-server"
STATS_SCHEMA = "hybrimoe.rpc_stats/1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RPCServer:
    """A ``ggml-rpc-server --device CPU`` child process on 127.0.0.1.

    Use as a context manager; ``endpoint`` is ``"127.0.0.1:PORT"`` for ``Llama(rpc_servers=...)`` / ``--rpc``.

    Args:
        port: TCP port (default: a free one).
        threads: CPU threads of the server.
        device: ggml device the server exposes (``CPU`` for the stand-in).
        startup_timeout_s: seconds to wait until the port accepts connections.
        stats_path: tally the commands served into this file (appended: one JSON record per client connection,
            written when the client disconnects; see :func:`read_stats`). None: no tally, whatever
            ``$HYBRIMOE_RPC_STATS`` says.
        memory_bytes: report a device of this many bytes (free: that less the client's buffers). None: the
            device's own figures (the host's RAM for ``CPU``), whatever ``$HYBRIMOE_RPC_MEMORY`` says.
    Raises:
        FileNotFoundError: the server binary was not built.
        ValueError: ``stats_path`` is a directory or its directory does not exist; ``memory_bytes`` < 1.
        RuntimeError: the server exited or did not listen in time (its output is in the message).
    """

    def __init__(self, port: int | None = None, threads: int = 1, device: str = "CPU",
                 startup_timeout_s: float = 30.0, stats_path: str | os.PathLike | None = None,
                 memory_bytes: int | None = None):
        if not SERVER_BIN.exists():
            raise FileNotFoundError(f"{SERVER_BIN} is missing: hybrimoe's native part was not built")
        self.stats_path: Path | None = None
        if stats_path is not None:
            sp = Path(stats_path).absolute()  # the server may not share our idea of the working directory
            if sp.is_dir():
                raise ValueError(f"stats_path {sp} is a directory; give a file to append the records to")
            if not sp.parent.is_dir():
                raise ValueError(f"stats_path {sp}: directory {sp.parent} does not exist")
            self.stats_path = sp
        if memory_bytes is not None and (isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int)
                                         or memory_bytes < 1):
            raise ValueError(f"memory_bytes must be a positive integer, got {memory_bytes!r}")
        self.memory_bytes = memory_bytes
        self.port = port or free_port()
        self.threads = threads
        self.device = device
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log_path: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "RPCServer":
        import tempfile

        fd, log = tempfile.mkstemp(prefix="ggml-rpc-server-", suffix=".log")
        self._log_path = Path(log)
        cmd = [str(SERVER_BIN), "--device", self.device, "-H", "127.0.0.1", "-p", str(self.port),
               "-t", str(self.threads)]
        env = server_env(os.environ)
        env.pop(STATS_ENV, None)
        env.pop(MEMORY_ENV, None)
        if self.stats_path is not None:
            env[STATS_ENV] = str(self.stats_path)
        if self.memory_bytes is not None:
            env[MEMORY_ENV] = str(self.memory_bytes)
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, preexec_fn=_die_with_parent)
        os.close(fd)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ggml-rpc-server exited with {self.proc.returncode}: {self.log()}")
            if _listening(self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"ggml-rpc-server did not listen on {self.endpoint} within "
                           f"{self.startup_timeout_s:.0f} s: {self.log()}")

    def log(self) -> str:
        """What the server printed so far."""
        try:
            return self._log_path.read_text(errors="replace") if self._log_path else ""
        except OSError:
            return ""

    def wait_stats(self, timeout_s: float = 10.0) -> list[dict]:
        """The tally's records (:func:`read_stats`) once those of every connection that ended before this call
        are written.

        The server serves one client at a time and writes a connection's record before it takes the next, so
        this does an RPC handshake of its own (which adds a record: ``HELLO`` only) and reads the file after the
        reply.

        Raises:
            ValueError: the server was started without ``stats_path``.
            TimeoutError: no handshake reply within ``timeout_s`` (a client is still connected).
        """
        if self.stats_path is None:
            raise ValueError("this RPCServer was started without stats_path: it keeps no tally")
        try:
            _ggml.check_rpc_server(self.endpoint, "127.0.0.1", self.port, timeout=timeout_s)
        except ValueError:
            raise TimeoutError(f"ggml-rpc-server {self.endpoint} did not take a new connection within "
                               f"{timeout_s:g} s: is a client (a Llama not closed) still connected?") from None
        return read_stats(self.stats_path)

    def stop(self) -> None:
        """Terminate the server (kill after 5 s) and remove its log."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log_path:
            self._log_path.unlink(missing_ok=True)

    def __enter__(self) -> "RPCServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def read_stats(path: str | os.PathLike) -> list[dict]:
    """Records of an RPC server's command tally (``RPCServer(stats_path=...)``), oldest first.

    One record per client connection (schema ``hybrimoe.rpc_stats/1``): ``connection`` (1, 2, ... since the
    server started), ``seconds`` (its length), ``graph_computes`` (GRAPH_COMPUTE + GRAPH_RECOMPUTE),
    ``h2d_bytes`` (tensor data that SET_TENSOR wrote to the device), ``d2h_bytes`` (tensor data that GET_TENSOR
    returned to the host), and ``commands``: per command served (``SET_TENSOR``, ``GET_TENSOR``,
    ``COPY_TENSOR``, ``GRAPH_COMPUTE``, ...), ``count``, ``bytes_in`` and ``bytes_out`` (payload bytes of the
    requests and replies, without the command byte and size fields). Besides the connection that holds a model
    (its record has ``ALLOC_BUFFER``), ggml's RPC client opens short ones of its own (a device-memory query,
    ``GET_DEVICE_MEMORY``, when nothing holds a connection) and hybrimoe checks a server with a handshake
    (``HELLO`` only): each has its record. A server killed with a client connected writes no record for it.

    A missing file gives no records (no connection ended yet, or the tally is off); a last line without its
    newline is a record being written and is left out.

    Raises:
        ValueError: a line is not a record of this schema (the message names the line).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # the part after the last newline is not a whole record yet
    out = []
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{p}:{i}: not a JSON record of the RPC command tally: {e}") from None
        if not isinstance(rec, dict) or rec.get("schema") != STATS_SCHEMA:
            raise ValueError(f"{p}:{i}: not a {STATS_SCHEMA} record")
        out.append(rec)
    return out


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM when the process that started it dies (a crashed test run leaks nothing)
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _listening(port: int) -> bool:
    # read the kernel's socket table instead of connecting: the server serves one client at a time
    hexport = f"{port:04X}"
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                parts = line.split()
                local, state = parts[1], parts[3]
                if local.endswith(":" + hexport) and state == "0A":  # TCP_LISTEN
                    return True
    except OSError:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", port)) == 0
    return False
