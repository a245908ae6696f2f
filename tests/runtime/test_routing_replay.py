"""Routing override (patch 0002): forced expert ids reach every MoE layer, with and without the hook.

Oracle: the model's own routing. Replaying the ids the router chose (recorded by the hook) must reproduce the
run exactly; replaying other ids must make the layers see exactly those ids (recorded again by the hook) and
change the output (negative control).
"""
from __future__ import annotations

import numpy as np
import pytest

from hybrimoe.testing.upstream import last_logits

PROMPT = "One two three four five six seven"


def _record(llm, tokens, n_layer):
    hook = llm.moe_hook
    hook.set_recording(True)
    llm.reset()
    llm.eval(tokens)
    out = last_logits(llm)
    rec = {il: hook.recorded(il) for il in range(n_layer)}
    hook.set_recording(False)
    return out, rec


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_replay_reproduces_and_forces_routing(arch, tiny_model):
    from hybrimoe import Llama

    path = str(tiny_model(arch, "Q8_0"))
    kw = dict(n_ctx=128, n_threads=2, verbose=False, moe_hook=True)
    llm = Llama(path, **kw)
    tokens = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    n_layer = llm.moe_hook.max_layers
    base_logits, natural = _record(llm, tokens, n_layer)
    llm.close()
    moe = [il for il in range(n_layer) if natural[il].size]
    k = natural[moe[0]].shape[1]
    n_expert = int(max(natural[il].max() for il in moe)) + 1

    table = np.zeros((len(tokens), n_layer, k), dtype=np.int32)
    for il in moe:
        table[:, il, :] = natural[il]
    llm = Llama(path, **kw, moe_replay=table)
    logits_replayed, seen = _record(llm, tokens, n_layer)
    for il in moe:
        np.testing.assert_array_equal(seen[il], natural[il])
        assert llm.moe_replay.calls(il) >= 1
    np.testing.assert_array_equal(logits_replayed, base_logits)
    llm.close()

    # other ids: shift every id by one expert
    forced = table.copy()
    forced[:, moe, :] = (forced[:, moe, :] + 1) % max(n_expert, k + 1)
    llm = Llama(path, **kw, moe_replay=forced)
    logits_forced, seen = _record(llm, tokens, n_layer)
    for il in moe:
        # the last layer computes only the output row (the last token): llama.cpp's inp_out_ids
        rows = seen[il].shape[0]
        assert rows in (1, len(tokens))
        np.testing.assert_array_equal(seen[il], forced[len(tokens) - rows:, il, :])
    assert not np.array_equal(logits_forced, base_logits)
    llm.close()


def test_replay_without_hook_matches_hooked_replay(tiny_model):
    from hybrimoe import Llama

    path = str(tiny_model("qwen3moe", "Q8_0"))
    import gguf

    llm = Llama(path, n_ctx=128, n_threads=2, verbose=False)
    tokens = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    llm.close()
    rng = np.random.default_rng(0)
    r = gguf.GGUFReader(path)
    n_layer = next(int(f.parts[f.data[0]][0]) for name, f in r.fields.items() if name.endswith(".block_count"))
    n_expert = next(int(f.parts[f.data[0]][0]) for name, f in r.fields.items() if name.endswith(".expert_count"))
    k = next(int(f.parts[f.data[0]][0]) for name, f in r.fields.items() if name.endswith(".expert_used_count"))
    table = np.stack([np.stack([rng.permutation(n_expert)[:k] for _ in range(n_layer)]) for _ in tokens])
    outs = []
    for hook in (False, True):
        llm = Llama(path, n_ctx=128, n_threads=2, verbose=False, moe_replay=table, moe_hook=hook)
        llm.eval(tokens)
        outs.append(last_logits(llm))
        llm.close()
    np.testing.assert_array_equal(outs[0], outs[1])


def test_replay_rejects_bad_tables(tiny_model):
    from hybrimoe import Llama

    path = str(tiny_model("qwen3moe", "Q8_0"))
    with pytest.raises(ValueError, match="layers"):
        Llama(path, n_ctx=64, verbose=False, moe_replay=np.zeros((4, 99, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="outside"):
        Llama(path, n_ctx=64, verbose=False, moe_replay=np.full((4, 2, 2), 10_000, dtype=np.int32))
    with pytest.raises(ValueError, match="shape"):
        Llama(path, n_ctx=64, verbose=False, moe_replay=np.zeros((4, 2), dtype=np.int32))


def test_replay_rejects_wrong_k_duplicates_and_floats(tiny_model):
    """The Python API checks a table as --replay-trace does: k must be the model's top-k (no column dropped or
    filled in), no id twice in a row, integer ids; each error names moe_replay and both shapes."""
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts

    path = str(tiny_model("qwen3moe", "Q8_0"))
    f = engine_facts(path)
    good = np.tile(np.arange(f.top_k, dtype=np.int32), (4, f.n_layer, 1))
    wider = np.tile(np.arange(f.top_k + 1, dtype=np.int32), (4, f.n_layer, 1))
    narrower = good[:, :, :1]
    for bad in (wider, narrower):
        with pytest.raises(ValueError, match=r"moe_replay has shape") as e:
            Llama(path, n_ctx=64, verbose=False, moe_replay=bad)
        assert str(bad.shape) in str(e.value) and f"[n_rows, {f.n_layer}, {f.top_k}]" in str(e.value)
    dup = good.copy()
    dup[2, 1, :] = 0
    with pytest.raises(ValueError, match=r"moe_replay repeats an expert id.*row 2, layer 1"):
        Llama(path, n_ctx=64, verbose=False, moe_replay=dup)
    with pytest.raises(ValueError, match=r"moe_replay must hold integer.*float"):
        Llama(path, n_ctx=64, verbose=False, moe_replay=good.astype(np.float64))
    llm = Llama(path, n_ctx=64, verbose=False, moe_replay=good.astype(np.int64))  # any integer dtype is fine
    llm.close()


def test_replayed_scores_reach_the_cache_policies(tiny_model):
    """With ``moe_replay_scores`` the engine's policies see the replayed rows' scores (its decision records hold the
    scores it planned with); without them, the model's own router's, which are not the table's."""
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts

    path = str(tiny_model("qwen3moe", "Q8_0"))
    f = engine_facts(path)
    kw = dict(n_ctx=128, n_batch=64, n_ubatch=64, verbose=False, moe_cache=0)
    probe = Llama(path, vocab_only=True, verbose=False)
    tokens = probe.tokenize(PROMPT.encode(), add_bos=True, special=False)
    probe.close()
    rng = np.random.default_rng(0)
    n = len(tokens)
    ids = np.zeros((n, f.n_layer, f.top_k), dtype=np.int32)
    scores = np.zeros((n, f.n_layer, f.n_expert), dtype=np.float32)
    for il in f.moe_layers:
        for t in range(n):
            ids[t, il] = rng.choice(f.n_expert, f.top_k, replace=False)
        s = rng.random((n, f.n_expert)).astype(np.float32)
        scores[:, il] = s / s.sum(axis=1, keepdims=True)
    seen = {}
    for given in (True, False):
        llm = Llama(path, moe_replay=ids, moe_replay_scores=scores if given else None, **kw)
        try:
            llm.moe_log(True)
            llm.eval(tokens)
            seen[given] = {f.moe_layers[r["layer"]]: np.asarray(r["scores"]) for r in llm.moe_take_log()}
        finally:
            llm.close()
    for il in f.moe_layers:
        got = seen[True][il]  # the last layer keeps only the rows whose outputs are wanted: the last token
        np.testing.assert_array_equal(got, scores[n - len(got):, il])
        assert not np.array_equal(seen[False][il], scores[n - len(got):, il])


@pytest.mark.parametrize("kw, match", [(dict(moe_replay_scores=np.zeros((1, 1, 1))), "without moe_replay"),
                                       (dict(scores_shape=(3, 2, 2)), "must have shape")])
def test_bad_replay_scores(kw, match, tiny_model):
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts

    path = str(tiny_model("qwen3moe", "Q8_0"))
    f = engine_facts(path)
    ids = np.tile(np.arange(f.top_k, dtype=np.int32), (4, f.n_layer, 1))
    if "scores_shape" in kw:
        kw = dict(moe_replay=ids, moe_replay_scores=np.zeros(kw["scores_shape"], dtype=np.float32))
    with pytest.raises(ValueError, match=match):
        Llama(path, n_ctx=64, verbose=False, moe_cache=0, **kw)


def test_each_sequence_replays_from_its_own_offset(tiny_model):
    """Two sequences in one batch (upstream's decode of both prompts in one llama_decode): with
    ``sequence_offsets`` [0, 5] the token at position p of sequence 1 gets row 5 + p of the table while sequence 0
    keeps row p; without offsets both get row p (the hook records what each layer routed)."""
    import gguf

    from hybrimoe import Llama
    from hybrimoe._lib import llama_cpp_module
    from hybrimoe.testing.upstream import decode_together

    lc = llama_cpp_module().llama_cpp
    path = str(tiny_model("qwen3moe", "Q8_0"))
    r = gguf.GGUFReader(path)
    field = {name.rsplit(".", 1)[-1]: int(f.parts[f.data[0]][0]) for name, f in r.fields.items()
             if name.endswith((".block_count", ".expert_count", ".expert_used_count"))}
    n_layer, n_expert, k = field["block_count"], field["expert_count"], field["expert_used_count"]
    rng = np.random.default_rng(1)
    table = np.stack([np.stack([rng.permutation(n_expert)[:k] for _ in range(n_layer)]) for _ in range(64)])
    llm = Llama(path, n_ctx=256, n_threads=2, verbose=False, moe_hook=True, moe_replay=table, n_seq_max=2)
    try:
        tokens = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
        n = len(tokens)
        hook = llm.moe_hook
        moe = list(range(n_layer - 1))  # the last layer computes the output rows only
        seen = {}
        for offsets in ([], [0, 5]):
            llm.moe_replay.sequence_offsets = offsets
            assert llm.moe_replay.sequence_offsets == offsets
            hook.set_recording(True)
            decode_together(llm, [tokens, tokens], 1)
            seen[len(offsets)] = {il: hook.recorded(il) for il in moe}
            hook.set_recording(False)
            lc.llama_memory_clear(lc.llama_get_memory(llm.ctx), True)
    finally:
        llm.close()
    for il in moe:
        np.testing.assert_array_equal(seen[0][il], np.concatenate([table[:n, il], table[:n, il]]))
        np.testing.assert_array_equal(seen[2][il], np.concatenate([table[:n, il], table[5:5 + n, il]]))
