"""Start and stop a local ``ggml-rpc-server``: a separate-memory "GPU" device for machines without one.

The ggml RPC backend (upstream ``tools/rpc``) with ``--device CPU`` serves a CPU as a device whose memory is
reached only through the RPC protocol, like a GPU's. hybrimoe's tests and benchmarks use it as the accelerator
stand-in (ARCHITECTURE.md, "Test doubles"). It binds to 127.0.0.1 only and serves one client at a time, so
each process that needs one starts its own.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from ._lib import LIB_DIR

SERVER_BIN = LIB_DIR / "ggml-rpc-server"


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
    Raises:
        FileNotFoundError: the server binary was not built.
        RuntimeError: the server exited or did not listen in time (its output is in the message).
    """

    def __init__(self, port: int | None = None, threads: int = 1, device: str = "CPU",
                 startup_timeout_s: float = 30.0):
        if not SERVER_BIN.exists():
            raise FileNotFoundError(f"{SERVER_BIN} is missing: hybrimoe's native part was not built")
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
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=dict(os.environ), preexec_fn=_die_with_parent)
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
