"""Trace format (hybrimoe.trace v1) and the loader for the DeepSeek-V2-Lite development trace (a file given with
--trace / $HYBRIMOE_TRACE; docs/design.md §12)."""
import numpy as np
import pytest

from hybrimoe import _core
from hybrimoe.trace import MODEL_FACTS, RoutingTrace, default_trace_path, load_trace


def make(n_tok=10, n_layers=3, k=2, n_exp=8, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(n_exp, k, replace=False) for _ in range(n_layers)])
                    for _ in range(n_tok)]).astype(np.int16)
    return RoutingTrace(expert_ids=ids, prompt_offsets=np.array([0, 4, n_tok]), num_experts=n_exp, top_k=k,
                        expert_bytes=np.full(n_layers, 1e6), n_dense_layers=1, model="")


def test_roundtrip_v1(tmp_path):
    tr = make()
    tr.router_scores = np.random.default_rng(1).random((10, 3, 8)).astype(np.float32)
    tr.save(tmp_path / "t.npz")
    back = load_trace(tmp_path / "t.npz")
    assert back.format_version == 1
    np.testing.assert_array_equal(back.expert_ids, tr.expert_ids)
    np.testing.assert_array_equal(back.prompt_offsets, tr.prompt_offsets)
    np.testing.assert_allclose(back.expert_bytes, tr.expert_bytes)
    np.testing.assert_allclose(back.router_scores, tr.router_scores, atol=1e-3)  # stored as float16
    assert back.n_dense_layers == 1 and back.n_prompts == 2
    core = back.to_core()
    assert (core.n_tokens, core.n_layers, core.top_k, core.n_experts, core.has_scores) == (10, 3, 2, 8, True)


def test_bad_traces(tmp_path):
    tr = make()
    tr.expert_ids[3, 1, 0] = 8
    with pytest.raises(ValueError, match="expert id 8 is outside 0..7"):
        tr.validate()
    with pytest.raises(ValueError, match="outside 0..7"):
        tr.to_core()
    tr = make()
    tr.prompt_offsets = np.array([0, 4, 9])
    with pytest.raises(ValueError, match="prompt_offsets"):
        tr.validate()
    tr = make()
    tr.expert_bytes = np.full(2, 1e6)
    with pytest.raises(ValueError, match="expert_bytes"):
        tr.validate()
    tr = make()
    tr.expert_ids[0, 0] = [3, 3]
    with pytest.raises(ValueError, match="expert 3 repeated at token 0"):
        tr.to_core()
    with pytest.raises(ValueError, match="3-D"):
        _core.Trace(np.zeros((4, 2), np.int16), np.array([0, 4]), [1.0], 8)
    with pytest.raises(ValueError, match="one value per MoE layer"):
        _core.Trace(np.zeros((4, 2, 1), np.int16), np.array([0, 4]), [1.0], 8)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "none.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable .npz"):
        load_trace(tmp_path / "junk.npz")
    np.savez(tmp_path / "noids.npz", prompt_offsets=np.array([0, 1]), num_experts=4, top_k=1)
    with pytest.raises(ValueError, match="lacks the field 'expert_ids'"):
        load_trace(tmp_path / "noids.npz")
    np.savez(tmp_path / "unknown.npz", expert_ids=np.zeros((2, 1, 1), np.int8), prompt_offsets=np.array([0, 2]),
             num_experts=4, top_k=1)
    with pytest.raises(ValueError, match="model is unknown"):
        load_trace(tmp_path / "unknown.npz")
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        load_trace(tmp_path / "unknown.npz", model="gpt")
    np.savez(tmp_path / "future.npz", format_version=9, expert_ids=np.zeros((2, 1, 1), np.int8),
             prompt_offsets=np.array([0, 2]), num_experts=4, top_k=1)
    with pytest.raises(ValueError, match="format version 9"):
        load_trace(tmp_path / "future.npz")
    np.savez(tmp_path / "shape.npz", expert_ids=np.zeros((2, 26, 5), np.int8), prompt_offsets=np.array([0, 2]),
             num_experts=64, top_k=6, moe_layer_ids=np.arange(1, 27))
    with pytest.raises(ValueError, match="last dimension 5 != top_k 6"):
        load_trace(tmp_path / "shape.npz", model="deepseek-v2-lite")


def test_dsv2lite_facts_match_hybrimoe_md():
    f = MODEL_FACTS["deepseek-v2-lite"]
    assert f.expert_params == 3 * 2048 * 1408
    # docs/design.md §6: gate+up Q4_K 3.24 MB, about 5.2-6.3 MB per expert in total.
    assert 2 * 2048 * 1408 * 4.5 / 8 == pytest.approx(3.24e6, rel=2e-3)
    assert 5.2e6 <= f.expert_bytes <= 6.32e6


def test_load_dsv2lite_trace():
    path = default_trace_path()
    if not path.is_file():
        pytest.skip(f"routing trace not present at {path} (set HYBRIMOE_TRACE)")
    tr = load_trace(path)
    assert tr.model == "deepseek-v2-lite" and tr.format_version == 0
    assert (tr.n_layers, tr.num_experts, tr.top_k, tr.n_dense_layers) == (26, 64, 6, 1)
    assert tr.n_tokens == tr.prompt_offsets[-1] and not tr.has_scores
    core = tr.to_core()
    assert core.n_prompts == tr.n_prompts
