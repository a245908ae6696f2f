"""hybrimoe.Llama's keywords: an unknown one is a TypeError naming the closest known one (llama-cpp-python's own
``**kwargs`` would swallow it and run without the engine), and what llama-cpp-python mishandles works: a
``draft_model`` without ``logits_all`` (speculative decoding), checked with the engine on against upstream."""
from __future__ import annotations

import pytest

from hybrimoe.runtime.engine_facts import slot_bytes


# both sides in the file's layout (no_repack): the stand-in computes the GPU share with the plain CPU kernels, and
# upstream's repacked ones may round differently (tests/runtime/test_engine_repack.py covers repacked weights)
def _common(rpc_server, **kw):
    return dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=512, n_batch=64, n_ubatch=16, seed=0,
                verbose=False, no_repack=True, **kw)


@pytest.mark.parametrize("kw, close", [({"moe_cahce": "25%"}, "moe_cache"), ({"n_gpu_layer": 1}, "n_gpu_layers"),
                                       ({"moe_polcy": "hybrimoe"}, "moe_policy"), ({"zzzzzz": 1}, None)])
def test_unknown_keyword_is_a_type_error_naming_the_closest(tiny_model, kw, close):
    from hybrimoe import Llama

    with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(kw))}'") as e:
        Llama(str(tiny_model("qwen3moe", "Q8_0")), verbose=False, **kw)
    if close:
        assert f"did you mean '{close}'?" in str(e.value)
    else:
        assert "did you mean" not in str(e.value)


def test_known_upstream_keywords_pass(tiny_model):
    from hybrimoe import Llama

    llm = Llama(str(tiny_model("qwen3moe", "Q8_0")), n_ctx=128, n_threads=1, use_mmap=True, verbose=False)
    try:
        assert llm.n_ctx() >= 128
    finally:
        llm.close()


def test_draft_model_without_logits_all_matches_upstream(tiny_model, rpc_server, split_cost_model):
    """Prompt-lookup drafting (multi-token verification batches) with the engine on: runs without ``logits_all``
    and gives upstream's tokens at the same placement (our libllama without the hook: ``-ngl 99 -ot exps=CPU
    --no-repack``; given ``logits_all=True``, which llama-cpp-python's own drafting needs), with a mixed CPU/GPU
    split."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from hybrimoe import Llama

    path = tiny_model("deepseek2", "Q8_0", n_layer=4)
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    llm = Llama(str(path), draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4),
                moe_cache=4 * slot_bytes(path), moe_cost_model=split_cost_model, **_common(rpc_server))
    try:
        ours = llm(prompt, max_tokens=32, temperature=0)["choices"][0]["text"]
        st = llm.moe_stats()["engine"]
    finally:
        llm.close()
    assert st["gpu_experts"] > 0 and st["cpu_experts"] > 0, st
    ref = Llama(str(path), draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4), logits_all=True,
                tensor_buft_overrides="exps=CPU", **_common(rpc_server))
    try:
        theirs = ref(prompt, max_tokens=32, temperature=0)["choices"][0]["text"]
    finally:
        ref.close()
    assert ours == theirs and len(ours) > 0


def _last_logits_of(path, prompt: bytes, **kw):
    import numpy as np

    from hybrimoe import Llama

    llm = Llama(str(path), n_ctx=128, n_threads=1, verbose=False, **kw)
    try:
        llm.eval(llm.tokenize(prompt, add_bos=True))
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy(), \
            int(llm.context_params.flash_attn_type)
    finally:
        llm.close()


def test_flash_attn_auto_reaches_the_context(tiny_model):
    """``flash_attn="auto"`` (llama.cpp's default, which llama-cpp-python's boolean cannot express) creates the
    context with it: on the CPU, whose backend supports flash attention, the logits are flash attention's, bit for
    bit those of ``flash_attn=True`` ("on") and not those of ``False`` ("off", llama-cpp-python's default)."""
    import numpy as np

    path = tiny_model("qwen3moe", "Q8_0")
    got = {fa: _last_logits_of(path, b"Once upon a time there was", flash_attn=fa)
           for fa in ("auto", True, "on", False, "off")}
    assert [got[fa][1] for fa in ("auto", True, "on", False, "off")] == [-1, 1, 1, 0, 0]
    assert np.array_equal(got["auto"][0], got[True][0]) and np.array_equal(got["on"][0], got[True][0])
    assert np.array_equal(got["off"][0], got[False][0])
    assert not np.array_equal(got["auto"][0], got[False][0])


def test_flash_attn_values_as_llama_cpp_python_and_llama_cpp_read_them():
    import numpy as np

    from hybrimoe.runtime.params import flash_attn_type

    for v, want in ((True, 1), (False, 0), (None, 0), (1, 1), (0, 0), (np.bool_(True), 1), ("auto", -1),
                    ("on", 1), ("Enabled", 1), ("true", 1), ("off", 0), ("disabled", 0), ("-1", -1)):
        assert flash_attn_type(v) == want, v


@pytest.mark.parametrize("bad", ["yes", 2, 1.0])
def test_a_bad_flash_attn_is_a_value_error(tiny_model, bad):
    from hybrimoe import Llama

    with pytest.raises(ValueError, match="flash_attn must be True, False, 'on', 'off' or 'auto'"):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), verbose=False, flash_attn=bad)


@pytest.mark.parametrize("kw", [dict(n_threads=-3), dict(n_threads_batch=-1), dict(n_threads=2.0),
                                dict(n_threads_batch=True)])
def test_a_bad_thread_count_is_a_value_error(tiny_model, kw):
    from hybrimoe import Llama

    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), verbose=False, **kw)


def test_thread_counts_llama_cpp_python_takes(tiny_model):
    """0 is llama-cpp-python's default count as None is (its ``n_threads or ...``); numpy integers are integers."""
    import numpy as np

    from hybrimoe import Llama

    llm = Llama(str(tiny_model("qwen3moe", "Q8_0")), verbose=False, n_threads=0, n_threads_batch=np.int64(2))
    try:
        assert llm.n_threads >= 1
    finally:
        llm.close()


@pytest.mark.parametrize("fa", ["auto", "on"])
def test_engine_with_flash_attention_matches_upstream(tiny_model, rpc_server, split_cost_model, fa):
    """The engine's CPU/GPU split under flash attention gives upstream's tokens and logits at the same placement and
    the same ``flash_attn`` (our libllama without the hook, ``-ngl 99 -ot exps=CPU --no-repack``), bit for bit."""
    import numpy as np

    from hybrimoe import Llama
    from hybrimoe.testing.upstream import greedy_with_logits, prompt_tokens

    path = tiny_model("deepseek2", "Q8_0", n_layer=4)
    out = []
    for kw in (dict(moe_cache=4 * slot_bytes(path), moe_cost_model=split_cost_model),
               dict(tensor_buft_overrides="exps=CPU")):
        llm = Llama(str(path), flash_attn=fa, **kw, **_common(rpc_server))
        try:
            out.append(greedy_with_logits(llm, prompt_tokens(llm, 24), 16))
            if "moe_cache" in kw:
                st = llm.moe_stats()["engine"]
                assert st["gpu_experts"] > 0 and st["cpu_experts"] > 0, st
        finally:
            llm.close()
    (ours, lo), (theirs, lt) = out
    assert ours == theirs and len(ours) == 16
    assert np.array_equal(lo, lt)
