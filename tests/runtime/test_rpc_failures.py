"""RPC endpoints that fail: a clear Python exception or an error return, never a hang or an abort.

Two layers are tested:

* ``hybrimoe._ggml.add_rpc_server`` checks an endpoint with an RPC handshake of its own before ggml's client
  sees it (pure Python; works with any build): ``Llama(rpc_servers=...)`` raises quickly.
* ggml's RPC client itself (``hybrimoe/lib/libggml-rpc.so``) must not abort or hang; this needs the library
  built with ``vendor/llama.cpp/patches/0003-rpc-client-no-abort.patch``. Those tests are marked
  ``needs_patch_0003`` and skip on an older build. They run in a child process, so that an abort or a hang of
  an unpatched library cannot take pytest with it. ``$HYBRIMOE_TEST_RPC_LIB`` may name another
  ``libggml-rpc.so`` to test (e.g. a fresh build) instead of the installed one.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest


def _rpc_lib() -> Path:
    from hybrimoe._lib import LIB_DIR

    return Path(os.environ.get("HYBRIMOE_TEST_RPC_LIB") or LIB_DIR / "libggml-rpc.so")


def _has_patch_0003() -> bool:
    try:
        return b"HYBRIMOE_RPC_TIMEOUT_S" in _rpc_lib().read_bytes()
    except OSError:
        return False


needs_patch_0003 = pytest.mark.skipif(not _has_patch_0003(),
                                      reason="libggml-rpc.so lacks hybrimoe patch 0003 (rebuild the package)")


class Listener:
    """A TCP listener on 127.0.0.1 that accepts connections and either never answers or sends ``reply``."""

    def __init__(self, reply: bytes | None = None):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.reply = reply
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)  # kept open: a silent peer
            if self.reply is not None:
                try:
                    conn.recv(4096)
                    conn.sendall(self.reply)
                    conn.close()
                except OSError:
                    pass

    def close(self):
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture
def listener():
    made = []

    def make(reply: bytes | None = None) -> Listener:
        made.append(Listener(reply))
        return made[-1]

    yield make
    for lst in made:
        lst.close()


def run_child(code: str, *args: str, timeout: float = 120, env: dict | None = None):
    import tempfile

    with tempfile.TemporaryDirectory() as cwd:  # outside the checkout: the installed package is under test
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)


# -- Python layer (no rebuilt library needed) ------------------------------------------------------------------

def test_silent_listener_raises_quickly(tiny_model, listener, monkeypatch):
    """An endpoint that accepts and never answers (``nc -l``): ValueError within the timeout."""
    from hybrimoe import Llama

    monkeypatch.setenv("HYBRIMOE_RPC_TIMEOUT_S", "1")
    lst = listener()
    t = time.monotonic()
    with pytest.raises(ValueError, match="not a ggml RPC server: no reply.*within 1 s"):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), rpc_servers=lst.endpoint, verbose=False)
    assert time.monotonic() - t < 10


def test_not_an_rpc_server_raises(tiny_model, listener):
    """An endpoint that answers something else (an HTTP server): ValueError naming the endpoint."""
    from hybrimoe import Llama

    lst = listener(b"HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(ValueError, match=f"{lst.endpoint} is not a ggml RPC server.*unexpected reply"):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), rpc_servers=lst.endpoint, verbose=False)


def test_real_server_passes_the_check(rpc_server):
    from hybrimoe import _ggml

    _ggml.check_rpc_server(rpc_server.endpoint, "127.0.0.1", rpc_server.port)  # no exception


# -- ggml's RPC client (needs libggml-rpc.so with patch 0003) --------------------------------------------------

_PRELOAD = """
    import os, sys, ctypes, time
    import hybrimoe
    from hybrimoe import _ggml
    lib = os.environ.get("HYBRIMOE_TEST_RPC_LIB")
    if lib:  # registers as "RPC", so _ggml.rpc_reg() returns it
        assert _ggml.libggml().ggml_backend_load(lib.encode()), lib
"""


@needs_patch_0003
def test_native_client_silent_listener(listener):
    """ggml_backend_rpc_add_server itself, without the Python check: NULL within the timeout, no abort."""
    lst = listener()
    r = run_child(textwrap.dedent(_PRELOAD) + textwrap.dedent("""
        g = _ggml.libggml()
        fn = g.ggml_backend_reg_get_proc_address(_ggml.rpc_reg(), b"ggml_backend_rpc_add_server")
        add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(fn)
        t = time.monotonic()
        reg = add_server(sys.argv[1].encode())
        print("RESULT", reg, round(time.monotonic() - t, 2))
    """), lst.endpoint, timeout=60, env={"HYBRIMOE_RPC_TIMEOUT_S": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    res = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert res and res[0].split()[1] == "None", r.stdout + r.stderr
    assert float(res[0].split()[2]) < 5
    assert f"RPC handshake with {lst.endpoint} failed" in r.stderr


@needs_patch_0003
def test_server_killed_mid_run(tiny_model):
    """The server dies (kill -9) after the model is loaded on it: decode raises, the process lives on."""
    r = run_child(textwrap.dedent(_PRELOAD) + textwrap.dedent("""
        from hybrimoe import Llama
        from hybrimoe.runtime.rpc import RPCServer
        with RPCServer(threads=1) as srv:
            llm = Llama(sys.argv[1], rpc_servers=srv.endpoint, n_gpu_layers=-1, n_ctx=128, verbose=False)
            llm("Once upon a time", max_tokens=2, temperature=0)
            srv.proc.kill()
            srv.proc.wait()
            for i in range(2):
                t = time.monotonic()
                try:
                    llm("Hello there", max_tokens=2, temperature=0)
                    print("NO-ERROR", i)
                except RuntimeError as e:
                    print("ERROR", i, round(time.monotonic() - t, 2), e)
            llm.close()
        print("ALIVE")
    """), str(tiny_model("qwen3moe", "Q8_0")), timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert out[-1] == "ALIVE"
    # a server that dies during a compute may be noticed one command later; by the second call it must be
    errors = [ln for ln in out if ln.startswith("ERROR")]
    assert any(ln.startswith("ERROR 1") for ln in errors), r.stdout
    assert all(float(ln.split()[2]) < 10 for ln in errors), r.stdout


def test_a_busy_server_is_named_busy(rpc_server_factory):
    """ggml-rpc-server serves one client at a time: while one holds it, a second client's handshake waits. The error
    says so (the first thing to check), rather than only "not a ggml RPC server"."""
    import socket
    import struct

    from hybrimoe import _ggml

    server = rpc_server_factory()
    first = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        caps = _ggml._RPC_CONN_CAPS_SIZE
        first.sendall(struct.pack("<BQ", _ggml.RPC_CMD_HELLO, caps) + bytes(caps))
        assert len(first.recv(64)) > 0  # the server now serves this client
        with pytest.raises(ValueError, match=r"is busy with another client \(it serves one at a time\)"):
            _ggml.check_rpc_server(server.endpoint, "127.0.0.1", server.port, timeout=1.0)
    finally:
        first.close()
    _ggml.check_rpc_server(server.endpoint, "127.0.0.1", server.port, timeout=10.0)  # free again: it answers
