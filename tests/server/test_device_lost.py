"""``hybrimoe serve`` whose device dies under it (its RPC server killed after a first completion): ``/health`` says
503 with the reason, requests get 503 naming the device (no wording meant for Python callers), and then, as
``--on-device-lost`` chooses, the server exits with status 3 (a supervisor restarts it) or reloads the model once
the device answers again on the same address."""
from __future__ import annotations

import time

import pytest

from hybrimoe.runtime.rpc import RPCServer, free_port
from hybrimoe.testing.processes import start_serve

BODY = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0.0}


@pytest.fixture
def served(tiny_model, tmp_path):
    """(start(mode) -> (serve process, RPC server, port)); everything is stopped at the end."""
    made = []

    def start(mode: str):
        port = free_port()
        rpc = RPCServer(port=port, threads=1).start()
        made.append(rpc)
        srv = start_serve(["-m", str(tiny_model("qwen3moe", "Q8_0")), "--rpc", rpc.endpoint, "-ngl", "99",
                           "--moe-cache", "50%", "--moe-cost-model", "rtx4090-desktop", "-c", "256", "-t", "1",
                           "--on-device-lost", mode], tmp_path)
        made.append(srv)
        return srv, rpc, port

    yield start
    for thing in reversed(made):
        thing.stop()


def _lose_the_device(srv, rpc):
    status, models = srv.request("GET", "/v1/models")
    status, body = srv.request("POST", "/v1/completions", BODY)
    # a request that names no model gets the name /v1/models lists, not the file's path
    assert status == 200 and body["model"] == models["data"][0]["id"], (status, body, models)
    assert srv.request("GET", "/health") == (200, {"status": "ok"})
    rpc.stop()
    status, body = srv.request("POST", "/v1/completions", BODY)
    assert status == 503, (status, body, srv.log())
    err = body["error"]
    assert err["code"] == "device_unavailable" and rpc.endpoint in err["message"], body
    assert "close it" not in err["message"] and "Traceback" not in str(body)
    return err


def _wait(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


def test_exit_mode_answers_503_then_exits_with_status_3(served):
    srv, rpc, _ = served("exit")
    _lose_the_device(srv, rpc)
    try:
        srv.proc.wait(timeout=60)
    except Exception:
        pytest.fail(f"the server did not exit after losing its device:\n{srv.log()}")
    assert srv.proc.returncode == 3, srv.log()
    assert "the model's device is gone" in srv.stderr_path.read_text() and rpc.endpoint in srv.log()


def test_reload_mode_serves_again_once_the_device_is_back(served):
    srv, rpc, port = served("reload")
    _lose_the_device(srv, rpc)
    status, body = srv.request("GET", "/health")
    assert status == 503 and body["status"] == "error" and rpc.endpoint in body["reason"], body
    status, body = srv.request("POST", "/v1/completions", BODY)  # still gone: 503 at once, no wait for the model
    assert status == 503 and body["error"]["code"] == "device_unavailable"
    back = RPCServer(port=port, threads=1).start()
    try:
        assert _wait(lambda: srv.request("GET", "/health", timeout=10)[0] == 200, 120), srv.log()
        status, body = srv.request("POST", "/v1/completions", BODY)
        assert status == 200 and body["choices"][0]["text"], (status, body)
        assert srv.proc.poll() is None
        assert "model reloaded" in srv.stderr_path.read_text()
    finally:
        srv.stop()
        back.stop()
