"""Child processes for tests and scripts that signal them: a child started from a background job (``pytest &``, some
CI runners) inherits SIGINT ignored (POSIX shells ignore it for background jobs), and Python then leaves it ignored,
so a test's Ctrl-C would do nothing. :func:`default_signals` (a ``preexec_fn``) gives the child the default
dispositions, which CPython turns into KeyboardInterrupt as in a terminal."""
from __future__ import annotations

import signal


def default_signals() -> None:
    """``subprocess.Popen(preexec_fn=...)``: SIGINT and SIGTERM back to their default dispositions in the child."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


def read_until(stream, marker: str, timeout_s: float, chunk: int = 64) -> str:
    """Reads ``stream`` (a text pipe) until ``marker`` appears; returns what was read.

    Raises:
        TimeoutError: the marker did not appear within ``timeout_s`` seconds, or the stream ended first (the text
            read so far is in the message).
    """
    import os
    import select
    import time

    seen = ""
    deadline = time.monotonic() + timeout_s
    fd = stream.fileno()
    while marker not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"{marker!r} did not appear within {timeout_s:g} s; read: {seen[-2000:]!r}")
        data = os.read(fd, chunk)
        if not data:
            raise TimeoutError(f"the stream ended before {marker!r}; read: {seen[-2000:]!r}")
        seen += data.decode(errors="replace")
    return seen


class ServeProcess:
    """A ``hybrimoe serve`` child process started by :func:`start_serve`: ``proc``, ``port`` (the one it printed),
    ``url``, the stdout lines read so far (``out``; a thread reads them all, so the pipe never fills) and the path
    of its stderr."""

    def __init__(self, proc, port: int, out: list, stderr_path, reader):
        self.proc, self.port, self.out, self.stderr_path, self._reader = proc, port, out, stderr_path, reader
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        """Its stdout and stderr so far, for an assertion's message."""
        return "stdout:\n" + "".join(self.out) + "\nstderr:\n" + self.stderr_path.read_text(errors="replace")

    def request(self, method: str, path: str, body=None, *, key=None, timeout: float = 120.0):
        """One HTTP request on a new connection: ``(status, parsed JSON body or the raw bytes)``."""
        import http.client
        import json

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"}
            if key is not None:
                headers["Authorization"] = f"Bearer {key}"
            conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            try:
                return resp.status, json.loads(data)
            except ValueError:
                return resp.status, data
        finally:
            conn.close()

    def stop(self) -> None:
        """Kills it if it still runs and waits for it and its reader."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=10)


def start_serve(args: list, cwd, startup_s: float = 180.0) -> ServeProcess:
    """Starts ``python -m hybrimoe serve ARGS --host 127.0.0.1 --port 0`` in ``cwd`` (default signal dispositions)
    and waits for its "ready at" line.

    Raises:
        TimeoutError: no ready line within ``startup_s`` seconds (the child is killed; its output is in the message).
    """
    import re
    import subprocess
    import sys
    import threading
    from pathlib import Path

    stderr_path = Path(cwd) / "serve-stderr.txt"
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "hybrimoe", "serve", *args, "--host", "127.0.0.1", "--port",
                                 "0"], stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
                                cwd=cwd, preexec_fn=default_signals)
    out: list = []
    ready = threading.Event()
    found: list = []

    def read_stdout():
        for line in proc.stdout:
            out.append(line)
            m = re.search(r"ready at http://127\.0\.0\.1:(\d+)/v1", line)
            if m and not found:
                found.append(int(m.group(1)))
                ready.set()
        ready.set()

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    ready.wait(startup_s)
    srv = ServeProcess(proc, found[0] if found else 0, out, stderr_path, reader)
    if not found:
        srv.stop()
        raise TimeoutError(f"no 'ready at' line within {startup_s:g} s (exit code {proc.poll()}):\n{srv.log()}")
    return srv
