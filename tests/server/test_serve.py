"""``hybrimoe serve``: a real server process on 127.0.0.1 (a free port it picks and prints) serving a tiny qwen3moe
model with a chat template, on the RPC stand-in "GPU" with the hybrid engine (``--moe-cache 25%``), talked to
with the ``openai`` client and raw HTTP.

Oracle: an in-process ``hybrimoe.Llama`` with the server's settings (same file, its own RPC stand-in, the engine at
25%, same context and threads): the server's greedy completions and chats must be its text, streamed or not, one
client or four at once. One server for the module; every wait has a deadline; the server is killed at the end
whatever happened.
"""
from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from hybrimoe.testing.processes import start_serve

KEY = "sk-hybrimoe-test"
ALIAS = "tiny-moe"
N_CTX = 256
N_TOK = 8  # tokens per checked answer
LONG = 160  # tokens of a stream that must still run while the test looks (min_tokens: no early end)
# llama-cpp-python's Jinja formatter renders it (llama_cpp.llama_chat_format.Jinja2ChatFormatter); no BOS in it
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# greedy; the server's request types default repeat_penalty to 1.1 where Llama's methods use 1.0
GREEDY = {"temperature": 0.0, "repeat_penalty": 1.0}
PROMPTS = ["Once upon a time", "The quick brown fox", "In the beginning the", "Hello world, this is"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
STARTUP_S = 180  # model load and engine set-up, on a busy 2-core machine
REQUEST_S = 120


class Server:
    def __init__(self, proc: subprocess.Popen, stderr_path, port: int, out: list[str]):
        self.proc, self.stderr_path, self.port, self.out = proc, stderr_path, port, out
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return "stdout:\n" + "".join(self.out) + "\nstderr:\n" + self.stderr_path.read_text(errors="replace")

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, timeout=REQUEST_S, max_retries=0, **kw)


def request(server: Server, method: str, path: str, body=None, *, raw: bytes | None = None, key: str | None = KEY,
            timeout: float = REQUEST_S):
    """One HTTP request on a new connection: (status, content type, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


def stats(server: Server) -> dict:
    status, _, body = request(server, "GET", "/moe/stats", timeout=30)
    assert status == 200, body
    return json.loads(body)


def lookups(s: dict) -> int:
    c = s["engine"]["cache"]
    return c["hits"] + c["misses"]


def open_stream(server: Server, prompt: str, n: int):
    """A streamed completion of exactly ``n`` tokens on a raw connection, read up to its first data event:
    (connection, response)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_S)
    body = {"model": ALIAS, "prompt": prompt, "max_tokens": n, "min_tokens": n, "stream": True, **GREEDY}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    while True:
        line = resp.readline()
        assert line, "the stream ended before its first event"
        if line.startswith(b"data: "):
            assert line.strip() != b"data: [DONE]"
            return conn, resp


def read_rest(resp) -> list[str]:
    """The text pieces of the rest of a stream (to its [DONE])."""
    pieces = []
    for line in iter(resp.readline, b""):
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                break
            pieces.append(json.loads(data)["choices"][0]["text"])
    return pieces


@pytest.fixture(scope="module")
def chat_model(tiny_model):
    return tiny_model("qwen3moe", "Q8_0", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def server(chat_model, rpc_server_factory, tmp_path_factory):
    # its own RPC stand-in: a ggml RPC server serves one client at a time, and the oracle uses the session's
    rpc = rpc_server_factory()
    tmp = tmp_path_factory.mktemp("serve")
    sp = start_serve(["-m", str(chat_model), "--rpc", rpc.endpoint, "-ngl", "99", "--moe-cache", "25%", "-c",
                      str(N_CTX), "-t", "2", "--api-key", KEY, "--alias", ALIAS], tmp, startup_s=STARTUP_S)
    try:
        srv = Server(sp.proc, sp.stderr_path, sp.port, sp.out)
        status, _, body = request(srv, "GET", "/health", key=None, timeout=30)
        assert status == 200 and json.loads(body) == {"status": "ok"}, body
        yield srv
    finally:
        sp.stop()


@pytest.fixture(scope="module")
def oracle(chat_model, rpc_server):
    from hybrimoe import Llama

    llm = Llama(str(chat_model), rpc_servers=rpc_server.endpoint, n_gpu_layers=99, moe_cache="25%", n_ctx=N_CTX,
                n_threads=2, n_threads_batch=2, flash_attn="auto", verbose=False)  # the server's (-fa: auto)
    memo: dict = {}

    class Oracle:
        llama = llm

        @staticmethod
        def complete(prompt: str, n: int = N_TOK) -> dict:
            if ("c", prompt, n) not in memo:
                memo[("c", prompt, n)] = llm.create_completion(prompt, max_tokens=n, **GREEDY)
            return memo[("c", prompt, n)]

        @staticmethod
        def chat(n: int = N_TOK) -> dict:
            if ("chat", n) not in memo:
                memo[("chat", n)] = llm.create_chat_completion(MESSAGES, max_tokens=n, **GREEDY)
            return memo[("chat", n)]

    try:
        yield Oracle
    finally:
        llm.close()


def test_models_lists_the_alias(server):
    assert [m.id for m in server.client().models.list().data] == [ALIAS]


def test_greedy_completions_equal_llama(server, oracle):
    client = server.client()
    for prompt in PROMPTS[:2]:
        want = oracle.complete(prompt)
        assert want["choices"][0]["text"], "the oracle generated nothing: the comparison would be empty"
        got = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=N_TOK, temperature=0,
                                        extra_body={"repeat_penalty": 1.0})
        assert got.choices[0].text == want["choices"][0]["text"]
        assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]
        assert got.usage.completion_tokens == want["usage"]["completion_tokens"]


def test_stream_chunks_concatenate_to_the_text(server, oracle):
    want = oracle.complete(PROMPTS[0])["choices"][0]["text"]
    stream = server.client().completions.create(model=ALIAS, prompt=PROMPTS[0], max_tokens=N_TOK, temperature=0,
                                                extra_body={"repeat_penalty": 1.0}, stream=True)
    pieces = [c.choices[0].text for c in stream]
    assert len([p for p in pieces if p]) > 1, pieces  # streamed, not one block
    assert "".join(pieces) == want


def test_logprobs_are_served_without_logits_all(server, oracle):
    """The server loads the model without ``logits_all`` (llama-cpp-python's path then refuses logprobs, and
    ``logits_all`` would cost every prompt token its logits); a request with logprobs, streamed or not, gets them:
    the greedy text of the oracle and the logprobs the in-process batch API gives (``create_completions``, one slot:
    the same decodes; tests/runtime/test_batch.py checks those against llama-cpp-python's with ``logits_all``), each
    streamed chunk with its token's."""
    want_text = oracle.complete(PROMPTS[0])["choices"][0]["text"]
    want = oracle.llama.create_completions([PROMPTS[0]], max_tokens=N_TOK, logprobs=2, **GREEDY)[0]
    body = {"model": ALIAS, "prompt": PROMPTS[0], "max_tokens": N_TOK, "logprobs": 2, **GREEDY}
    status, _, got = request(server, "POST", "/v1/completions", body)
    assert status == 200, got
    got = json.loads(got)["choices"][0]
    assert got["text"] == want_text == want["choices"][0]["text"]
    a, b = want["choices"][0]["logprobs"], got["logprobs"]
    assert b["tokens"] == a["tokens"] and b["text_offset"] == a["text_offset"] and len(b["tokens"]) > 0
    # the server's engine and the oracle's plan on their own (two RPC stand-ins): values within 1e-4
    np.testing.assert_allclose(b["token_logprobs"], a["token_logprobs"], rtol=0, atol=1e-4)
    assert [x.keys() for x in b["top_logprobs"]] == [x.keys() for x in a["top_logprobs"]]
    status, _, raw = request(server, "POST", "/v1/completions", dict(body, stream=True))
    assert status == 200, raw
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line.strip() != "data: [DONE]"]
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == got["logprobs"]["tokens"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want_text
    # the model's own path afterwards starts from the context the batch path left empty
    assert oracle.complete(PROMPTS[1])["choices"][0]["text"] == json.loads(request(
        server, "POST", "/v1/completions", {"model": ALIAS, "prompt": PROMPTS[1], "max_tokens": N_TOK,
                                            **GREEDY})[2])["choices"][0]["text"]


def test_clients_that_leave_a_logprobs_stream_strand_nothing(server, oracle):
    """Logprobs at --parallel 1 run on the request's own thread: a client that leaves such a stream after its first
    event, again and again, leaves nothing behind that blocks or changes the next requests (each still the oracle's
    answer)."""
    body = {"model": ALIAS, "prompt": PROMPTS[0], "max_tokens": 200, "logprobs": 2, "stream": True, **GREEDY}
    want = oracle.complete(PROMPTS[1])["choices"][0]["text"]
    for _ in range(5):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_S)
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        assert resp.status == 200
        while not resp.readline().startswith(b"data: "):
            pass
        conn.close()  # gone after the first event
        status, _, got = request(server, "POST", "/v1/completions",
                                 {"model": ALIAS, "prompt": PROMPTS[1], "max_tokens": N_TOK, "logprobs": 1, **GREEDY})
        assert status == 200 and json.loads(got)["choices"][0]["text"] == want, got
        status, _, got = request(server, "POST", "/v1/completions",
                                 {"model": ALIAS, "prompt": PROMPTS[1], "max_tokens": N_TOK, **GREEDY})
        assert status == 200 and json.loads(got)["choices"][0]["text"] == want, got


def test_logprobs_with_echo_are_refused_naming_echo(server):
    status, _, got = request(server, "POST", "/v1/completions", {"model": ALIAS, "prompt": "Hi", "max_tokens": 2,
                                                                  "logprobs": 1, "echo": True, **GREEDY})
    assert status == 400, got
    msg = json.loads(got)["error"]["message"]
    assert "logprobs cannot go with echo" in msg and "logits_all=False" not in msg, msg


def test_chat_uses_the_models_template(server, oracle):
    import jinja2

    want = oracle.chat()
    content = want["choices"][0]["message"]["content"]
    assert content, "the oracle's chat is empty"
    # the prompt is the model's own template rendered (llama-cpp-python's fallback format would differ), tokenized
    # without a BOS of its own: a template writes its special tokens itself (llama-cpp-python's Jinja2ChatFormatter
    # says added_special)
    rendered = jinja2.Template(TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    n_prompt = len(oracle.llama.tokenize(rendered.encode(), add_bos=False, special=True))
    client = server.client()
    got = client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=N_TOK, temperature=0,
                                         extra_body={"repeat_penalty": 1.0})
    assert got.choices[0].message.content == content
    assert got.usage.prompt_tokens == n_prompt == want["usage"]["prompt_tokens"]
    stream = client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=N_TOK, temperature=0,
                                            extra_body={"repeat_penalty": 1.0}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content


def test_four_concurrent_streams_each_get_their_own_answer(server, oracle):
    """One request at a time on the model and no interruption by default: each of four simultaneous streams gets
    the whole of its single-client answer (with llama-cpp-python's default interrupt_requests, the running stream
    would end early once another waits)."""
    want = {p: oracle.complete(p)["choices"][0]["text"] for p in PROMPTS}
    assert len(set(want.values())) > 1, "the prompts give the same answer: a mix-up would go unseen"
    got: dict = {}
    errors: list = []
    barrier = threading.Barrier(len(PROMPTS), timeout=60)

    def one(prompt):
        try:
            client = server.client()
            barrier.wait()
            stream = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=N_TOK, temperature=0,
                                               extra_body={"repeat_penalty": 1.0}, stream=True)
            got[prompt] = "".join(c.choices[0].text for c in stream)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((prompt, repr(e)))

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * REQUEST_S)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a client got no whole answer in time"
    assert got == want


def test_stats_are_served_while_a_stream_holds_the_model(server):
    """/moe/stats answers during a stream (it reads the snapshot published after each decode, not the model behind
    its lock): mid-stream figures lie strictly between those before and after the stream."""
    before = stats(server)
    conn, resp = open_stream(server, PROMPTS[1], LONG)
    try:
        during = stats(server)
        pieces = read_rest(resp)
    finally:
        conn.close()
    after = stats(server)
    assert len(pieces) >= LONG // 2, "the stream did not run"
    assert during["model_busy"] is True
    assert lookups(before) < lookups(during) < lookups(after)
    assert before["decodes"] < during["decodes"] < after["decodes"]
    e = after["engine"]
    assert e["n_slots"] > 0 and 0.0 <= e["hit_rate"] <= 1.0 and e["cost_model"]
    assert len(e["layers"]) > 0


def test_metrics_match_the_stats(server):
    status, ctype, body = request(server, "GET", "/metrics")
    assert status == 200 and ctype.startswith("text/plain"), body
    s = stats(server)  # idle: nothing decodes between the two
    text = body.decode()
    label = f'{{model="{ALIAS}"}}'
    assert f"hybrimoe_decodes_total{label} {s['decodes']}\n" in text
    assert f"hybrimoe_cache_hits_total{label} {s['engine']['cache']['hits']}\n" in text
    assert f"hybrimoe_cache_misses_total{label} {s['engine']['cache']['misses']}\n" in text
    assert "# TYPE hybrimoe_experts_total counter" in text


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-only", "gpu-cache-above"])
def test_the_ram_tier_is_served_with_its_stats(gpu, chat_model, rpc_server_factory, tmp_path):
    """``hybrimoe serve --moe-ram-cache`` (CPU only, or with a GPU cache above it on the RPC stand-in) completes, and
    ``/moe/stats`` and ``/metrics`` carry the RAM tier's counters (``engine["ram"]``), and the GPU's with one."""
    from hybrimoe.runtime.engine_facts import engine_facts

    f = engine_facts(chat_model)
    budget = f.n_expert * f.ram_slot_bytes  # one MoE layer's experts: every token reads from the file
    # a server of its own: an RPC server serves one client at a time, and this process may hold the shared one
    extra = (["--rpc", rpc_server_factory().endpoint, "-ngl", "99", "--moe-cache", str(f.top_k * f.slot_bytes)]
             if gpu else [])
    sp = start_serve(["-m", str(chat_model), "--moe-ram-cache", str(budget), "-ub", "8", "-c", str(N_CTX), "-t", "2",
                      "--api-key", KEY, "--alias", ALIAS, *extra], tmp_path, startup_s=STARTUP_S)
    try:
        srv = Server(sp.proc, sp.stderr_path, sp.port, sp.out)
        status, _, body = request(srv, "POST", "/v1/completions",
                                  {"model": ALIAS, "prompt": "Once upon a time", "max_tokens": 6, **GREEDY})
        assert status == 200, body
        s = stats(srv)
        ram = s["engine"]["ram"]
        assert ram["accesses"] > 0 and ram["bytes_read"] > 0 and 0 <= ram["hit_rate"] <= 1, ram
        status, _, text = request(srv, "GET", "/metrics")
        assert status == 200
        assert f'hybrimoe_ram_hits_total{{model="{ALIAS}"}} {ram["hits"]}\n' in text.decode()
        if gpu:
            assert s["engine"]["n_slots"] == f.top_k and s["engine"]["cache"]["accesses"] > 0, s["engine"]
    finally:
        sp.stop()


LONG_PROMPT = "once upon a time " * 120  # > N_CTX tokens


@pytest.mark.parametrize("case, method, path, body, key, status, code", [
    ("bad JSON", "POST", "/v1/completions", b'{"prompt": "Hi", ', KEY, 400, None),
    ("negative max_tokens", "POST", "/v1/completions", {"model": ALIAS, "prompt": "Hi", "max_tokens": -1}, KEY,
     400, None),
    ("prompt of the wrong type", "POST", "/v1/completions", {"model": ALIAS, "prompt": 5}, KEY, 400, None),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-4o", "prompt": "Hi", "max_tokens": 2}, KEY, 404,
     "model_not_found"),
    ("unknown model, streamed", "POST", "/v1/chat/completions",
     {"model": "gpt-4o", "messages": MESSAGES, "stream": True}, KEY, 404, "model_not_found"),
    ("prompt longer than the context", "POST", "/v1/completions",
     {"model": ALIAS, "prompt": LONG_PROMPT, "max_tokens": 2}, KEY, 400, "context_length_exceeded"),
    ("prompt longer than the context, streamed", "POST", "/v1/completions",
     {"model": ALIAS, "prompt": LONG_PROMPT, "max_tokens": 2, "stream": True}, KEY, 400, "context_length_exceeded"),
    ("chat longer than the context, streamed", "POST", "/v1/chat/completions",
     {"model": ALIAS, "messages": [{"role": "user", "content": LONG_PROMPT}], "stream": True}, KEY, 400,
     "context_length_exceeded"),
    ("no API key", "POST", "/v1/completions", {"model": ALIAS, "prompt": "Hi"}, None, 401, "invalid_api_key"),
    ("wrong API key", "POST", "/v1/chat/completions", {"model": ALIAS, "messages": MESSAGES}, "sk-wrong", 401,
     "invalid_api_key"),
    ("stats without the key", "GET", "/moe/stats", None, None, 401, "invalid_api_key"),
    ("embeddings from a model not loaded for them", "POST", "/v1/embeddings", {"model": ALIAS, "input": "Hi"}, KEY,
     400, "embeddings_not_enabled"),
    ("unknown path", "GET", "/v1/nothing", None, KEY, 404, None),
    # llama-cpp-python would add llama.cpp's NULL grammar sampler to its chain and crash the server
    ("grammar llama.cpp cannot parse", "POST", "/v1/completions",
     {"model": ALIAS, "prompt": "Hi", "max_tokens": 2, "grammar": "root ::= ("}, KEY, 400, None),
])
def test_bad_requests_get_openai_errors(server, case, method, path, body, key, status, code):
    raw = body if isinstance(body, bytes) else None
    got_status, ctype, payload = request(server, method, path, None if raw else body, raw=raw, key=key)
    assert got_status == status, (case, payload)
    assert ctype.startswith("application/json"), (case, ctype, payload)
    err = json.loads(payload)["error"]
    assert set(err) >= {"message", "type", "code"}, err
    assert err["message"] and "Traceback" not in err["message"], err
    assert err["type"] == "invalid_request_error", err
    if code is not None:
        assert err["code"] == code, err
    assert server.proc.poll() is None, server.log()


def test_the_server_serves_on_after_bad_requests(server, oracle):
    for raw in (b"{", b"[]", b'{"prompt": []}'):
        assert request(server, "POST", "/v1/completions", raw=raw)[0] == 400
    status, _, body = request(server, "POST", "/v1/completions",
                              {"model": ALIAS, "prompt": PROMPTS[0], "max_tokens": N_TOK, **GREEDY})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"] == oracle.complete(PROMPTS[0])["choices"][0]["text"]
    assert "Traceback" not in server.log()


def test_a_client_gone_mid_stream_frees_the_model(server, oracle):
    """A client that closes its connection mid-stream stops its generation (a few tokens later, not LONG): the next
    request gets its whole answer, and the decodes counted meanwhile are far fewer than the abandoned stream's."""
    d0 = stats(server)["decodes"]
    conn, resp = open_stream(server, PROMPTS[2], LONG)
    conn.sock.shutdown(2)
    conn.close()
    status, _, body = request(server, "POST", "/v1/completions",
                              {"model": ALIAS, "prompt": PROMPTS[3], "max_tokens": N_TOK, **GREEDY})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"] == oracle.complete(PROMPTS[3])["choices"][0]["text"]
    d1 = stats(server)["decodes"]
    assert d1 - d0 < LONG // 2, f"{d1 - d0} decodes: the abandoned stream ran on"


@pytest.mark.parametrize("flags, message", [(["--port", "70000"], "argument --port: must be in 0..65535"),
                                            (["--chat-format", "no-such-format"], "--chat-format"),
                                            (["-c", "-1"], "argument -c/--ctx-size: must be >= 0")])
def test_bad_flags_are_named(flags, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "serve", *flags], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_sigterm_stops_the_server_cleanly(server):
    """SIGTERM during a stream: the server stops (the stream ends), closes the model and exits with 0. Last test
    of the module: the server is gone after it."""
    conn, resp = open_stream(server, PROMPTS[0], LONG)
    try:
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(timeout=60)
        try:
            read_rest(resp)  # ends (whole, or cut when the server went)
        except (http.client.HTTPException, OSError):
            pass
    finally:
        conn.close()
    assert rc == 0, server.log()
    assert "Traceback" not in server.log(), server.log()
