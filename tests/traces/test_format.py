"""Trace format (hybrimoe.traces.format, format hybrimoe.trace v2; v1 and v0 files still load), the checks of incomplete tokens, model facts from a
GGUF (hybrimoe.model.facts) against hand arithmetic, and the loader for the DeepSeek-V2-Lite development trace (a file given
with --trace / $HYBRIMOE_TRACE; docs/design.md §12)."""
import numpy as np
import pytest

from hybrimoe import _core
from hybrimoe.model.facts import MODEL_FACTS, ModelFacts, facts_from_gguf, selection_bias_from_gguf
from hybrimoe.tiny import make_tiny_model
from hybrimoe.traces.format import FORMAT_VERSION, RoutingTrace, load_trace


def make(n_tok=10, n_layers=3, k=2, n_exp=8, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(n_exp, k, replace=False) for _ in range(n_layers)])
                    for _ in range(n_tok)]).astype(np.int16)
    return RoutingTrace(expert_ids=ids, prompt_offsets=np.array([0, 4, n_tok]), num_experts=n_exp, top_k=k,
                        expert_bytes=np.full(n_layers, 1e6), n_dense_layers=1, model="")


def test_roundtrip_v2_every_field(tmp_path):
    """Version 2 writes and reads back every field: ids, offsets, bytes, scores (float16 on disk), phases, gating,
    selection bias, the partial flag and the model facts (here a real GGUF's)."""
    gguf_path = make_tiny_model(tmp_path / "q3.gguf", "qwen3moe")  # F32: 2 MoE layers, 8 experts, top-2
    facts = facts_from_gguf(gguf_path)
    rng = np.random.default_rng(1)
    tr = make(n_layers=2)
    tr.router_scores = rng.random((10, 2, 8)).astype(np.float32)
    tr.phases = np.array([0, 0, 0, 1, 0, 0, 1, 1, 1, 1], np.int8)
    tr.gating = "sigmoid"
    tr.selection_bias = rng.standard_normal((2, 8)).astype(np.float32)
    tr.partial = True
    tr.facts = facts
    tr.model = facts.name
    tr.moe_layer_ids = np.array([0, 1])
    tr.save(tmp_path / "t.npz")
    back = load_trace(tmp_path / "t.npz")
    assert back.format_version == FORMAT_VERSION == 2
    np.testing.assert_array_equal(back.expert_ids, tr.expert_ids)
    np.testing.assert_array_equal(back.prompt_offsets, tr.prompt_offsets)
    np.testing.assert_array_equal(back.expert_bytes, tr.expert_bytes)
    np.testing.assert_array_equal(back.moe_layer_ids, [0, 1])
    assert back.router_scores.dtype == np.float32
    np.testing.assert_array_equal(back.router_scores, tr.router_scores.astype(np.float16).astype(np.float32))
    assert back.phases.dtype == np.int8 and back.phases.tolist() == tr.phases.tolist()
    assert back.gating == "sigmoid" and back.partial is True
    np.testing.assert_array_equal(back.selection_bias, tr.selection_bias)
    assert back.facts == facts and back.resolve_facts() == facts
    assert (back.n_dense_layers, back.n_prompts, back.model) == (1, 2, facts.name)
    core = back.to_core()
    assert (core.n_tokens, core.n_layers, core.top_k, core.n_experts, core.has_scores) == (10, 2, 2, 8, True)


def test_version_1_and_0_files_still_load(tmp_path):
    """A version 1 file (as hybrimoe wrote it before version 2) and a version 0 file (no format fields, bytes from
    the built-in facts, recognised by shape) load, without the version 2 fields."""
    tr = make()
    np.savez_compressed(tmp_path / "v1.npz", format=np.array("hybrimoe.trace"), format_version=np.array(1),
                        expert_ids=tr.expert_ids.astype(np.int8), prompt_offsets=tr.prompt_offsets,
                        num_experts=np.array(8), top_k=np.array(2), expert_bytes=tr.expert_bytes,
                        n_dense_layers=np.array(1), model=np.array(""), moe_layer_ids=np.arange(1, 4),
                        router_scores=np.full((10, 3, 8), 0.125, np.float16))
    v1 = load_trace(tmp_path / "v1.npz")
    assert v1.format_version == 1 and v1.has_scores and v1.n_layers == 3
    assert (v1.phases, v1.gating, v1.selection_bias, v1.partial, v1.facts) == (None, "", None, False, None)
    np.testing.assert_array_equal(v1.expert_ids, tr.expert_ids)
    ids = make(n_tok=5, n_layers=26, k=6, n_exp=64).expert_ids
    np.savez(tmp_path / "v0.npz", expert_ids=ids.astype(np.int8), prompt_offsets=np.array([0, 2, 5]),
             num_experts=np.int16(64), top_k=np.int16(6), moe_layer_ids=np.arange(1, 27, dtype=np.int16))
    v0 = load_trace(tmp_path / "v0.npz")
    assert v0.format_version == 0 and v0.model == "deepseek-v2-lite" and v0.facts is None
    np.testing.assert_array_equal(v0.expert_bytes, np.full(26, MODEL_FACTS["deepseek-v2-lite"].expert_bytes))
    assert v0.resolve_facts() is MODEL_FACTS["deepseek-v2-lite"] and v0.n_dense_layers == 1


def test_save_is_atomic(tmp_path, monkeypatch):
    """A save that fails part way (here: the writer dies after writing some bytes) or refuses its input leaves the
    file that was there as it was, and no temporary file beside it."""
    target = tmp_path / "t.npz"
    make().save(target)
    before = target.read_bytes()

    def broken(fh, **arrays):
        fh.write(b"PK half a zip")
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(np, "savez_compressed", broken)
        with pytest.raises(OSError, match="No space left"):
            make(seed=5).save(target)
    assert target.read_bytes() == before
    big = make(seed=5)
    big.router_scores = np.zeros((10, 3, 8), np.float32)
    big.router_scores[2, 1, 4] = 1e6
    with pytest.raises(ValueError, match="1000000.0 of expert 4 at token 2, MoE layer 1 is beyond float16"):
        big.save(target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]
    make(seed=5).save(target)  # a good save replaces it
    assert target.read_bytes() != before
    np.testing.assert_array_equal(load_trace(target).expert_ids, make(seed=5).expert_ids)


def test_incomplete_tokens_are_named_and_dropped(tmp_path):
    """An id outside 0..E-1 (-1: a layer the recorder did not reach), a repeated id and a NaN score each give one
    line naming the token, its prompt and the MoE layer, and pointing at --drop-incomplete; drop_incomplete()
    removes those tokens and moves the prompt offsets and phases."""
    def bad(where, value):
        tr = make()
        tr.phases = np.array([0, 0, 1, 1, 0, 0, 0, 1, 1, 1], np.int8)
        tr.router_scores = np.full((10, 3, 8), 0.5, np.float32)
        if where == "score":
            tr.router_scores[7, 0, 3] = value
        else:
            tr.expert_ids[where] = value
        return tr

    cases = [(bad((5, 2), [-1, -1]), r"token 5 \(prompt 1\), MoE layer 2: expert id -1 is outside 0..7"),
             (bad((3, 1), [4, 4]), r"token 3 \(prompt 0\), MoE layer 1: expert 4 is repeated in the row \[4, 4\]"),
             (bad("score", np.nan), r"token 7 \(prompt 1\), MoE layer 0: the router score of expert 3 is nan")]
    for tr, msg in cases:
        with pytest.raises(ValueError, match=msg + r"; 1 token\(s\) have such problems .*--drop-incomplete"):
            tr.validate()
    tr = bad((5, 2), [-1, -1])
    tr.expert_ids[1, 0] = [9, 1]
    tr.router_scores[8, 1, 0] = np.inf
    tr.save(tmp_path / "partial.npz")  # a recorder saves what it reached
    with pytest.raises(ValueError, match=r"partial.npz: token 1 \(prompt 0\), MoE layer 0: expert id 9 .*; 3 token"):
        load_trace(tmp_path / "partial.npz")
    loaded = load_trace(tmp_path / "partial.npz", check_tokens=False)
    assert loaded.incomplete_tokens().tolist() == [i in (1, 5, 8) for i in range(10)]
    kept, n = loaded.drop_incomplete()
    assert n == 3 and kept.n_tokens == 7
    assert kept.prompt_offsets.tolist() == [0, 3, 7]  # prompt 0 lost token 1, prompt 1 tokens 5 and 8
    assert kept.phases.tolist() == [0, 1, 1, 0, 0, 1, 1]
    np.testing.assert_array_equal(kept.expert_ids, tr.expert_ids[[0, 2, 3, 4, 6, 7, 9]])
    kept.validate()
    assert kept.to_core().n_tokens == 7


def test_facts_that_do_not_fit_the_routing_are_refused(tmp_path):
    facts = facts_from_gguf(make_tiny_model(tmp_path / "q3.gguf", "qwen3moe"))  # 2 MoE layers
    tr = make()  # 3 MoE layers
    tr.facts = facts
    with pytest.raises(ValueError, match="trace has 3 MoE layers, 8 experts, top-2; its model facts has 2 MoE "
                                         "layers, 8 experts, top-2"):
        tr.validate()
    tr = make()
    tr.phases = np.array([0, 1, 2] + [0] * 7)
    with pytest.raises(ValueError, match=r"phase 2 at token 2 \(prompt 0\)"):
        tr.validate()
    tr = make()
    tr.gating = "relu"
    with pytest.raises(ValueError, match="gating 'relu' is not one of"):
        tr.validate()


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
    with pytest.raises(ValueError, match="not a .npz trace \\(not a zip archive"):
        load_trace(tmp_path / "junk.npz")
    (tmp_path / "cut.npz").write_bytes(b"PK\x03\x04 and then nothing")
    with pytest.raises(ValueError, match="not a readable .npz"):
        load_trace(tmp_path / "cut.npz")
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


def test_default_trace_path_looks_from_the_given_folder(tmp_path, monkeypatch):
    """Looked up from ``start`` and its parents, else beside ``start``; the working directory plays no part."""
    from hybrimoe.traces.format import default_trace_path

    monkeypatch.delenv("HYBRIMOE_TRACE", raising=False)
    start = tmp_path / "work" / "checkout"
    start.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere" / "deeper"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    assert default_trace_path(start) == tmp_path / "work" / "shared" / "traces" / "dsv2lite_dev.npz"
    found = tmp_path / "shared" / "traces" / "dsv2lite_dev.npz"
    found.parent.mkdir(parents=True)
    found.write_bytes(b"")
    assert default_trace_path(start) == found
    assert default_trace_path() == found  # from the working directory by default: elsewhere's parent holds it
    monkeypatch.setenv("HYBRIMOE_TRACE", str(tmp_path / "mine.npz"))
    assert default_trace_path(start) == tmp_path / "mine.npz"


def test_load_dsv2lite_trace(dev_trace):
    path = dev_trace
    tr = load_trace(path)
    assert tr.model == "deepseek-v2-lite" and tr.format_version == 0
    assert (tr.n_layers, tr.num_experts, tr.top_k, tr.n_dense_layers) == (26, 64, 6, 1)
    assert tr.n_tokens == tr.prompt_offsets[-1] and not tr.has_scores
    core = tr.to_core()
    assert core.n_prompts == tr.n_prompts


# ---- model facts from a GGUF -----------------------------------------------------------------------------------

def test_facts_from_gguf_qwen3moe_q8_0_by_hand(tiny_model):
    """The Q8_0 qwen3moe fixture: D=64, F=32, 8 experts, top-2, 2 layers, 4 heads of 16 (2 KV heads). Q8_0 stores
    32 values in 34 bytes; llama.cpp's quantizer keeps 1-D tensors (norms) and the router F32."""
    from hybrimoe.model import reader

    path = tiny_model("qwen3moe", "Q8_0")
    f = facts_from_gguf(path)
    D, F, E, hd = 64, 32, 8, 16
    q8 = lambda rows, cols: rows * (cols // 32) * 34  # noqa: E731  bytes of a Q8_0 matrix
    expert = q8(F, D) + q8(F, D) + q8(D, F)           # gate, up: F rows of D; down: D rows of F
    assert expert == 6528
    assert f.layer_expert_bytes == (expert, expert) and f.expert_bytes == expert
    d = reader.describe(path)
    assert [sum(d["expert_tensors"][k]["layers"][il]["bytes_per_expert"] for k in ("gate", "up", "down"))
            for il in (0, 1)] == [expert, expert]
    assert f.expert_params == 3 * D * F and f.n_ff_exp == F
    attn = 4 * hd * D + 2 * (2 * hd * D) + D * 4 * hd          # q, k and v (2 KV heads), output
    norms = D + hd + hd + D                                      # attn_norm, q_norm, k_norm, ffn_norm
    router = D * E
    assert f.non_expert_parts == {"attention": attn, "norms": norms, "router": router}
    assert f.non_expert_params_per_moe_layer == attn + norms + router == 12960
    attn_bytes = q8(4 * hd, D) + 2 * q8(2 * hd, D) + q8(D, 4 * hd)
    assert f.non_expert_bytes_per_moe_layer == attn_bytes + 4 * (norms + router) == 15744
    assert f.bytes_per_param_non_expert == pytest.approx(15744 / 12960)
    assert (f.n_moe_layers, f.n_dense_layers, f.dense_layer_params, f.dense_layer_bytes) == (2, 0, 0.0, None)
    assert (f.n_experts, f.top_k, f.n_shared_experts, f.n_embd, f.n_layer) == (E, 2, 0, D, 2)
    assert (f.architecture, f.moe_layer_ids, f.n_head, f.n_head_kv) == ("qwen3moe", (0, 1), 4, 2)
    assert f.gating == "softmax" and "absent" in f.sources["gating"]
    assert all(str(path) in f.sources[k] for k in ("shape", "expert_bytes", "expert_params", "non_expert",
                                                    "bytes_per_param_non_expert", "gating"))


def test_facts_from_gguf_deepseek2_by_hand(tiny_model):
    """The Q8_0 deepseek2 fixture: 3 blocks, the first dense (FFN width 2F), 6 experts, top-2, 1 shared expert,
    MLA attention (q_lora 32, kv_lora 32, rope 16, nope 16, v 16; 4 heads) and sigmoid gating in the file."""
    path = tiny_model("deepseek2", "Q8_0")
    f = facts_from_gguf(path)
    D, F, H = 64, 32, 4
    attn = 32 * D + H * 32 * 32 + (32 + 16) * D + H * 32 * 16 + H * 16 * 32 + D * H * 16
    norms = D + 32 + 32 + D                                      # attn_norm, q_a_norm, kv_a_norm, ffn_norm
    shared = 3 * D * F
    assert f.non_expert_parts == {"attention": attn, "norms": norms, "router": D * 6, "shared_experts": shared}
    assert f.non_expert_params_per_moe_layer == attn + norms + D * 6 + shared
    assert f.dense_layer_params == attn + norms + 3 * D * (2 * F)
    assert f.dense_layer_bytes is not None and f.dense_layer_bytes > 0
    assert (f.n_moe_layers, f.n_dense_layers, f.moe_layer_ids, f.n_layer) == (2, 1, (1, 2), 3)
    assert (f.n_experts, f.top_k, f.n_shared_experts, f.gating) == (6, 2, 1, "sigmoid")
    assert f.layer_expert_bytes == (3 * 32 * 2 * 34,) * 2  # Q8_0: 3 matrices of 32 rows of 64 or 64 rows of 32
    assert "expert_gating_func = 2" in f.sources["gating"]
    assert selection_bias_from_gguf(path) is None  # the fixture has no exp_probs_b


def test_selection_bias_and_bad_files(tmp_path):
    """exp_probs_b tensors come back per MoE layer (zeros where a layer has none); a missing, a non-GGUF and a
    dense file are refused with one line."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "bias.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    bias = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
    for il in range(2):
        for kind, shape in (("gate", (4, 16, 8)), ("up", (4, 16, 8)), ("down", (4, 8, 16))):
            w.add_tensor(f"blk.{il}.ffn_{kind}_exps.weight", np.zeros(shape, np.float32))
    w.add_tensor("blk.1.exp_probs_b.bias", bias)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = selection_bias_from_gguf(path)
    assert got.dtype == np.float32 and got.tolist() == [[0.0] * 4, bias.tolist()]
    f = facts_from_gguf(path)
    assert f.layer_expert_bytes == (3 * 16 * 8 * 4,) * 2 and f.gating == "softmax" and f.n_head is None
    assert f.non_expert_parts == {"router": 2.0}  # mean of 0 and 4 bias values
    with pytest.raises(FileNotFoundError):
        facts_from_gguf(tmp_path / "none.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        facts_from_gguf(tmp_path / "junk.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "dense.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for fn in (facts_from_gguf, selection_bias_from_gguf):
        with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
            fn(tmp_path / "dense.gguf")


def test_gating_rules():
    """<arch>.expert_gating_func as upstream numbers it (llama_expert_gating_func_type), and the architectures'
    own functions when the key is absent."""
    from hybrimoe.model.reader import expert_gating

    assert [expert_gating("deepseek2", v, 27, 102400)[0] for v in (1, 2, 3, 4, 9)] == \
        ["softmax", "sigmoid", "softmax_weight", "sqrt_softplus", ""]
    assert [expert_gating(a, None, 24, 1000)[0] for a in ("qwen3moe", "gpt-oss", "llama4", "deepseek2")] == \
        ["softmax", "softmax_weight", "sigmoid", "softmax"]
    assert expert_gating("deepseek2", 0, 47, 154880)[0] == "sigmoid"  # upstream's GLM 4.7 Lite rule


def test_model_facts_json_round_trip_and_errors(tiny_model):
    import json

    for f in (facts_from_gguf(tiny_model("deepseek2", "Q8_0")), MODEL_FACTS["deepseek-v2-lite"]):
        d = json.loads(json.dumps(f.to_dict(), allow_nan=False))
        assert ModelFacts.from_dict(d) == f
    good = MODEL_FACTS["deepseek-v2-lite"].to_dict()
    for change, msg in [(dict(colour="blue"), "unknown key\\(s\\) colour"),
                        (dict(top_k=None), "'top_k' must be an integer >= 0, got None"),
                        (dict(top_k=65), "'top_k' must be in 1..n_experts \\(64\\), got 65"),
                        (dict(expert_bytes=float("nan")), "'expert_bytes' must be a finite number >= 0"),
                        (dict(gating="tanh"), "'gating' must be one of"),
                        (dict(layer_expert_bytes=[1.0]), "'layer_expert_bytes' has 1 entries for 26 MoE layers"),
                        (dict(schema="other/1"), "'schema' must be 'hybrimoe.model_facts/1'")]:
        with pytest.raises(ValueError, match="facts of x: " + msg):
            ModelFacts.from_dict({**good, **change}, "facts of x")
    bad = dict(good)
    del bad["n_embd"]
    with pytest.raises(ValueError, match="missing key 'n_embd'"):
        ModelFacts.from_dict(bad)


def test_damaged_members_and_malformed_scalars_name_the_file(tmp_path):
    """A member whose bytes are damaged (found only when it is read) and a scalar field stored as an array get one
    ValueError naming the file (and the field), not a zipfile or numpy traceback."""
    tr = make()
    tr.gating = "softmax"
    good = tmp_path / "good.npz"
    tr.save(good)
    import zipfile

    with zipfile.ZipFile(good) as zf:
        info = max(zf.infolist(), key=lambda i: i.compress_size)  # the largest member: its data, not its header
    raw = bytearray(good.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    mid = start + info.compress_size // 2
    raw[mid:mid + 8] = bytes(b ^ 0xFF for b in raw[mid:mid + 8])
    bad = tmp_path / "bad.npz"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="bad.npz"):
        load_trace(bad)
    fields = dict(np.load(good))
    for key, value in (("num_experts", np.array([8, 8])), ("partial", np.array([True, False])),
                       ("gating", np.array(["softmax", "sigmoid"]))):
        f = dict(fields, **{key: value})
        p = tmp_path / f"{key}.npz"
        np.savez(p, **f)
        with pytest.raises(ValueError, match=rf"{key}.npz: field '{key}' must be a single value"):
            load_trace(p)
