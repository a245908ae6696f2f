"""Routing recording (``hybrimoe trace``, hybrimoe.runtime.recording) against upstream's own nodes.

The command-line runs start in ``tmp_path``: from the repository root, ``python -m hybrimoe`` would import the
source tree (no compiled modules) instead of the installed package.

Oracle: a plain llama.cpp context (no hook, no recorder) built with the low-level API, whose eval callback, written
here in ctypes, reads the nodes ``ffn_moe_topk-<il>`` and ``ffn_moe_probs-<il>`` of build_moe_ffn; prompts are
decoded with every output on and continued greedily (argmax), as the recorder does with ``--temp 0``.
"""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import numpy as np
import pytest

import hybrimoe  # noqa: F401  (before llama_cpp: hybrimoe's libllama)
from hybrimoe.runtime import recording
from hybrimoe.testing.upstream import last_logits
from hybrimoe.traces.format import PHASE_DECODE, PHASE_PREFILL, load_trace

PROMPTS = ["The quick brown fox jumps over the lazy dog, again and again", "Once upon a time"]
N_PREDICT = 4
THREADS = 2


class _TensorHead(ctypes.Structure):
    # the leading fields of ggml.h's struct ggml_tensor (type, buffer, ne, nb)
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4)]


def _ggml_base():
    from hybrimoe._lib import llama_cpp_lib_dir

    lib = ctypes.CDLL(str(sorted(llama_cpp_lib_dir().glob("libggml-base.so*"))[0]))
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    return lib


def upstream_routing(model_path, prompts, n_predict, n_batch=64, n_ubatch=32):
    """Per prompt: {layer: (ids [T, k], scores [T, E])} read from a plain context's eval callback, and the tokens."""
    from hybrimoe._lib import llama_cpp_module

    lc = llama_cpp_module().llama_cpp
    g = _ggml_base()
    seen: dict = {}

    @lc.ggml_backend_sched_eval_callback
    def cb(t, ask, _ud):
        name = g.ggml_get_name(t).decode()
        for kind in ("ffn_moe_topk-", "ffn_moe_probs-"):
            if name.startswith(kind) and name[len(kind):].isdigit():
                if ask:
                    return True
                h = _TensorHead.from_address(t)
                width, rows = h.ne[0], h.ne[1]
                dt = np.int32 if kind == "ffn_moe_topk-" else np.float32
                out = np.empty((rows, width), dtype=dt)
                for r in range(rows):  # row by row: the top-k node is a strided view of the argsort
                    g.ggml_backend_tensor_get(t, out[r].ctypes.data, r * h.nb[1], width * 4)
                il = int(name[len(kind):])
                seen.setdefault((kind, il), []).append(out)
                return True
        return False if ask else True

    # a plain Llama (no hook, no recorder) gives the model and the context parameters (flash attention, threads,
    # batch sizes: as the recording's); its own context is not used, a second one gets the callback
    plain = hybrimoe.Llama(str(model_path), n_ctx=256, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=THREADS,
                           n_threads_batch=THREADS, verbose=False)
    model = plain.model
    cp = type(plain.context_params).from_buffer_copy(plain.context_params)
    cp.cb_eval = cb
    ctx = lc.llama_init_from_model(model, cp)
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    results = []
    try:
        for prompt in prompts:
            seen.clear()
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            buf = (lc.llama_token * 512)()
            n = lc.llama_tokenize(vocab, prompt.encode(), len(prompt.encode()), buf, 512, True, False)
            toks = list(buf[:n])
            batch = lc.llama_batch_init(max(n_batch, 1), 0, 1)
            pos = 0

            def decode(chunk):
                nonlocal pos
                batch.n_tokens = len(chunk)
                for i, tk in enumerate(chunk):
                    batch.token[i] = tk
                    batch.pos[i] = pos + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = True
                assert lc.llama_decode(ctx, batch) == 0
                pos += len(chunk)

            for i in range(0, n, n_batch):
                decode(toks[i:i + n_batch])
            gen = []
            for _ in range(n_predict):
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
                tk = int(np.argmax(logits))
                if lc.llama_vocab_is_eog(vocab, tk):
                    break
                gen.append(tk)
                decode([tk])
            lc.llama_batch_free(batch)
            layers = {}
            for (kind, il), parts in seen.items():
                layers.setdefault(il, {})[kind] = np.concatenate(parts)
            results.append(({il: (v["ffn_moe_topk-"], v["ffn_moe_probs-"]) for il, v in layers.items()},
                            toks + gen))
    finally:
        lc.llama_free(ctx)
        plain.close()
    return results


def recorded(model_path, prompts, n_predict, **kw):
    llm = hybrimoe.Llama(str(model_path), n_ctx=256, n_batch=64, n_ubatch=32, n_threads=THREADS,
                         n_threads_batch=THREADS, verbose=False, record_routing=True, **kw)
    try:
        rec = recording.Recorder(llm)
        rec.record(prompts, n_predict, temp=0.0)
        return rec.trace()
    finally:
        llm.close()


GATING = {"qwen3moe": "softmax", "deepseek2": "sigmoid", "gpt-oss": "softmax_weight"}


@pytest.mark.parametrize("arch", sorted(GATING))
def test_recorded_ids_and_scores_are_upstreams_nodes(tiny_model, arch):
    path = tiny_model(arch, "Q8_0")
    tr = recorded(path, PROMPTS, N_PREDICT)
    ref = upstream_routing(path, PROMPTS, N_PREDICT)
    assert tr.n_prompts == len(PROMPTS)
    assert not tr.partial
    moe = list(tr.moe_layer_ids)
    for p, (layers, tokens) in enumerate(ref):
        a, b = int(tr.prompt_offsets[p]), int(tr.prompt_offsets[p + 1])
        assert b - a == len(tokens), f"prompt {p}: {b - a} rows recorded, upstream evaluated {len(tokens)} tokens"
        assert sorted(layers) == moe, f"upstream MoE layers {sorted(layers)} vs trace {moe}"
        n_prompt = len(tokens) - int(np.sum(tr.phases[a:b] == PHASE_DECODE))
        assert np.all(tr.phases[a:a + n_prompt] == PHASE_PREFILL) and np.all(tr.phases[a + n_prompt:b] == PHASE_DECODE)
        for j, il in enumerate(moe):
            ids, scores = layers[il]
            assert ids.shape == (len(tokens), tr.top_k), f"upstream layer {il} saw {ids.shape[0]} tokens"
            np.testing.assert_array_equal(tr.expert_ids[a:b, j, :], ids, err_msg=f"prompt {p} layer {il}")
            # stored as float16: equal to upstream's float32 scores rounded to float16
            np.testing.assert_array_equal(tr.router_scores[a:b, j, :], scores.astype(np.float16).astype(np.float32),
                                          err_msg=f"prompt {p} layer {il}")
    # the facts come from the GGUF
    assert tr.facts is not None and tr.facts.top_k == tr.top_k and tr.facts.n_experts == tr.num_experts
    assert tr.gating == GATING[arch]


def test_trace_file_round_trip_and_replay_reproduces_logits(tiny_model, tmp_path):
    """A single-prompt trace replayed into the same model with the same tokens gives the logits bit for bit."""
    from hybrimoe.traces.routing_replay import routing_replay_table

    path = tiny_model("qwen3moe", "Q8_0")
    out = tmp_path / "t.npz"
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "trace", "-m", str(path), "-p", PROMPTS[0], "-n", "6",
                        "-c", "256", "-b", "64", "-ub", "32", "-o", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stderr and "prefill" in r.stderr
    tr = load_trace(out)
    assert tr.n_prompts == 1 and tr.facts is not None and not tr.partial
    # the tokens the trace saw: the prompt and the greedy continuation of a plain run
    plain = hybrimoe.Llama(str(path), n_ctx=256, n_batch=64, n_ubatch=32, verbose=False)
    toks = plain.tokenize(PROMPTS[0].encode(), add_bos=True, special=False)
    plain.eval(toks)
    seq = list(toks)
    for _ in range(tr.n_tokens - len(toks)):
        tk = plain.sample(temp=0.0)
        seq.append(tk)
        plain.eval([tk])
    ref = last_logits(plain)
    plain.close()
    assert len(seq) == tr.n_tokens
    rep = hybrimoe.Llama(str(path), n_ctx=256, n_batch=64, n_ubatch=32, verbose=False,
                         moe_replay=routing_replay_table(tr, path))
    try:
        rep.eval(seq)
        got = last_logits(rep)
    finally:
        rep.close()
    np.testing.assert_array_equal(got, ref)


def test_existing_output_is_kept_without_force(tiny_model, tmp_path):
    path = tiny_model("qwen3moe", "Q8_0")
    out = tmp_path / "keep.npz"
    out.write_bytes(b"mine")
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "trace", "-m", str(path), "-p", "hi", "-n", "1", "-o",
                        str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "exists" in r.stderr and "--force" in r.stderr
    assert out.read_bytes() == b"mine"


def test_interrupted_recording_keeps_whole_tokens_flagged_partial(tiny_model):
    path = tiny_model("qwen3moe", "Q8_0")
    llm = hybrimoe.Llama(str(path), n_ctx=256, verbose=False, record_routing=True)
    seen = []

    def on_token(n):
        seen.append(n)
        if len(seen) == 3:  # the prompt, then two decode steps
            raise KeyboardInterrupt

    try:
        rec = recording.Recorder(llm, on_token=on_token)
        rec.record(PROMPTS, 10)
        tr = rec.trace()
    finally:
        llm.close()
    assert rec.interrupted and tr.partial
    assert tr.n_prompts == 1
    # the evaluation whose callback was interrupted was collected before the callback ran: all three are kept
    assert tr.n_tokens == sum(seen)
    assert list(tr.phases).count(PHASE_DECODE) == 2


def test_ctrl_c_writes_what_was_recorded_flagged_partial(tiny_model, tmp_path):
    """A real SIGINT to `hybrimoe trace` mid-run: exit 130, and the file holds the whole tokens recorded so far. The
    child gets SIGINT's default disposition (a background job's children start with it ignored) and the signal is sent
    once the progress bar says 5 prompts are done, however slow the machine."""
    import os
    import signal

    from hybrimoe.testing.processes import default_signals, read_until

    path = tiny_model("qwen3moe", "Q8_0")
    out = tmp_path / "cut.npz"
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"{PROMPTS[0]} {i}" for i in range(2000)) + "\n")
    env = dict(os.environ, HYBRIMOE_PROGRESS="1")
    proc = subprocess.Popen([sys.executable, "-m", "hybrimoe", "trace", "-m", str(path), "-f", str(prompts), "-n",
                             "8", "-c", "256", "-o", str(out)], stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path, preexec_fn=default_signals)
    try:
        seen = read_until(proc.stderr, "5/2000", timeout_s=600)  # the progress bar counts the prompts done
    except TimeoutError:
        proc.kill()
        raise
    proc.send_signal(signal.SIGINT)
    err = seen + proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err
    assert "partial" in err and "Traceback" not in err
    tr = load_trace(out)
    assert tr.partial and 5 <= tr.n_prompts < 2000
    assert tr.n_tokens == int(tr.prompt_offsets[-1]) and tr.router_scores.shape[0] == tr.n_tokens


def test_prompt_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\n  \nsecond line\n")
    jl = tmp_path / "p.jsonl"
    jl.write_text('"plain"\n{"prompt": "object"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    got = recording.read_prompts(["cli"], [str(txt), str(jl)])
    assert got == ["cli", "first", "second line", "plain", "object", [{"role": "user", "content": "hi"}]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        recording.read_prompts([], [str(bad)])
    bad.write_text('{"prompt": "a"\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not valid JSON"):
        recording.read_prompts([], [str(bad)])
    with pytest.raises(ValueError, match="no prompt"):
        recording.read_prompts([], [])
    with pytest.raises(FileNotFoundError):
        recording.read_prompts([], [str(tmp_path / "missing.txt")])


def test_a_prompt_longer_than_the_context_fails_before_any_decode(tiny_model, tmp_path):
    path = tiny_model("qwen3moe", "Q8_0")
    out = tmp_path / "long.npz"
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "trace", "-m", str(path), "-p", "hi", "-p", PROMPTS[0] * 40,
                        "-c", "64", "-o", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1 and "prompt 1 has" in r.stderr and "(-c)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_chat_without_template_is_a_clear_error(tiny_model, tmp_path):
    path = tiny_model("qwen3moe", "Q8_0")
    out = tmp_path / "c.npz"
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "trace", "-m", str(path), "-p", "hi", "--chat", "-o",
                        str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and "chat template" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()
    # a {"messages"} line of a .jsonl, without --chat: named, refused before any prompt runs, nothing written
    jl = tmp_path / "p.jsonl"
    jl.write_text('"plain first"\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "trace", "-m", str(path), "-f", str(jl), "-o", str(out)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1 and "prompt 1: a chat prompt" in r.stderr and "--chat" not in r.stderr, r.stderr
    assert not out.exists()


def test_an_output_folder_that_cannot_be_written_fails_before_the_run(tiny_model, tmp_path):
    path = tiny_model("qwen3moe", "Q8_0")
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "trace", "-m", str(path), "-p", "hi", "-o",
                        "/proc/x.npz"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "-o /proc/x.npz: cannot write in /proc" in r.stderr, r.stderr


def test_recording_with_the_engine_on_sees_the_same_routing(tiny_model, rpc_server):
    """Placement does not change what is recorded: the hybrid engine on the stand-in routes as upstream does."""
    path = tiny_model("qwen3moe", "Q8_0")
    plain = recorded(path, PROMPTS[:1], 3)
    eng = recorded(path, PROMPTS[:1], 3, rpc_servers=rpc_server.endpoint, n_gpu_layers=99, moe_cache="50%",
                   moe_cost_model="paper-a6000")
    np.testing.assert_array_equal(eng.expert_ids, plain.expert_ids)
    np.testing.assert_allclose(eng.router_scores, plain.router_scores, rtol=0, atol=2e-3)
    json.dumps(eng.facts.to_dict())


def test_simulate_runs_on_a_recorded_trace_with_facts_from_the_gguf_alone(tiny_model, tmp_path):
    """No built-in facts for this model: `simulate -m` and the trace's own facts both work, and --plot writes the
    hit-rate, tokens/s and timeline plots."""
    from hybrimoe.model.facts import MODEL_FACTS

    path = tiny_model("deepseek2", "Q8_0")
    prompts = [f"{PROMPTS[0]} number {i}" for i in range(6)]
    tr = recorded(path, prompts, 3)
    assert tr.model not in MODEL_FACTS
    out = tmp_path / "rec.npz"
    tr.save(out)
    for extra in (["-m", str(path)], []):
        plots = tmp_path / f"plots{len(extra)}"
        r = subprocess.run([sys.executable, "-m", "hybrimoe", "simulate", "--trace", str(out), *extra,
                            "--policies", "hybrimoe,upstream-ncmoe", "--stage", "decode", "--moe-cache", "50%",
                            "--no-progress", "--plot", str(plots), "--json", str(tmp_path / "r.json"), "--force"],
                           capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        recs = json.loads((tmp_path / "r.json").read_text())
        assert [x["policy"] for x in recs] == ["hybrimoe", "upstream-ncmoe"]
        # decode simulates the decode-phase tokens of the evaluated prompts
        assert all(x["tokens"] > 0 for x in recs)
        for name in ("hit_rate_vs_cache.png", "tokens_per_s_vs_cache.png", "timeline.png"):
            assert (plots / name).stat().st_size > 1000, name
