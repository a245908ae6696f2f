"""``hybrimoe serve --parallel 4``: concurrent requests share each decode (continuous batching).

A real server process on 127.0.0.1 serving a tiny qwen3moe model over the RAM tier, CPU only. Oracle for a request
that runs alone: ``Llama.create_completions`` in-process with the server's settings (the same batches: the prompt in
one decode, then one token per decode). Requests that overlap are batched with others, and batched kernels round
differently from single ones (upstream's llama-server gives other greedy texts at ``-np 8`` than at ``-np 1``), so
for those the checks are the protocol's and the scheduler's: every answer whole, batches of several sequences run,
slots freed.
"""
from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from hybrimoe.testing.processes import start_serve

N_CTX = 1024
PARALLEL = 4
GREEDY = {"temperature": 0.0, "repeat_penalty": 1.0}
PROMPTS = ["Once upon a time", "The quick brown fox", "In the beginning the", "Hello world, this is",
           "Boats have names", "Every morning the robot", "The harbour was quiet", "Numbers go up"]


def _post(port, path, body, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def _stats(port) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/moe/stats")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _open_stream(port, prompt, max_tokens, eog):
    """A streamed greedy completion (the end of generation masked) read up to its first event: the connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                                             "logit_bias": eog, **GREEDY}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    while not resp.readline().startswith(b"data: "):
        pass
    return conn


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3moe", "Q8_0")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    sp = start_serve(["-m", str(model), "--moe-ram-cache", "50%", "-c", str(N_CTX), "-t", "2", "-b", "64",
                      "--parallel", str(PARALLEL), "--kv-unified", "--max-waiting", "16", "--alias", "tiny"],
                     tmp_path_factory.mktemp("serve-parallel"), startup_s=180)
    try:
        assert any(f"up to {PARALLEL} requests per decode" in line for line in sp.out), sp.log()
        yield sp
    finally:
        sp.stop()


@pytest.fixture(scope="module")
def text_of(model):
    """A prompt of words whose tokens (BOS included) number at most ``n`` and at least ``n - 3``."""
    from hybrimoe import Llama

    llm = Llama(str(model), verbose=False)
    memo = {}

    def make(n: int) -> str:
        if n not in memo:
            words = []
            while len(llm.tokenize(" ".join(words + ["boat"]).encode(), add_bos=True, special=True)) <= n:
                words.append("boat")
            memo[n] = " ".join(words)
        return memo[n]

    yield make
    llm.close()


@pytest.fixture(scope="module")
def eog(model):
    from hybrimoe import Llama
    from hybrimoe._lib import llama_cpp_module

    lc = llama_cpp_module().llama_cpp
    llm = Llama(str(model), verbose=False)
    try:
        return {str(t): -100.0 for t in range(llm.n_vocab()) if lc.llama_vocab_is_eog(llm._model.vocab, t)}
    finally:
        llm.close()


def test_a_request_alone_equals_the_batch_api(server, model):
    from hybrimoe import Llama

    llm = Llama(str(model), moe_ram_cache="50%", n_ctx=N_CTX, n_batch=64, n_threads=2, n_threads_batch=2,
                n_seq_max=PARALLEL, kv_unified=True, flash_attn="auto",
                verbose=False)  # the server's settings (-fa: auto, --kv-unified)
    try:
        want = [llm.create_completions([p], max_tokens=8, **GREEDY)[0] for p in PROMPTS[:2]]
    finally:
        llm.close()
    for p, w in zip(PROMPTS[:2], want):
        status, got = _post(server.port, "/v1/completions", {"prompt": p, "max_tokens": 8, **GREEDY})
        assert status == 200, got
        assert got["choices"][0]["text"] == w["choices"][0]["text"]
        assert got["usage"] == w["usage"] and got["model"] == "tiny"


def test_eight_clients_at_once_share_decodes_and_each_gets_its_answer(server, eog):
    before = _stats(server.port)["parallel"]
    results = [None] * len(PROMPTS)

    def one(i):
        results[i] = _post(server.port, "/v1/completions",
                           {"prompt": PROMPTS[i], "max_tokens": 48, "logit_bias": eog, **GREEDY})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for status, body in results:
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 48
        assert body["choices"][0]["finish_reason"] == "length"
    after = _stats(server.port)["parallel"]
    assert after["slots"] == PARALLEL and after["active"] == 0 and after["waiting"] == 0
    assert after["kv_unified"] is True  # --kv-unified (this tiny model's training context is below -c)
    several = sum(n for k, n in after["sequences_per_step"].items() if int(k) >= 2) - \
        sum(n for k, n in before["sequences_per_step"].items() if int(k) >= 2)
    assert several > 0, after  # steps that carried several requests
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    assert f'hybrimoe_slots{{model="tiny"}} {PARALLEL}' in text and 'hybrimoe_slots_busy{model="tiny"} 0' in text
    assert [d["state"] for d in after["per_slot"]] == ["idle"] * PARALLEL, after
    for i in range(PARALLEL):  # every slot free again, its context empty
        assert f'hybrimoe_slot_busy{{model="tiny",slot="{i}"}} 0' in text
        assert f'hybrimoe_slot_context_tokens{{model="tiny",slot="{i}"}} 0' in text
    assert any(f'hybrimoe_batch_steps_total{{model="tiny",sequences="{k}"}}' in text for k in range(2, PARALLEL + 1))


def _events(resp) -> list[dict]:
    out = []
    for line in iter(resp.readline, b""):
        if line.startswith(b"data: "):
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            out.append(json.loads(data))
    return out


def test_streams_and_chats_run_beside_each_other(server, eog):
    """Completions and chats, streamed and not, at once: each stream's pieces make its text, and a streamed chat's
    content equals the same chat's content unstreamed (a chat has a stop string: text held back for it is sent)."""
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, **GREEDY}
    outs: dict = {}

    def stream(key, path, body):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", path, body=json.dumps(dict(body, stream=True)),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        outs[key] = _events(resp)
        conn.close()

    def whole(key, path, body):
        outs[key] = _post(server.port, path, body)

    jobs = [("s0", stream, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 16, "logit_bias": eog, **GREEDY}),
            ("s1", stream, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 16, "logit_bias": eog, **GREEDY}),
            ("chat-stream", stream, "/v1/chat/completions", chat), ("chat", whole, "/v1/chat/completions", chat)]
    threads = [threading.Thread(target=f, args=(k, p, b)) for k, f, p, b in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for key in ("s0", "s1"):
        events = outs[key]
        assert events[-1]["choices"][0]["finish_reason"] == "length", events
        assert "".join(e["choices"][0]["text"] for e in events), events
    status, body = outs["chat"]
    assert status == 200, body
    want = body["choices"][0]["message"]["content"]
    got = "".join(e["choices"][0]["delta"].get("content") or "" for e in outs["chat-stream"])
    assert got == want, (got, want)


def test_a_client_gone_mid_stream_frees_its_slot(server, eog, text_of):
    before = _stats(server.port)["parallel"]["tokens_decoded"]
    _open_stream(server.port, "Once", 240, eog).close()  # gone after its first token
    deadline = time.monotonic() + 60
    while _stats(server.port)["parallel"]["active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    after = _stats(server.port)["parallel"]
    assert after["active"] == 0
    assert after["tokens_decoded"] - before < 200, (before, after)  # cancelled, not run to its 240 tokens
    # the next request gets a whole sequence's context: a prompt of nearly N_CTX / PARALLEL tokens fits
    status, body = _post(server.port, "/v1/completions", {"prompt": text_of(N_CTX // PARALLEL - 2),
                                                          "max_tokens": 2, **GREEDY})
    assert status == 200, body


def test_a_grammar_a_json_response_format_and_logprobs_are_served_per_request(server):
    status, body = _post(server.port, "/v1/completions", {"prompt": "Hi", "max_tokens": 6,
                                                          "grammar": 'root ::= ("yes" | "no") "."', **GREEDY})
    assert status == 200, body
    assert body["choices"][0]["text"] in ("y", "ye", "yes", "yes.", "n", "no", "no."), body
    status, body = _post(server.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "response_format": {"type": "json_object"},
        **GREEDY})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].lstrip().startswith("{"), body  # the JSON grammar held
    status, body = _post(server.port, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "logprobs": 2, **GREEDY})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and all(v <= 0 for v in lp["token_logprobs"]) and len(lp["top_logprobs"]) == 3


def _stream_events(port, body) -> list[dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        events = []
        for line in iter(resp.readline, b""):
            if line.startswith(b"data: "):
                if line.strip() == b"data: [DONE]":
                    break
                events.append(json.loads(line[6:]))
        return events
    finally:
        conn.close()


def test_streamed_logprobs_join_to_the_answers(server, eog):
    """A streamed answer's logprobs (each chunk its token's, as llama-cpp-python streams them) joined are the
    logprobs of the same request not streamed: its tokens, offsets and values exactly."""
    body = {"prompt": "Once upon a time", "max_tokens": 5, "logprobs": 2, "logit_bias": eog, **GREEDY}
    status, whole = _post(server.port, "/v1/completions", body)
    assert status == 200, whole
    events = _stream_events(server.port, body)
    joined = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for e in events:
        lp = e["choices"][0]["logprobs"]
        assert lp is None or len(lp["tokens"]) == 1, e
        for k in joined:
            joined[k] += lp[k] if lp else []
    assert len(joined["tokens"]) == 5 and joined == whole["choices"][0]["logprobs"]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
    # logprobs=0: each token's own log-probability, no alternatives
    events = _stream_events(server.port, dict(body, logprobs=0))
    tops = [e["choices"][0]["logprobs"]["top_logprobs"][0] for e in events if e["choices"][0]["logprobs"]]
    assert len(tops) == 5 and all(len(d) == 1 for d in tops)


@pytest.mark.parametrize("body, code", [
    ({"prompt": N_CTX // PARALLEL + 10, "max_tokens": 2}, "context_length_exceeded"),
    ({"prompt": "Hi", "max_tokens": 2, "grammar": "root ::= ("}, None),
    ({"prompt": "", "max_tokens": 2}, None),
])
def test_bad_requests_get_400_and_the_server_stays_healthy(server, text_of, body, code):
    if isinstance(body["prompt"], int):
        body = dict(body, prompt=text_of(body["prompt"]) + " boat" * 12)
    status, got = _post(server.port, "/v1/completions", body)
    assert status == 400, got
    assert "error" in got and (code is None or got["error"]["code"] == code), got
    assert not got["error"]["message"].startswith("prompt 0"), got  # one request: no index to name
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()


def _rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_load_of_sixteen_clients_loses_nothing_and_leaks_nothing(server, eog):
    """16 clients, 30 requests each, streamed and not; a quarter of the streams leave after their first event;
    every fourth client also sends a malformed request now and then. Every request that stays gets its whole answer
    (its 8 tokens), the malformed ones a 4xx; afterwards no slot is held, nothing waits, /health is ok, and the
    server's resident memory grew by less than 64 MiB from the first 100 requests to the end."""
    n_clients, per_client = 16, 30
    done = {"ok": 0, "left": 0, "bad": 0}
    failures: list = []
    lock = threading.Lock()
    rss: list = []

    def note(key):
        with lock:
            done[key] += 1
            if sum(done.values()) == 100:
                rss.append(_rss(server.proc.pid))

    def client(c):
        for i in range(per_client):
            body = {"prompt": PROMPTS[(c + i) % len(PROMPTS)], "max_tokens": 8, "logit_bias": eog, **GREEDY}
            try:
                if c % 4 == 3 and i % 5 == 0:  # malformed: a field of the wrong type
                    status, got = _post(server.port, "/v1/completions", dict(body, max_tokens="eight"))
                    (note("bad") if 400 <= status < 500 else failures.append(("malformed", status, got)))
                elif i % 2 == 0:
                    status, got = _post(server.port, "/v1/completions", body)
                    if status == 200 and got["usage"]["completion_tokens"] == 8:
                        note("ok")
                    else:
                        failures.append(("whole", status, got))
                else:
                    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
                    conn.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)),
                                 headers={"Content-Type": "application/json"})
                    resp = conn.getresponse()
                    if resp.status != 200:
                        failures.append(("stream", resp.status, resp.read()))
                    elif c % 4 == 0:  # a quarter of the streams leave after their first event
                        while not resp.readline().startswith(b"data: "):
                            pass
                        note("left")
                    else:
                        events = _events(resp)
                        text = "".join(e["choices"][0]["text"] for e in events)
                        if events and events[-1]["choices"][0]["finish_reason"] == "length" and text:
                            note("ok")
                        else:
                            failures.append(("stream", events))
                    conn.close()
            except Exception as e:  # a lost request
                failures.append(("exception", repr(e)))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not failures, failures[:5]
    assert sum(done.values()) == n_clients * per_client and done["bad"] > 0 and done["left"] > 0, done
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        par = _stats(server.port)["parallel"]
        if par["active"] == 0 and par["waiting"] == 0:
            break
        time.sleep(0.1)
    assert par["active"] == 0 and par["waiting"] == 0, par
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    assert rss and _rss(server.proc.pid) - rss[0] < 64 << 20, (rss, _rss(server.proc.pid))


def test_a_full_queue_gets_429(model, tmp_path, eog):
    """--parallel 2 --max-waiting 0: with both slots held by long streams, a third request gets 429, not a wait."""
    sp = start_serve(["-m", str(model), "-c", "512", "-t", "2", "--parallel", "2", "--max-waiting", "0"], tmp_path,
                     startup_s=180)
    try:
        conns = [_open_stream(sp.port, p, 200, eog) for p in PROMPTS[:2]]
        status, got = _post(sp.port, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 429 and got["error"]["code"] == "too_many_requests", got
        for conn in conns:
            conn.close()
    finally:
        sp.stop()


def test_the_kv_cache_choice_reaches_the_context(model, tmp_path):
    """--no-kv-unified: a KV cache per slot (/moe/stats says so); the default's choice by the training context
    (parallel_kv): unified while the whole context is within it, per slot beyond, a slot's share rounded up to 256
    tokens either way, as llama.cpp rounds a slot's stream."""
    from hybrimoe.commands.serve import gguf_context_length, parallel_kv

    sp = start_serve(["-m", str(model), "--moe-ram-cache", "50%", "-c", "600", "-t", "2", "-b", "64",
                      "--parallel", "2", "--no-kv-unified"], tmp_path, startup_s=180)
    try:
        par = _stats(sp.port)["parallel"]
        assert par["kv_unified"] is False and par["per_slot"][0]["n_ctx"] == 512, par
    finally:
        sp.stop()
    train = gguf_context_length(model)
    assert train and train % 512 == 0  # two slots of train / 2 cells: a multiple of 256 each
    assert parallel_kv(None, train, 2, model) == (True, train)
    assert parallel_kv(None, train + 1, 2, model) == (False, train + 512)  # each slot's share rounded up to 256
    assert parallel_kv(True, train + 1, 2, model) == (True, train + 512)
    assert parallel_kv(False, 600, 2, model) == (False, 1024)
    assert parallel_kv(None, 0, 2, model) == (True, 0)  # -c 0: the model's own context
