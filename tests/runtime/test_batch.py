"""Several prompts generated together (``Llama.create_completions``, hybrimoe.runtime.batch.BatchGenerator).

The oracle is upstream's batched run of the same sequences: :func:`hybrimoe.testing.upstream.decode_together` (all
prompts in the first decode, then one token per sequence per decode) on llama.cpp without hybrimoe's engine, with the
same placement. Batched kernels round differently from single-sequence ones (llama-server gives other greedy texts
at ``-np 8`` than at ``-np 1``), so the single-sequence run is not the oracle.
"""
from __future__ import annotations

import numpy as np
import pytest

from hybrimoe.testing.upstream import decode_together, prompt_tokens

N_GEN = 6


def _common(rpc_server=None, n_batch=256, **kw):
    d = dict(n_ctx=512, n_batch=n_batch, n_ubatch=64, seed=0, verbose=False, no_repack=True)
    if rpc_server is not None:
        d.update(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1)
    d.update(kw)
    return d


def _prompts(llm, n):
    """``n`` prompts of 7-14 tokens, all different (shifted windows of the fixed text)."""
    base = prompt_tokens(llm, 40)
    return [base[: 7 + (3 * i) % 8] if i % 2 == 0 else base[i: i + 6 + i % 5] for i in range(n)]


def _engine_kw(path, mode, split_cost_model):
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.ram_tier import min_ram_slots

    f = engine_facts(path)
    kw = {}
    if "ram" in mode:
        kw["moe_ram_cache"] = min_ram_slots(f, 64) * f.ram_slot_bytes
    if "gpu" in mode:
        kw["moe_cache"] = len(f.moe_layers) * f.n_expert // 2 * f.slot_bytes
    if kw:
        kw["moe_cost_model"] = split_cost_model
    return kw


_MODES = ["upstream", "ram", "gpu", "gpu+ram"]


@pytest.mark.parametrize("mode,n,kv_unified", [(m, n, False) for m in _MODES for n in (1, 2, 4, 8)]
                         + [(m, 8, True) for m in _MODES])
def test_greedy_batch_equals_upstreams_batched_run(tiny_model, rpc_server, split_cost_model, mode, n, kv_unified):
    """Greedy completions of n prompts together: each sequence's tokens, and the logits each token was taken from,
    equal upstream's batched decode of the same sequences with the same placement and KV cache (one stream per
    sequence, or unified), bit for bit, with the engine off, over the RAM tier, over the stand-in GPU's cache, and
    over both."""
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    rpc = rpc_server if "gpu" in mode else None
    ref_kw = dict(tensor_buft_overrides="exps=CPU") if rpc is not None else {}
    ref = Llama(str(path), n_seq_max=n, kv_unified=kv_unified, **_common(rpc, **ref_kw))
    try:
        prompts = _prompts(ref, n)
        want = decode_together(ref, prompts, N_GEN)
    finally:
        ref.close()
    llm = Llama(str(path), n_seq_max=n, kv_unified=kv_unified, **_engine_kw(path, mode, split_cost_model),
                **_common(rpc))
    try:
        from hybrimoe.runtime.batch import BatchGenerator

        gen = BatchGenerator(llm, record_logits=True)
        out = gen.run(prompts, max_tokens=N_GEN, temperature=0.0)
        st = llm.moe_stats().get("engine", {})
    finally:
        llm.close()
    if "gpu" in mode:
        assert st["gpu_experts"] > 0, st
    if "ram" in mode:
        assert st["ram"]["misses"] > 0, st
    assert gen.batch_sizes[0] == sum(len(p) for p in prompts)
    # every sequence decodes together until the first one ends (end of generation); compare those steps
    steps = min(len(lg) for lg in gen.logits)
    assert steps >= 1
    for i in range(n):
        for k in range(steps):
            assert np.array_equal(gen.logits[i][k], want[k][i]), (i, k)
            expect = int(np.argmax(want[k][i]))
            if k < len(gen.tokens[i]):
                assert gen.tokens[i][k] == expect, (i, k)
        assert out[i]["usage"]["completion_tokens"] == len(gen.tokens[i])
        assert out[i]["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("kv_unified", [False, True])
def test_more_prompts_than_slots_wait_and_chunked_prompts_match_upstream(tiny_model, split_cost_model, kv_unified):
    """Seven prompts over three slots with a 16-token batch: prompts are fed in chunks next to other sequences'
    generated tokens, a request waits for a slot and takes the first one freed. The engine (RAM tier) gives
    upstream's tokens and logits under the same batches, with a KV cache per sequence and with one unified cache;
    no batch exceeds n_batch, never more than 3 sequences run, and afterwards the context is empty
    (create_completion gives what a fresh Llama gives)."""
    from hybrimoe import Llama
    from hybrimoe.runtime.batch import BatchGenerator

    path = tiny_model("qwen3moe", "Q8_0")
    kw = dict(n_seq_max=3, kv_unified=kv_unified, **_common(n_batch=16))
    runs = {}
    for mode in ("upstream", "ram"):
        llm = Llama(str(path), **_engine_kw(path, mode, split_cost_model), **kw)
        try:
            prompts = _prompts(llm, 7)
            gen = BatchGenerator(llm, record_logits=True)
            out = gen.run(prompts, max_tokens=[3, 5, 4, 6, 2, 5, 3], temperature=0.0)
            after = llm.create_completion(prompts[0], max_tokens=4, temperature=0.0)["choices"][0]["text"]
            assert max(gen.batch_sequences) == 3
            runs[mode] = (gen.tokens, gen.logits, gen.batch_sizes, out, after)
        finally:
            llm.close()
    fresh = Llama(str(path), **kw)
    try:
        alone = fresh.create_completion(prompts[0], max_tokens=4, temperature=0.0)["choices"][0]["text"]
    finally:
        fresh.close()
    (t0, l0, b0, o0, a0), (t1, l1, b1, _, a1) = runs["upstream"], runs["ram"]
    assert t0 == t1 and b0 == b1
    assert all(np.array_equal(x, y) for xs, ys in zip(l0, l1) for x, y in zip(xs, ys))
    assert max(b0) <= 16 and len(b0) > 1
    for r, mt in zip(o0, [3, 5, 4, 6, 2, 5, 3]):
        assert r["choices"][0]["finish_reason"] == "stop" or r["usage"]["completion_tokens"] == mt
    assert a0 == a1 == alone


def test_sampling_per_prompt_is_seeded_and_stop_strings_cut(tiny_model):
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), n_seq_max=2, **_common())
    try:
        p = ["Once upon a time", "The harbour was quiet"]
        a = llm.create_completions(p, max_tokens=8, temperature=0.9, seed=[1, 2])
        b = llm.create_completions(p, max_tokens=8, temperature=0.9, seed=[1, 2])
        assert [x["choices"][0]["text"] for x in a] == [x["choices"][0]["text"] for x in b]
        greedy = llm.create_completions(p, max_tokens=8, temperature=0.0)
        text = greedy[0]["choices"][0]["text"]
        if len(text) >= 3:
            stop = text[1:3]
            cut = llm.create_completions(p, max_tokens=8, temperature=0.0, stop=[stop])
            assert cut[0]["choices"][0]["text"] == text[: text.find(stop)]
            assert cut[0]["choices"][0]["finish_reason"] == "stop"
        assert greedy[0]["object"] == "text_completion" and greedy[0]["usage"]["prompt_tokens"] > 0
    finally:
        llm.close()


def test_grammars_per_prompt_constrain_each_and_match_create_completion(tiny_model):
    """Each prompt with its own grammar in one batch (and one without): every text is a prefix of a string its
    grammar accepts (unconstrained, the tiny model's text is not), and each equals llama-cpp-python's
    create_completion with the same grammar, run alone (the same decodes: the prompt, then a token per step)."""
    import re

    from llama_cpp.llama_grammar import LlamaGrammar

    from hybrimoe import Llama

    grammars = ['root ::= [0-9]+', 'root ::= ("yes" | "no") "."', 'root ::= "[" [a-z]* "]"', None]
    accepts = [r"[0-9]*", r"(y|ye|yes|yes\.|n|no|no\.)?", r"(\[[a-z]*\]?)?", r".*"]
    prompts = ["Once upon a time", "The harbour was quiet", "Numbers go up", "Hello world"]
    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), n_seq_max=4, **_common())
    try:
        got = [o["choices"][0]["text"] for o in llm.create_completions(prompts, max_tokens=10, temperature=0.0,
                                                                        grammar=grammars)]
    finally:
        llm.close()
    for text, pattern in zip(got, accepts):
        assert text and re.fullmatch(pattern, text, flags=re.S), (text, pattern)
    assert not re.fullmatch(r"[0-9]*", got[3]), got  # the prompt without a grammar is not constrained
    llm = Llama(str(path), **_common())
    try:
        for g, p, text in zip(grammars[:3], prompts, got):
            one = llm.create_completion(p, max_tokens=10, temperature=0.0,
                                        grammar=LlamaGrammar.from_string(g, verbose=False))
            assert one["choices"][0]["text"] == text, (g, one, text)
    finally:
        llm.close()


def test_logprobs_match_create_completion(tiny_model):
    """logprobs of one prompt's greedy answer (the other prompt of the batch asks for none) against
    llama-cpp-python's create_completion run alone with logits_all: the same tokens, text offsets and top tokens,
    and log-probabilities within 1e-4 (its prompt's logits come from a batch with every row's outputs)."""
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    p = "Once upon a time"
    llm = Llama(str(path), logits_all=True, **_common())
    try:
        want = llm.create_completion(p, max_tokens=6, temperature=0.0, logprobs=3)["choices"][0]
    finally:
        llm.close()
    llm = Llama(str(path), n_seq_max=2, **_common())
    try:
        alone = llm.create_completions([p], max_tokens=6, temperature=0.0, logprobs=3)[0]["choices"][0]
        two = llm.create_completions([p, "Hello", "The harbour"], max_tokens=6, temperature=0.0,
                                     logprobs=[2, None, 1])
    finally:
        llm.close()
    a, b = want["logprobs"], alone["logprobs"]
    assert alone["text"] == want["text"] and b["tokens"] == a["tokens"] and b["text_offset"] == a["text_offset"]
    assert len(b["tokens"]) == 6 and b["text_offset"][0] == len(p)
    np.testing.assert_allclose(b["token_logprobs"], a["token_logprobs"], rtol=0, atol=1e-4)
    for x, y in zip(a["top_logprobs"], b["top_logprobs"]):
        assert x.keys() == y.keys()
        np.testing.assert_allclose([y[k] for k in x], [x[k] for k in x], rtol=0, atol=1e-4)
    assert two[1]["choices"][0]["logprobs"] is None
    for out, n in ((two[0], 2), (two[2], 1)):
        lp = out["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 6 and all(len(d) <= n + 1 for d in lp["top_logprobs"])  # n top ones, its own
        # greedy from the raw logits: each token's log-probability is the largest of its row (a row of another
        # sequence of the batch would not give that)
        assert all(v == max(d.values()) for v, d in zip(lp["token_logprobs"], lp["top_logprobs"])), lp


def _joined(chunks: list) -> dict:
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for lp in chunks:
        for k in out:
            out[k] += lp[k]
    return out


def test_streamed_logprobs_join_to_the_answers_and_match_create_completion(tiny_model):
    """A streamed request's logprobs (one entry per token, in the chunk of its token) joined are exactly the
    logprobs of the same request not streamed, and llama-cpp-python's own streamed ``create_completion`` with
    ``logits_all`` gives the same tokens, text offsets and top tokens, with log-probabilities within 1e-4."""
    import threading

    from hybrimoe import Llama
    from hybrimoe.runtime.batch import BatchScheduler

    path = tiny_model("qwen3moe", "Q8_0")
    p = "Once upon a time"
    llm = Llama(str(path), logits_all=True, **_common())
    try:
        want = [c["choices"][0] for c in llm.create_completion(p, max_tokens=6, temperature=0.0, logprobs=3,
                                                                logit_bias=_eog(llm), stream=True)]
        eog = _eog(llm)
    finally:
        llm.close()
    llm = Llama(str(path), n_seq_max=2, **_common())
    sched = BatchScheduler(llm, lock=threading.Lock())
    try:
        r = sched.submit(p, max_tokens=6, temperature=0.0, logprobs=3, logit_bias=eog)
        items = list(sched.stream(r))
        whole = sched.result(sched.submit(p, max_tokens=6, temperature=0.0, logprobs=3, logit_bias=eog))
    finally:
        sched.close(30)
        llm.close()
    assert items[-1][1] == "length" and items[-1][2] is None
    per_token = [lp for _, finish, lp in items if finish is None]
    assert len(per_token) == 6 and all(len(lp["tokens"]) == 1 for lp in per_token)
    assert _joined(per_token) == whole["choices"][0]["logprobs"]
    ours = _joined(per_token)
    theirs = _joined([c["logprobs"] for c in want if c["logprobs"] is not None])
    assert ours["tokens"] == theirs["tokens"] and ours["text_offset"] == theirs["text_offset"]
    np.testing.assert_allclose(ours["token_logprobs"], theirs["token_logprobs"], rtol=0, atol=1e-4)
    for x, y in zip(theirs["top_logprobs"], ours["top_logprobs"]):
        assert x.keys() == y.keys()
        np.testing.assert_allclose([y[k] for k in x], [x[k] for k in x], rtol=0, atol=1e-4)


@pytest.mark.parametrize("kw, msg", [
    # llama-cpp-python adds llama.cpp's NULL grammar sampler to its chain and crashes at the first token
    ({"grammar": "root ::= ("}, "could not parse the grammar"),
    ({"grammar": 3}, "grammar must be"),
    # it prints an IndexError from its logits processor and ignores the bias
    ({"logit_bias": {10**9: 1.0}}, "this model's ids are"),
    # a ctypes ArgumentError
    ({"top_k": "x"}, "top_k must be a number"),
    ({"logprobs": -2}, "logprobs must be"),
])
def test_bad_sampling_values_are_value_errors_in_create_completion_too(tiny_model, kw, msg):
    """The single-prompt path checks what the batch path checks, before llama-cpp-python sees it; the model still
    works after."""
    from hybrimoe import Llama

    llm = Llama(str(tiny_model("qwen3moe", "Q8_0")), **_common())
    try:
        with pytest.raises(ValueError, match=msg):
            llm.create_completion("Hi", max_tokens=2, **kw)
        with pytest.raises(ValueError, match=msg):
            llm("Hi", max_tokens=2, **kw)
        assert llm.create_completion("Hi", max_tokens=2, temperature=0.0, grammar="root ::= [0-9]+")["choices"]
    finally:
        llm.close()


@pytest.mark.parametrize("prompts, kw, msg", [
    ([], {}, "non-empty list"),
    ("one string", {}, "non-empty list"),
    (["ok", ""], {}, "prompt 1 is empty"),
    (["a", "b"], {"max_tokens": [1, 2, 3]}, "3 values for 2 prompts"),
    (["a"], {"mirostat_mode": 2}, "unknown keyword"),
    (["a"], {"grammar": "root ::= ("}, "could not parse the grammar"),
    (["a"], {"grammar": 5}, "grammar must be"),
    (["a"], {"logprobs": -1}, "logprobs must be"),
    ([list(range(5, 300))], {}, "exceed context window of 256"),
    (["a"], {"logit_bias": {"abc": 1.0}}, "not a token id"),
    (["a"], {"logit_bias": {10**9: 1.0}}, "this model's ids are"),
    (["a"], {"presence_penalty": None}, "must be a number"),
    ([[1, 2, 10**9]], {}, "outside this model's"),
])
def test_bad_batches_are_refused(tiny_model, prompts, kw, msg):
    from hybrimoe import Llama

    llm = Llama(str(tiny_model("qwen3moe", "Q8_0")), n_seq_max=2, **_common())
    try:
        with pytest.raises(ValueError, match=msg):
            llm.create_completions(prompts, **kw)
        assert llm.create_completions(["still works"], max_tokens=2, temperature=0.0)[0]["usage"]["total_tokens"] > 0
    finally:
        llm.close()


def _eog(llm):
    from hybrimoe._lib import llama_cpp_module

    lc = llama_cpp_module().llama_cpp
    return {t: -1e9 for t in range(llm.n_vocab()) if lc.llama_vocab_is_eog(llm._model.vocab, t)}


def test_scheduler_requests_that_arrive_together_equal_a_batch_run(tiny_model):
    """Requests submitted from several threads while a step runs join at the next step; submitted together they
    are one batch run's requests: the same tokens as BatchGenerator.run of the same prompts."""
    import threading

    from hybrimoe import Llama
    from hybrimoe.runtime.batch import BatchGenerator, BatchScheduler

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), n_seq_max=4, **_common())
    try:
        prompts = _prompts(llm, 4)
        want = BatchGenerator(llm, logit_bias=_eog(llm))
        want.run(prompts, max_tokens=5, temperature=0.0)
        lock = threading.Lock()
        snaps, holder = [], []
        sched = BatchScheduler(llm, lock=lock, on_step=lambda gen: snaps.append(holder[0].state()))
        holder.append(sched)
        try:
            with lock:  # the scheduler waits at its first step until all four are in
                reqs = [sched.submit(p, max_tokens=5, temperature=0.0, logit_bias=_eog(llm)) for p in prompts]
            outs = [None] * 4

            def read(i):
                outs[i] = sched.result(reqs[i])

            threads = [threading.Thread(target=read, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert [r.out for r in reqs] == want.tokens
            assert all(o["usage"]["completion_tokens"] == 5 for o in outs)
            assert sched.state()["active"] == 0 and sched.state()["sequences_per_step"].get(4, 0) >= 1
            # per slot, as each step left it: the four prompts decoded whole in the first step, one token each per
            # step after it; every slot idle at the end
            first = snaps[0]["per_slot"]
            assert [d["id"] for d in first] == [0, 1, 2, 3]
            assert sorted(d["n_prompt_tokens"] for d in first) == sorted(len(p) for p in prompts)
            assert all(d["n_prompt_tokens_processed"] == d["n_prompt_tokens"] and d["n_decoded"] == 1 and
                       d["state"] == "generating" and d["n_ctx"] == want.n_ctx_seq for d in first), first
            assert [max(d["n_decoded"] for d in sn["per_slot"]) for sn in snaps[:4]] == [1, 2, 3, 4], snaps
            assert all(d["state"] == "idle" and d["n_decoded"] == 0 for d in sched.state()["per_slot"])
        finally:
            sched.close(30)
    finally:
        llm.close()


def test_scheduler_requests_sent_together_start_in_one_step(tiny_model):
    """Requests that reach an idle scheduler a few milliseconds apart (clients sending at once) are prefilled in
    one first step: the scheduler waits until none has come for gather_s (at most gather_max_s). Bad windows are
    refused."""
    import time

    from hybrimoe import Llama
    from hybrimoe.runtime.batch import BatchScheduler

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), n_seq_max=4, **_common())
    try:
        for bad in (dict(gather_s=-0.01), dict(gather_s=0.1, gather_max_s=0.05)):
            with pytest.raises(ValueError, match="gather_s"):
                BatchScheduler(llm, **bad)
        prompts = _prompts(llm, 3)
        sched = BatchScheduler(llm, gather_s=0.05, gather_max_s=1.0)
        try:
            reqs = []
            for p in prompts:  # 3 ms apart, from this thread: the scheduler's thread is idle when the first comes
                reqs.append(sched.submit(p, max_tokens=2, temperature=0.0))
                time.sleep(0.003)
            outs = [sched.result(r) for r in reqs]
            assert all(o["usage"]["completion_tokens"] >= 1 for o in outs)
            assert sched.gen.batch_sequences[0] == 3, sched.gen.batch_sequences
            assert sched.gen.batch_sizes[0] == sum(len(p) for p in prompts)
        finally:
            sched.close(30)
    finally:
        llm.close()


def test_scheduler_gathers_no_longer_than_its_slots_or_its_close(tiny_model):
    """The first step's wait ends once every slot has a request, however long gather_s, and close() during the
    wait ends it too: the request waiting fails with the shutdown."""
    import time

    from hybrimoe import Llama
    from hybrimoe.runtime.batch import BatchScheduler

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), n_seq_max=2, **_common())
    try:
        prompts = _prompts(llm, 2)
        sched = BatchScheduler(llm, gather_s=60.0, gather_max_s=60.0)
        try:
            t0 = time.monotonic()
            reqs = [sched.submit(p, max_tokens=2, temperature=0.0) for p in prompts]
            assert all(sched.result(r)["usage"]["completion_tokens"] >= 1 for r in reqs)
            assert time.monotonic() - t0 < 30 and sched.gen.batch_sequences[0] == 2
        finally:
            sched.close(30)
        sched = BatchScheduler(llm, gather_s=60.0, gather_max_s=60.0)
        alone = sched.submit(prompts[0], max_tokens=2, temperature=0.0)
        time.sleep(0.1)
        t0 = time.monotonic()
        sched.close(30)
        assert time.monotonic() - t0 < 10 and not sched.alive()
        with pytest.raises(RuntimeError, match="shutting down"):
            sched.result(alone)
    finally:
        llm.close()


def test_scheduler_queue_limit_and_a_caller_that_leaves(tiny_model):
    import threading
    import time

    from hybrimoe import Llama
    from hybrimoe.runtime.batch import BatchScheduler, QueueFull

    llm = Llama(str(tiny_model("qwen3moe", "Q8_0")), n_seq_max=2, **_common())
    try:
        lock = threading.Lock()
        sched = BatchScheduler(llm, lock=lock, max_waiting=3)
        try:
            with lock:
                long = sched.submit("Once upon a time", max_tokens=200, temperature=0.0, logit_bias=_eog(llm))
                # nothing is admitted while the lock is held: 2 of these 5 take the free slots, 3 wait
                others = [sched.submit("Hello", max_tokens=2, temperature=0.0) for _ in range(4)]
                with pytest.raises(QueueFull, match="3 requests already wait"):
                    sched.submit("one too many", max_tokens=2)
            it = sched.stream(long)
            delta, finish, lps = next(it)
            assert finish is None and lps is None
            it.close()  # the caller leaves: its slot and cells are freed at the next step
            for r in others:
                assert sched.result(r)["usage"]["completion_tokens"] >= 1
            deadline = time.monotonic() + 30
            while sched.state()["active"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sched.state()["active"] == 0
            assert long.finish == "cancelled" and len(long.out) < 200
            # a full-length request afterwards gets the whole sequence's context
            r = sched.submit(list(range(5, 5 + 250)), max_tokens=6, temperature=0.0, logit_bias=_eog(llm))
            assert sched.result(r)["usage"]["completion_tokens"] == 6
        finally:
            sched.close(30)
        with pytest.raises(RuntimeError, match="closed"):
            sched.submit("late")
    finally:
        llm.close()


def test_a_decode_step_of_several_sequences_is_planned_as_one(tiny_model, rpc_server, split_cost_model):
    """Four sequences at different positions, routing replayed by position: each decode step's MoE layer is one
    plan (one decision record per layer and ubatch) over the union of the four tokens' experts, each expert's load
    the number of those tokens routed to it."""
    from hybrimoe import Llama
    from hybrimoe.runtime.batch import BatchGenerator
    from hybrimoe.runtime.engine_facts import engine_facts

    path = tiny_model("qwen3moe", "Q8_0")
    f = engine_facts(path)
    rng = np.random.default_rng(5)
    rows = 128
    table = np.zeros((rows, f.n_layer, f.top_k), dtype=np.int32)
    for p in range(rows):
        for layer in f.moe_layers:
            table[p, layer] = rng.choice(f.n_expert, f.top_k, replace=False)
    llm = Llama(str(path), n_seq_max=4, moe_replay=table, **_engine_kw(path, "gpu", split_cost_model),
                **_common(rpc_server))
    try:
        llm.moe_log()
        prompts = [prompt_tokens(llm, n) for n in (5, 7, 9, 11)]
        gen = BatchGenerator(llm)
        gen.run(prompts, max_tokens=4, temperature=0.0)
        log = llm.moe_take_log()
    finally:
        llm.close()
    by_ubatch: dict = {}
    for r in log:
        if len(r["ids"]):  # not a prefetch-only record
            by_ubatch.setdefault(r["ubatch"], []).append(r)
    # the decode steps: ubatches whose every MoE layer saw the four sequences' tokens (the prompt's ubatch comes
    # first, with more tokens in its layers)
    steps = [by_ubatch[u] for u in sorted(by_ubatch) if all(r["n_tokens"] == 4 for r in by_ubatch[u])]
    assert len(steps) == 3, sorted(by_ubatch)  # max_tokens 4: three decodes after the prompt's
    for j, recs in enumerate(steps, start=1):
        assert sorted(r["layer"] for r in recs) == list(range(len(f.moe_layers)))  # one plan per layer
        for r in recs:
            ids = np.asarray(r["ids"])
            union, counts = np.unique(ids, return_counts=True)
            assert sorted(r["experts"]) == union.tolist()
            assert dict(zip(r["experts"], r["loads"])) == dict(zip(union.tolist(), counts.tolist()))
            # row s is sequence s's token, at its own position (its prompt's length + j - 1)
            moe_layer = list(f.moe_layers)[r["layer"]]
            for s_, prompt in enumerate(prompts):
                assert sorted(ids[s_].tolist()) == sorted(table[len(prompt) + j - 1, moe_layer].tolist()), (j, s_)


@pytest.mark.parametrize("kv_unified", [False, True])
def test_a_unified_kv_cache_runs_each_step_as_one_ubatch(tiny_model, split_cost_model, kv_unified):
    """Prompt chunks next to other sequences' generated tokens: llama.cpp cuts such a step into ubatches of equal
    tokens per sequence when each sequence has its own KV stream (llama_batch_allocr::split_equal), each ubatch a
    pass over the expert weights; with a unified KV cache (split_simple) every step of at most n_ubatch tokens is one
    ubatch. Counted from the engine's decision log (one ubatch number per graph); a request is still held to its
    n_ctx / n_seq_max share of the context."""
    from hybrimoe import Llama
    from hybrimoe.runtime.batch import BatchGenerator

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), n_seq_max=3, kv_unified=kv_unified, **_engine_kw(path, "ram", split_cost_model),
                **_common(n_batch=16, n_ubatch=16))
    try:
        prompts = _prompts(llm, 5)
        gen = BatchGenerator(llm)
        # each slot holds a third of the cells, so the three together always fit (a stream per slot: llama.cpp's
        # n_ctx_seq, n_ctx grown to three of them; unified: the share BatchGenerator holds each request to)
        assert gen.n_ctx_seq == llm.n_ctx() // 3
        with pytest.raises(ValueError, match="exceed context window"):
            gen.run([prompt_tokens(llm, 300)], max_tokens=1)
        llm.moe_log()
        gen.run(prompts, max_tokens=[3, 5, 4, 6, 2], temperature=0.0)
        ubatches = {r["ubatch"] for r in llm.moe_take_log()}
    finally:
        llm.close()
    mixed = len(gen.batch_sizes) - sum(1 for n in gen.batch_sequences if n == 1)
    assert mixed >= 3  # steps that hold several sequences, some of them prompt chunks
    if kv_unified:
        assert len(ubatches) == len(gen.batch_sizes)
    else:
        assert len(ubatches) > len(gen.batch_sizes)
