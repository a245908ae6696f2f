"""A device that is gone never hangs the process (engine on, RPC stand-in).

Each scenario runs in a child process of its own, with a server of its own (one client per server), so that a
hang fails the test (subprocess timeout) instead of hanging pytest, and an abort cannot take pytest with it. The
child kills its server at one point of a run with the engine on (``moe_cache``) and times what follows:

* ``close``: after a generation; ``Llama.close()`` must return (it frees the slot pool, then the context);
* ``decode``: after a generation; the next completion must raise RuntimeError naming the lost server, and so must
  a second one;
* ``prefill``: from another thread while ``llama_decode`` runs a long prompt (many ubatches); the decode must
  raise;
* ``exit``: after a generation; the interpreter exits without ``close()`` (llama-cpp-python frees at shutdown).

Each must end within 10 s of the kill with the default environment. With ``verbose=True`` (llama-cpp-python's
log callback prints ggml's errors: the callback takes the GIL, the path on which a deadlock bit) the loss is
logged exactly once. The controls run the same steps without the kill: no error, no disconnect line. A server
that is there but silent (SIGSTOP) is noticed only with ``HYBRIMOE_RPC_IO_TIMEOUT_S`` set.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

LIMIT_S = 10.0  # every scenario ends within this after the kill
CHILD_TIMEOUT_S = 150.0

_CHILD = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    from hybrimoe import Llama
    from hybrimoe.runtime.rpc import RPCServer

    model, scenario, how, verbose = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    out = {"errors": []}

    def report():
        print("RESULT " + json.dumps(out), flush=True)

    srv = RPCServer(threads=1).start()
    print("ENDPOINT " + srv.endpoint, flush=True)
    llm = Llama(model, rpc_servers=srv.endpoint, n_gpu_layers=99, n_ctx=512, n_batch=512, n_ubatch=16,
                verbose=verbose, moe_cache="25%", moe_cost_model="rtx4090-desktop")
    if scenario != "prefill":
        out["text"] = llm("Once upon a time", max_tokens=4, temperature=0)["choices"][0]["text"]

    def stop_server():
        if how == "kill":
            srv.proc.kill()
            srv.proc.wait()
        elif how == "stop":  # alive but silent: the kernel still takes its bytes
            os.kill(srv.proc.pid, signal.SIGSTOP)
        out["t_kill"] = time.monotonic()

    def attempt(fn):
        t = time.monotonic()
        try:
            fn()
            out["errors"].append(None)
        except RuntimeError as e:
            out["errors"].append(str(e))
        out.setdefault("attempt_s", []).append(time.monotonic() - t)

    if scenario == "close":
        stop_server()
        t = time.monotonic()
        llm.close()
        out["close_s"] = time.monotonic() - t
    elif scenario == "decode":
        stop_server()
        for _ in range(2):
            attempt(lambda: llm("Hello there", max_tokens=2, temperature=0))
        t = time.monotonic()
        llm.close()
        out["close_s"] = time.monotonic() - t
    elif scenario == "prefill":
        tokens = [llm.token_bos()] + [3 + (7 * i) % 200 for i in range(400)]  # 26 ubatches of 16
        runs = lambda: sum(llm.moe_stats()["runs"])
        base, done = runs(), threading.Event()

        def killer():
            while runs() < base + 3 and not done.is_set():  # a few MoE layer runs into the decode
                time.sleep(0.0005)
            out["decode_running_at_kill"] = not done.is_set()
            out["runs_at_kill"] = runs() - base
            stop_server()

        th = threading.Thread(target=killer)
        th.start()
        try:
            attempt(lambda: llm.eval(tokens))
        finally:
            done.set()
            th.join()
        out["t_first_end"] = time.monotonic()
        out["runs_in_decode"] = runs() - base
        llm.reset()
        attempt(lambda: llm.eval(tokens[:8]))
        t = time.monotonic()
        llm.close()
        out["close_s"] = time.monotonic() - t
    elif scenario == "exit":
        stop_server()
    else:
        raise SystemExit("unknown scenario " + scenario)
    if scenario == "exit":
        out["t_end"] = time.monotonic()
        report()
    else:
        if how == "stop":
            os.kill(srv.proc.pid, signal.SIGCONT)
        srv.stop()
        out["t_end"] = time.monotonic()
        report()
""")


def run_scenario(model, scenario: str, kill: bool | str, verbose: bool, env: dict | None = None
                 ) -> tuple[dict, str, float]:
    """(the child's RESULT, its stderr, seconds from its last statement to its exit). ``kill``: True (SIGKILL
    the server), False (leave it), "stop" (SIGSTOP it, SIGCONT at the end)."""
    import tempfile

    how = kill if isinstance(kill, str) else "kill" if kill else "keep"
    base = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIMOE_RPC_")}  # default timeouts
    env = {**base, "HYBRIMOE_AUTO_CALIBRATE": "0", **(env or {})}
    with tempfile.TemporaryDirectory() as cwd:  # outside the checkout: the installed package is under test
        try:
            r = subprocess.run([sys.executable, "-c", _CHILD, str(model), scenario, how, "1" if verbose else "0"], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                               env=env, cwd=cwd)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"scenario {scenario} hung (no exit within {CHILD_TIMEOUT_S:.0f} s); stdout: "
                        f"{(e.stdout or b'')[-2000:]!r} stderr: {(e.stderr or b'')[-2000:]!r}")
    ended = time.monotonic()
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    res = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res, r.stdout + r.stderr[-3000:]
    out = json.loads(res[-1][len("RESULT "):])
    out["endpoint"] = next(ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("ENDPOINT "))
    # time.monotonic is CLOCK_MONOTONIC, the same clock in both processes
    return out, r.stderr, ended - out["t_end"]


def disconnect_lines(stderr: str, endpoint: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if f"RPC server {endpoint} disconnected" in ln]


def _has_loss_query() -> bool:
    from hybrimoe._lib import LIB_DIR

    try:
        return b"ggml_backend_rpc_connection_error" in (LIB_DIR / "libggml-rpc.so").read_bytes()
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _has_loss_query(),
                                reason="libggml-rpc.so predates hybrimoe patch 0003's loss report (rebuild)")


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3moe", "Q8_0")


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
@pytest.mark.parametrize("scenario", ["close", "decode", "prefill", "exit"])
def test_server_killed(model, scenario, verbose):
    out, err, exit_s = run_scenario(model, scenario, kill=True, verbose=verbose)
    ep = out["endpoint"]
    lost = f"RPC server {ep} disconnected"
    assert exit_s < LIMIT_S, f"the interpreter took {exit_s:.1f} s to exit"
    assert out["t_end"] - out["t_kill"] < LIMIT_S + 1.0, out
    if "close_s" in out:
        assert out["close_s"] < LIMIT_S, out
    if scenario in ("decode", "prefill"):
        # the next call that needs the device raises, naming the server and the cause; so does every later one
        first, second = out["errors"]
        assert first and "llama_decode returned" in first and lost in first, out
        assert "cannot compute any more" in first, out
        assert second and lost in second, out
        assert all(s < LIMIT_S for s in out["attempt_s"]), out
    if scenario == "prefill":
        assert out["decode_running_at_kill"], f"the kill came after the decode: {out}"
        assert out["t_first_end"] - out["t_kill"] < LIMIT_S, out
    lines = disconnect_lines(err, ep)
    if verbose:
        assert len(lines) == 1, f"the loss must be logged once, got {len(lines)}:\n" + "\n".join(lines)
        assert "later calls to it do nothing" in lines[0]
    else:
        assert len(lines) <= 1, lines  # llama-cpp-python shows ggml's errors only when verbose
    # nothing else of the transport is logged for the lost connection (it would come from the worker thread)
    assert "send failed" not in err and "recv failed" not in err, err[-3000:]


@pytest.mark.parametrize("scenario", ["close", "decode", "prefill", "exit"])
def test_control_server_kept(model, scenario):
    """The same steps with the server left running: no error, no disconnect line, prompt ends."""
    out, err, exit_s = run_scenario(model, scenario, kill=False, verbose=True)
    assert exit_s < LIMIT_S
    assert out["errors"] == [None] * len(out["errors"]), out
    if scenario == "decode":
        assert len(out["errors"]) == 2
    if scenario == "prefill":
        assert out["errors"] == [None, None]
        assert out["runs_in_decode"] >= 26, out  # every ubatch ran through the engine's MoE layers
    if scenario != "prefill":
        assert out["text"], out
    assert not disconnect_lines(err, out["endpoint"]), err[-3000:]


def test_server_stopped_with_io_timeout(model):
    """A server that is there but never answers (SIGSTOP: its kernel still acknowledges) is noticed only through
    HYBRIMOE_RPC_IO_TIMEOUT_S (off by default, so that long graph computes are not cut): with 2 s the decode raises
    "no reply" in about 2 s, and close() returns at once."""
    out, err, exit_s = run_scenario(model, "decode", kill="stop", verbose=True,
                                    env={"HYBRIMOE_RPC_IO_TIMEOUT_S": "2"})
    lost = f"RPC server {out['endpoint']} disconnected (no reply within HYBRIMOE_RPC_IO_TIMEOUT_S"
    first, second = out["errors"]
    assert first and lost in first and second and lost in second, out
    assert 1.5 < out["attempt_s"][0] < LIMIT_S, out
    assert out["attempt_s"][1] < 1.0 and out["close_s"] < 1.0, out
    assert len(disconnect_lines(err, out["endpoint"])) == 1
