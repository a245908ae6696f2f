"""hybrimoe.Llama and `hybrimoe run` on every fixture architecture, with and without the MoE hook.

Oracle: upstream llama.cpp behaviour. Without a hook our libllama builds upstream's graph, so Llama and the CLI
must agree token for token; with the hook the experts are computed by the hook's subgraph and must give the
same greedy tokens and the same logits (the seed runs ggml's own kernels in upstream's order: bit-exact).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from hybrimoe.testing.upstream import greedy_text, last_logits
from hybrimoe.testing.fixtures import ENGINE_ARCHS, ENGINE_QUANTS

ARCHS = list(ENGINE_ARCHS)
QUANTS = list(ENGINE_QUANTS)
PROMPT = "The quick brown fox jumps over the lazy dog"


def moe_layers(path) -> set[int]:
    import gguf

    r = gguf.GGUFReader(str(path))
    out = set()
    for t in r.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps"):
            out.add(int(parts[1]))
    return out


def run_cli(args: list[str], cwd) -> subprocess.CompletedProcess:
    # cwd outside the checkout: `python -m hybrimoe` must import the installed package
    return subprocess.run([sys.executable, "-m", "hybrimoe", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_api_and_cli_agree_and_hook_is_exact(arch, quant, tiny_model, tmp_path):
    from hybrimoe import Llama

    path = tiny_model(arch, quant)
    n = 12
    llm = Llama(str(path), n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False)
    ref = greedy_text(llm, PROMPT, n)
    prompt_tokens = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    llm.reset()
    llm.eval(prompt_tokens)
    ref_logits = last_logits(llm)
    llm.close()
    assert len(ref) > 0

    cli = run_cli(["run", "-m", str(path), "-p", PROMPT, "-n", str(n), "--temp", "0", "-t", "2", "-c", "256",
                   "--output-format", "json"], tmp_path)
    assert cli.returncode == 0, cli.stderr
    out = json.loads(cli.stdout)
    assert out["prompt_tokens"] == prompt_tokens
    assert out["tokens"] == ref

    ub = 4  # several ubatches for the prompt, so runs count ubatches, not batches
    llm = Llama(str(path), n_ctx=256, n_threads=2, n_threads_batch=2, n_ubatch=ub, n_batch=64, verbose=False,
                moe_hook=True)
    hooked = greedy_text(llm, PROMPT, n)
    stats = llm.moe_stats()
    assert hooked == ref
    assert stats["unsupported"] == []

    # the plan node runs once per MoE layer per ubatch: the prompt's ubatches, then one per decoded token
    # (the last sampled token is not evaluated when generation stops at n)
    # The last layer only computes the rows whose logits are wanted (llama.cpp's inp_out_ids): there, prompt
    # ubatches without an output are empty and ggml skips empty nodes.
    n_evals = len(hooked) - 1 if len(hooked) == n else len(hooked)
    n_layer = len(stats["runs"])
    moe = moe_layers(path)
    assert moe, "fixture has no MoE layer"
    for il, runs in enumerate(stats["runs"]):
        if il in moe:
            last = il == n_layer - 1
            expected_runs = (1 if last else math.ceil(len(prompt_tokens) / ub)) + n_evals
            assert runs == expected_runs, (il, stats)
            assert stats["tokens"][il] == (1 if last else len(prompt_tokens)) + n_evals
            # graphs are reused across decode steps: the hook is called at graph builds only
            assert 0 < stats["hook_calls"][il] < runs
        else:
            assert runs == 0 and stats["hook_calls"][il] == 0

    llm.reset()
    llm.eval(prompt_tokens)
    hooked_logits = last_logits(llm)
    llm.close()
    np.testing.assert_array_equal(hooked_logits, ref_logits)


def test_cli_streams_text_and_matches_json(tiny_model, tmp_path):
    path = tiny_model("qwen3moe", "Q8_0")
    a = run_cli(["run", "-m", str(path), "-p", PROMPT, "-n", "8", "--temp", "0", "-t", "2"], tmp_path)
    b = run_cli(["run", "-m", str(path), "-p", PROMPT, "-n", "8", "--temp", "0", "-t", "2",
                 "--output-format", "json"], tmp_path)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout.rstrip("\n") == json.loads(b.stdout)["text"]


def test_hook_detach_restores_upstream_graph(tiny_model):
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), n_ctx=128, n_threads=2, verbose=False, moe_hook=True)
    with_hook = greedy_text(llm, PROMPT, 6)
    hook = llm.moe_hook
    runs_before = sum(hook.runs())
    hook.detach()
    without = greedy_text(llm, PROMPT, 6)
    assert with_hook == without
    assert sum(hook.runs()) == runs_before  # upstream's graph: the plan node no longer runs
    llm.close()


def test_gpt_oss_experts_run_on_the_hook(tiny_model, tmp_path):
    """gpt-oss experts (biases by expert id, SwiGLU-OAI) are the hook's now: its CPU-only path runs every MoE
    layer and gives upstream's tokens; no layer is reported unsupported and ``run`` warns of none."""
    from hybrimoe import Llama

    path = str(tiny_model("gpt-oss", None))
    llm = Llama(path, n_ctx=128, n_threads=2, verbose=False)
    ref = greedy_text(llm, PROMPT, 8)
    llm.close()
    llm = Llama(path, n_ctx=128, n_threads=2, verbose=False, moe_hook=True)
    got = greedy_text(llm, PROMPT, 8)
    stats = llm.moe_stats()
    llm.close()
    assert got == ref
    assert sum(stats["runs"]) > 0
    assert not stats["unsupported"], stats["unsupported"]
    cli = run_cli(["run", "-m", path, "-p", PROMPT, "-n", "4", "--temp", "0", "--moe-hook"], tmp_path)
    assert cli.returncode == 0, cli.stderr
    assert "ran on upstream's path" not in cli.stderr


def test_a_dropped_llama_is_freed_at_once(tiny_model, rpc_server):
    """No reference cycle through hybrimoe's objects: with the cycle collector off, dropping the last reference to
    a Llama with the engine on frees it (and so its model, context and slot pool) at once."""
    import gc
    import weakref

    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    gc.collect()
    gc.disable()
    try:
        llm = Llama(str(path), rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, moe_cache="50%", n_ctx=64,
                    moe_cost_model="rtx4090-desktop", verbose=False)
        llm("Once", max_tokens=2, temperature=0)
        ref = weakref.ref(llm)
        del llm
        assert ref() is None
    finally:
        gc.enable()


def test_a_prompt_between_the_asked_and_the_padded_context_fits(tiny_model):
    """llama.cpp pads n_ctx (64 asked: 256 held); llama-cpp-python checks prompts against the padded size, so its
    arrays must hold that many tokens (they were sized by the request and overflowed)."""
    from hybrimoe import Llama

    llm = Llama(str(tiny_model("qwen3moe", "Q8_0")), n_ctx=64, verbose=False)
    try:
        n = llm.n_ctx()
        assert n > 64, "llama.cpp no longer pads the context: this test no longer tests anything"
        toks = [1 + i % 50 for i in range(min(n - 8, 120))]
        llm.eval(toks)
        assert llm.n_tokens == len(toks)
        out = llm.create_completion(toks, max_tokens=4, temperature=0)
        assert out["usage"]["prompt_tokens"] == len(toks)
    finally:
        llm.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_max_tokens_holds_while_the_text_ends_inside_a_character(tiny_model, stream):
    """llama-cpp-python skips its max_tokens check while the text ends inside a UTF-8 character (its multibyte
    fix): with the lead byte 0xE3 forced at every step a completion ran on to the end of the context and failed
    there (llama_decode returned 1; a random model's server requests did). It ends after max_tokens tokens, as
    "length", the last token not evaluated as usual; with no max_tokens, where the context is full, as "length"."""
    from hybrimoe import Llama

    llm = Llama(str(tiny_model("qwen3moe", "Q8_0")), n_ctx=64, verbose=False)
    try:
        lead = next(i for i in range(llm.n_vocab()) if llm._model.token_get_text(i) == "<0xE3>")
        n_prompt = len(llm.tokenize(b"hello"))

        def finish(**kw):
            kw.update(temperature=0.0, logit_bias={lead: 100.0})
            if stream:
                return list(llm.create_completion("hello", stream=True, **kw))[-1]["choices"][0]["finish_reason"]
            out = llm.create_completion("hello", **kw)
            assert out["usage"]["completion_tokens"] == llm.n_tokens - n_prompt + 1
            return out["choices"][0]["finish_reason"]

        assert finish(max_tokens=8) == "length"
        assert llm.n_tokens == n_prompt + 7
        assert finish(max_tokens=None) == "length"
        assert llm.n_ctx() - 1 <= llm.n_tokens <= llm.n_ctx()
        # a completion that ends by itself is untouched: an end token forced at once stops it, as "stop"
        out = llm.create_completion("hello", max_tokens=8, temperature=0.0, logit_bias={llm.token_eos(): 100.0})
        assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 0
        # the limit is one completion's: not a later plain generate()'s, even after a completion that failed
        # before generating, or a stream made and never read
        with pytest.raises(ValueError):
            llm.create_completion([5] * (llm.n_ctx() + 1), max_tokens=3)
        llm.create_completion("hello", max_tokens=3, stream=True)
        gen = llm.generate(llm.tokenize(b"hello"), temp=0.0)
        assert len([t for _, t in zip(range(12), gen)]) == 12
    finally:
        llm.close()


def test_closed_llama_raises_instead_of_crashing(tiny_model):
    """After close() the public methods raise RuntimeError (the freed context would crash the process)."""
    from hybrimoe import Llama

    llm = Llama(str(tiny_model("qwen3moe", "Q8_0")), n_ctx=64, verbose=False)
    llm.close()
    for call in (lambda: llm("Hi", max_tokens=2), lambda: llm.tokenize(b"Hi"), lambda: llm.eval([1, 2]),
                 lambda: llm.create_completion("Hi", max_tokens=2), lambda: llm.detokenize([1]),
                 lambda: list(llm.generate([1], temp=0))):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    llm.close()  # closing twice is harmless


@pytest.mark.parametrize("kw, match", [(dict(n_cpu_moe="3"), "n_cpu_moe must be an integer"),
                                       (dict(tensor_buft_overrides=5), "tensor_buft_overrides must be a string"),
                                       (dict(moe_cache=0.25), r"moe_cache: .*less than one byte.*'25%'")])
def test_wrong_option_types_are_named(tiny_model, kw, match):
    from hybrimoe import Llama

    with pytest.raises(ValueError, match=match):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), n_ctx=64, verbose=False, **kw)


def test_cli_with_rpc_prints_nothing_of_llama_cpp_without_verbose(tiny_model, rpc_server, tmp_path):
    """Without --verbose, a run on an RPC device prints the text and nothing of ggml's own logging (the RPC module's
    load, its device registration); with --verbose those lines are there."""
    path = str(tiny_model("qwen3moe", "Q8_0"))
    args = ["run", "-m", path, "-p", "hi", "-n", "4", "--temp", "0", "--rpc", rpc_server.endpoint, "-ngl", "99"]
    quiet = run_cli(args, tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() and "load_backend" not in quiet.stderr, quiet.stderr
    loud = run_cli(args + ["--verbose"], tmp_path)
    assert loud.returncode == 0 and quiet.stdout == loud.stdout
    assert "load_backend" in loud.stderr


def test_the_first_prompt_with_the_hook_is_timed(tiny_model):
    """llama_perf_context counts the first prompt's compute with the MoE hook installed (which asks for a re-reserve
    of the scheduler, patch 0001): patch 0008 reserves before the batch's timing starts. Oracle: the same prompt
    evaluated again (no re-reserve pending then); without the patch the first read about 0.001 ms, a thousandth of
    the second."""
    from hybrimoe import Llama
    from hybrimoe.runtime.generate import generate

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), moe_hook=True, n_ctx=256, n_batch=128, n_ubatch=128, verbose=False)
    try:
        toks = llm.tokenize(b"Once upon a time " * 12, add_bos=True, special=False)
        first = generate(llm, toks, 2)
        llm.reset()  # the whole prompt again, not the prefix kept in the KV cache
        again = generate(llm, toks, 2)
    finally:
        llm.close()
    assert first.n_prompt_eval == again.n_prompt_eval == len(toks)
    assert first.prompt_s > 0.2 * again.prompt_s, (first.prompt_s, again.prompt_s)
