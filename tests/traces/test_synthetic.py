"""Synthetic routing traces (hybrimoe.traces.synthetic, hybrimoe.traces.stats): the statistics on traces with known
answers, the generator against its knobs (oracle: routing_stats on its output), determinism, valid rows and scores,
bad knobs, the built-in model facts against their config arithmetic, ``hybrimoe synth`` feeding ``hybrimoe simulate``,
and (where the DeepSeek-V2-Lite trace is present) the fit reproducing the real trace's statistics."""
import json

import numpy as np
import pytest

from hybrimoe.commands import main as hybrimoe_main
from hybrimoe.model.facts import MODEL_FACTS, ModelFacts, bits_per_weight
from hybrimoe.traces.format import RoutingTrace, load_trace
from hybrimoe.traces.stats import routing_stats
from hybrimoe.traces.synthetic import FITTED_DSV2_LITE, LOCALITY, SHAPES, fit_synthetic, synthetic_trace

KNOBS = ("skew", "overlap", "persistence", "cross_layer")
#: how far a generated trace's measured statistics may be from its knobs (a few thousand tokens, tens of experts)
TOL = {"skew": 0.025, "overlap": 0.02, "persistence": 0.02, "cross_layer": 0.03}


def _trace(ids, offsets, E):
    ids = np.asarray(ids, np.int16)
    return RoutingTrace(expert_ids=ids, prompt_offsets=np.asarray(offsets, np.int64), num_experts=E,
                        top_k=ids.shape[2], expert_bytes=np.ones(ids.shape[1]))


# ---- the statistics on traces whose answers are known -----------------------------------------------------------

def test_stats_of_constructed_traces():
    rng = np.random.default_rng(0)
    E, k, T = 8, 2, 400
    base = np.array([rng.choice(E, k, replace=False) for _ in range(T)])
    perm = rng.permutation(E)
    # layer 1 = a fixed relabelling of layer 0: perfectly predictable through that mapping
    s = routing_stats(_trace(np.stack([base, perm[base]], axis=1), [0, T], E))
    assert s["per_layer"]["cross_layer_raw"] == [1.0] and s["cross_layer"] == pytest.approx(1.0)
    # independent uniform tokens: no temporal lift, skew near 0.25
    assert abs(s["overlap"]) < 0.06 and 0.25 <= s["skew"] < 0.3
    # two prompts, each repeating one set: every within-prompt pair is identical; the boundary pair is not counted
    rows = np.array([[0, 1]] * 50 + [[2, 3]] * 50)[:, None, :]
    s = routing_stats(_trace(rows, [0, 50, 100], 8))
    assert s["overlap_raw"] == 1.0 and s["overlap"] == pytest.approx(1.0) and s["n_pairs"] == 98
    assert s["overlap_by_lag"][16] == pytest.approx(1.0)
    # one layer always {0, 1} of 8: the hottest 25% (2 experts) take everything
    assert routing_stats(_trace(np.tile([[[0, 1]]], (20, 1, 1)), [0, 20], 8))["skew"] == 1.0
    with pytest.raises(ValueError, match="consecutive"):
        routing_stats(_trace(rows[:6], [0, 1, 2, 3, 4, 5, 6], 8))


# ---- the generator against its knobs --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,knobs", [
    ("mixtral-8x7b", {"locality": "high"}),
    ("mixtral-8x7b", {"skew": 0.45, "overlap": 0.5, "persistence": 0.2, "cross_layer": 0.45}),
    ("deepseek-v2-lite", {"locality": "high"}),
    ("deepseek-v2-lite", {"skew": 0.27, "overlap": 0.3, "persistence": 0.02, "cross_layer": 0.2}),
    ("deepseek-v2-lite", {"locality": "low"}),
])
def test_generated_statistics_match_the_knobs(shape, knobs):
    tr = synthetic_trace(shape, 3000, n_prompts=60, seed=3, scores=False, **knobs)
    want = tr.synthetic["knobs"]
    got = routing_stats(tr)
    for name in KNOBS:
        assert abs(got[name] - want[name]) <= TOL[name], (name, got[name], want[name])


def test_locality_presets_differ_where_they_should():
    hi = routing_stats(synthetic_trace("mixtral-8x7b", 2000, locality="high", seed=0, scores=False))
    lo = routing_stats(synthetic_trace("mixtral-8x7b", 2000, locality="low", seed=0, scores=False))
    assert hi["overlap"] - lo["overlap"] > 0.12 and hi["persistence"] - lo["persistence"] > 0.03
    assert abs(hi["skew"] - lo["skew"]) < 0.03
    assert LOCALITY["high"] == FITTED_DSV2_LITE and LOCALITY["low"].overlap == 0.0


def test_seeds():
    a = synthetic_trace("deepseek-v2-lite", 200, seed=5)
    b = synthetic_trace("deepseek-v2-lite", 200, seed=5)
    c = synthetic_trace("deepseek-v2-lite", 200, seed=6)
    np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    np.testing.assert_array_equal(a.router_scores, b.router_scores)
    assert a.synthetic == b.synthetic
    assert (a.expert_ids != c.expert_ids).mean() > 0.5


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b"])
def test_rows_scores_and_fields(shape):
    f = SHAPES[shape]
    tr = synthetic_trace(shape, 60, n_prompts=3, locality="low", seed=0, topk_mass=0.7)
    L, E, k = f.n_moe_layers, f.n_experts, f.top_k
    assert tr.expert_ids.shape == (60, L, k) and tr.expert_ids.dtype == np.int16
    ids = tr.expert_ids.astype(np.int64)
    assert ids.min() >= 0 and ids.max() < E
    srt = np.sort(ids, axis=2)
    assert not (srt[:, :, 1:] == srt[:, :, :-1]).any()                     # k distinct ids per row
    tr.validate(check_tokens=True)
    assert tr.facts is f and tr.model == shape and tr.gating == f.gating and tr.n_dense_layers == f.n_dense_layers
    np.testing.assert_array_equal(tr.expert_bytes, f.per_layer_expert_bytes())
    np.testing.assert_array_equal(tr.moe_layer_ids, f.moe_layer_ids)
    np.testing.assert_array_equal(tr.prompt_offsets, [0, 20, 40, 60])
    assert tr.synthetic["shape"] == shape and "ASSUMPTION" in tr.synthetic["score_model"]
    sc = tr.router_scores
    assert sc.shape == (60, L, E) and np.isfinite(sc).all()
    # the routed experts are the top-k of the scores, highest first
    top = np.argsort(-sc, axis=2, kind="stable")[:, :, :k]
    np.testing.assert_array_equal(top, ids)
    if f.gating == "softmax":
        np.testing.assert_allclose(sc.sum(axis=2), 1.0, rtol=1e-4)
        mass = np.take_along_axis(sc, ids, axis=2).sum(axis=2).mean()
        assert mass == pytest.approx(0.7, abs=0.03)
    elif f.gating == "sigmoid":
        assert ((sc > 0) & (sc < 1)).all()
    else:  # softmax_weight: raw logits; their softmax over all experts carries the stated mass
        p = np.exp(sc - sc.max(axis=2, keepdims=True))
        p /= p.sum(axis=2, keepdims=True)
        assert np.take_along_axis(p, ids, axis=2).sum(axis=2).mean() == pytest.approx(0.7, abs=0.03)


def test_save_and_load_keep_everything(tmp_path):
    tr = synthetic_trace("mixtral-8x7b", 100, n_prompts=2, seed=1)
    path = tmp_path / "s.npz"
    tr.save(path)
    back = load_trace(path)
    np.testing.assert_array_equal(back.expert_ids, tr.expert_ids)
    np.testing.assert_allclose(back.router_scores, tr.router_scores, rtol=1e-3, atol=1e-4)    # float16 on disk
    assert back.synthetic == json.loads(json.dumps(tr.synthetic)) and back.facts == tr.facts
    assert load_trace(path).resolve_facts().name == "mixtral-8x7b"
    assert synthetic_trace("mixtral-8x7b", 10, scores=False).router_scores is None


@pytest.mark.parametrize("kw,name", [
    ({"skew": 0.2}, "skew"), ({"skew": 1.0}, "skew"), ({"overlap": -0.1}, "overlap"),
    ({"overlap": float("nan")}, "overlap"), ({"persistence": 0.3}, "persistence"),
    ({"cross_layer": 1.5}, "cross_layer"), ({"cross_layer": 0.99}, "cross_layer"), ({"skew": "0.3"}, "skew"),
    ({"topk_mass": 0.1}, "topk_mass"), ({"topk_mass": 1.0}, "topk_mass"), ({"n_prompts": 0}, "n_prompts"),
    ({"n_prompts": 60}, "n_prompts"), ({"seed": -1}, "seed"), ({"locality": "medium"}, "locality"),
])
def test_bad_knobs_name_the_knob(kw, name):
    with pytest.raises(ValueError, match=name):
        synthetic_trace("mixtral-8x7b", 100, **kw)


def test_bad_shape_and_length():
    with pytest.raises(ValueError, match="unknown shape 'mixtral'.*mixtral-8x7b"):
        synthetic_trace("mixtral", 100)
    with pytest.raises(ValueError, match="n_tokens"):
        synthetic_trace("mixtral-8x7b", 1)


# ---- model facts: config arithmetic and the quant table -------------------------------------------------------

def test_quant_table():
    assert [bits_per_weight(q) for q in ("Q4_K", "Q6_K", "Q8_0", "MXFP4")] == [4.5, 6.5625, 8.5, 4.25]
    with pytest.raises(ValueError, match="IQ9"):
        bits_per_weight("IQ9")


@pytest.mark.parametrize("name,shape,dense,hidden,ff", [
    ("mixtral-8x7b", (32, 8, 2), 0, 4096, 14336), ("qwen3-30b-a3b", (48, 128, 8), 0, 2048, 768),
    ("deepseek-v3", (58, 256, 8), 3, 7168, 2048), ("kimi-k2", (60, 384, 8), 1, 7168, 2048),
    ("gpt-oss-120b", (36, 128, 4), 0, 2880, 2880),
])
def test_model_facts_from_config(name, shape, dense, hidden, ff):
    f = MODEL_FACTS[name]
    assert (f.n_moe_layers, f.n_experts, f.top_k) == shape and f.n_dense_layers == dense
    assert (f.n_embd, f.n_ff_exp, f.expert_params) == (hidden, ff, 3 * hidden * ff)
    lb = f.per_layer_expert_bytes()
    m = hidden * ff / 8                                                    # bytes per bit of one matrix
    if name == "gpt-oss-120b":
        np.testing.assert_allclose(lb, 3 * hidden * ff * 17 / 32)            # MXFP4: 17 bytes per 32 weights
    else:  # Q4_K_M: gate, up Q4_K; ffn_down Q6_K where upstream's use_more_bits(il, n_layer) holds
        n = f.n_layer
        more = [il < n // 8 or il >= 7 * n // 8 or (il - n // 8) % 3 == 2 for il in f.moe_layer_ids]
        np.testing.assert_allclose(lb, [m * (2 * 4.5 + (6.5625 if x else 4.5)) for x in more])
    assert f.expert_bytes == pytest.approx(lb.mean())
    assert {"shape", "expert_bytes", "non_expert", "assumptions"} <= set(f.sources)
    assert ModelFacts.from_dict(f.to_dict()) == f


def test_mixtral_q6_layers_and_deepseek_v3_layers():
    mix = MODEL_FACTS["mixtral-8x7b"].per_layer_expert_bytes()
    q6 = [i for i in range(32) if mix[i] > mix.min()]
    assert q6 == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    v3 = MODEL_FACTS["deepseek-v3"]
    assert v3.moe_layer_ids == tuple(range(3, 61)) and v3.gating == "sigmoid" and v3.n_shared_experts == 1


# ---- the command line ---------------------------------------------------------------------------------------------

def test_synth_command_feeds_simulate(tmp_path, capsys):
    out = tmp_path / "t.npz"
    argv = ["synth", "--shape", "mixtral-8x7b", "--locality", "high", "-n", "400", "--seed", "0", "-o", str(out)]
    assert hybrimoe_main(argv) == 0
    text = capsys.readouterr().out
    assert "wrote" in text and "ASSUMPTION" in text
    before = out.read_bytes()
    assert hybrimoe_main(argv[:-2] + ["--skew", "0.4", "-o", str(out)]) == 2               # no overwrite
    assert "exists" in capsys.readouterr().err and out.read_bytes() == before
    assert hybrimoe_main(argv + ["--force", "--stats"]) == 0 and "measured: skew" in capsys.readouterr().out
    for bad, word in ((["--shape", "mixtral"], "mixtral"), (["--locality", "mid"], "mid"),
                      (["--overlap", "2"], "overlap"), (["--cross-layer", "-1"], "--cross-layer")):
        args = ["synth", "--shape", "mixtral-8x7b", "-n", "100", "-o", str(tmp_path / "bad.npz")] + bad
        assert hybrimoe_main(args) == 2
        assert word in capsys.readouterr().err and not (tmp_path / "bad.npz").exists()
    rec = tmp_path / "r.json"
    assert hybrimoe_main(["simulate", "--trace", str(out), "--policies", "hybrimoe,hybrimoe-lru,ktransformers",
                     "--no-progress", "--json", str(rec)]) == 0
    recs = json.loads(rec.read_text())
    assert [r["policy"] for r in recs] == ["hybrimoe", "hybrimoe-lru", "ktransformers"]
    assert all(0 < r["hit_rate"] <= 1 and r["tokens"] > 0 for r in recs)
    assert recs[0]["assumptions"]["model_facts"].startswith("mixtral-8x7b")


# ---- the fit on the real trace (only where it is present) ---------------------------------------------------------

def test_fit_reproduces_the_dsv2lite_trace(dev_trace):
    path = dev_trace
    real = load_trace(path)
    knobs = fit_synthetic(real)
    for name in KNOBS:   # the stored constants are this fit
        assert getattr(knobs, name) == pytest.approx(getattr(FITTED_DSV2_LITE, name), abs=2e-4), name
    want = routing_stats(real)
    got = routing_stats(synthetic_trace("deepseek-v2-lite", 12000, seed=0, scores=False, **knobs.__dict__))
    for name in KNOBS + ("overlap_raw", "cross_layer_raw"):
        assert abs(got[name] - want[name]) <= 0.02, (name, got[name], want[name])
