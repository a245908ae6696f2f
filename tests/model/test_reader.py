"""Tests for hybrimoe.model.reader and ``hybrimoe info``: describe() numbers against an independent computation from the tensor shapes and
gguf.GGML_QUANT_SIZES, the printed report, dense models, and clear one-line errors for bad files."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from hybrimoe.commands import info as info_command
from hybrimoe.model import reader
from hybrimoe.tiny import make_tiny_model

gguf = pytest.importorskip("gguf")


def _bytes(t):
    """Independent byte size of a tensor: rows x (ne0 / block) x type_size."""
    bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t.tensor_type))]
    shape = [int(x) for x in t.shape]
    assert shape[0] % bs == 0
    return int(np.prod(shape[1:])) * (shape[0] // bs) * ts


def _expected(path):
    r = gguf.GGUFReader(str(path))
    routed = sum(_bytes(t) for t in r.tensors if "_exps." in t.name)
    other = sum(_bytes(t) for t in r.tensors if "_exps." not in t.name)
    per = {}
    for t in r.tensors:
        if t.name.endswith("_exps.weight"):
            il, kind = int(t.name.split(".")[1]), t.name.split(".")[2][4:-5]
            per[(il, kind)] = (gguf.GGMLQuantizationType(int(t.tensor_type)).name, _bytes(t) // int(t.shape[2]))
    return routed, other, per


def _run(argv, capsys):
    capsys.readouterr()  # drop what earlier steps (e.g. llama.cpp's quantizer log) printed
    ap = argparse.ArgumentParser()
    info_command.add_arguments(ap)
    rc = info_command.run(ap.parse_args(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_describe_f32_qwen3moe(tmp_path):
    p = make_tiny_model(tmp_path / "q3.gguf", "qwen3moe", n_expert=6, n_expert_used=1)
    d = reader.describe(p)
    assert d["architecture"] == "qwen3moe" and d["n_layer"] == 2 and d["n_embd"] == 64
    assert d["has_experts"] and d["moe_layers"] == [0, 1] and d["dense_layers"] == []
    assert d["n_expert"] == 6 and d["n_expert_used"] == 1 and d["shared"] is None
    # F32, 64 x 32 per expert
    for kind in ("gate", "up", "down"):
        assert d["expert_tensors"][kind]["bytes_per_expert"] == 64 * 32 * 4
        assert d["expert_tensors"][kind]["types"] == ["F32"]
    assert d["expert_tensors"]["down"]["shape"] == [32, 64]
    routed, other, _ = _expected(p)
    assert (d["routed_expert_bytes"], d["other_bytes"]) == (routed, other)
    assert routed == 2 * 3 * 6 * 64 * 32 * 4


def test_describe_q8_qwen2moe_shared(tmp_path):
    p = make_tiny_model(tmp_path / "q2.gguf", "qwen2moe", n_expert=60, n_expert_used=4, quant="Q8_0")
    d = reader.describe(p)
    assert d["n_expert"] == 60 and d["n_expert_used"] == 4
    assert d["shared"] == {"count": 1, "ff": 32, "gated": True}
    assert d["file_type"] == "MOSTLY_Q8_0"
    # Q8_0: blocks of 32 values in 34 bytes; gate/up rows of 64 -> 2 blocks, 32 rows per expert
    assert d["expert_tensors"]["gate"]["bytes_per_expert"] == 32 * 2 * 34
    assert d["expert_tensors"]["down"]["bytes_per_expert"] == 64 * 1 * 34
    routed, other, per = _expected(p)
    assert (d["routed_expert_bytes"], d["other_bytes"]) == (routed, other)
    for (il, kind), (tname, bpe) in per.items():
        assert d["expert_tensors"][kind]["layers"][il]["type"] == tname
        assert d["expert_tensors"][kind]["layers"][il]["bytes_per_expert"] == bpe


def test_describe_mix_and_report(tmp_path, capsys):
    p = make_tiny_model(tmp_path / "mix.gguf", "deepseek2", n_layer=2, n_embd=256, n_ff_exp=256, n_expert=6,
                        quant="mix")
    d = reader.describe(p)
    assert d["moe_layers"] == [1] and d["dense_layers"] == [0]
    assert d["shared"]["count"] == 1 and d["shared"]["ff"] == 256 and not d["shared"]["gated"]
    t = {k: v["types"] for k, v in d["expert_tensors"].items()}
    assert t == {"gate": ["Q4_K"], "up": ["Q8_0"], "down": ["Q6_K"]}
    routed, other, per = _expected(p)
    assert d["routed_expert_bytes"] == routed and d["other_bytes"] == other
    # Q4_K: 144 bytes per 256 values; 256 rows of 256 per expert
    assert d["expert_tensors"]["gate"]["bytes_per_expert"] == 256 * 144 == per[(1, "gate")][1]
    rc, out, err = _run([str(p)], capsys)
    assert rc == 0 and err == ""
    assert "deepseek2" in out and "MoE: 1; dense: 0" in out
    assert "6 routed per MoE layer, top-2, shared: 1 (width 256)" in out
    lines = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.strip().startswith("ffn_")}
    assert lines["ffn_gate_exps"][1:3] == ["Q4_K", str(256 * 144)]
    assert lines["ffn_up_exps"][1:3] == ["Q8_0", str(256 * 8 * 34)]
    assert lines["ffn_down_exps"][1:3] == ["Q6_K", str(256 * 210)]
    assert f"routed-expert bytes: {routed} " in out and f"other bytes:         {other} " in out


def test_dense_model(tmp_path, capsys):
    p = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((10, 32), np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((64, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    d = reader.describe(p)
    assert not d["has_experts"] and d["n_expert"] == 0 and d["routed_expert_bytes"] == 0
    assert d["other_bytes"] == (10 + 64) * 32 * 4 and d["dense_layers"] == [0]
    rc, out, _ = _run([str(p)], capsys)
    assert rc == 0 and "no routed-expert tensors" in out and "llama" in out


def test_missing_file(tmp_path, capsys):
    with pytest.raises(FileNotFoundError):
        reader.describe(tmp_path / "nope.gguf")
    rc, out, err = _run([str(tmp_path / "nope.gguf")], capsys)
    assert rc != 0 and out == ""
    assert err.count("\n") == 1 and "no such file" in err and "Traceback" not in err


def test_non_gguf(tmp_path, capsys):
    p = tmp_path / "x.gguf"
    p.write_text("this is not a model\n")
    with pytest.raises(ValueError, match="not a GGUF"):
        reader.describe(p)
    rc, _, err = _run([str(p)], capsys)
    assert rc != 0 and err.count("\n") == 1 and "not a GGUF" in err


@pytest.mark.parametrize("keep", [10, 3000, 0.6])
def test_truncated(tmp_path, capsys, keep):
    src = make_tiny_model(tmp_path / "full.gguf", "llama", n_layer=1)
    data = src.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(ValueError, match="truncated|corrupt"):
        reader.describe(p)
    rc, _, err = _run([str(p)], capsys)
    assert rc != 0 and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "olmoe", "llama", "deepseek2", "gpt-oss"])
def test_describe_every_arch_matches_independent_sums(tmp_path, arch):
    p = make_tiny_model(tmp_path / f"{arch}.gguf", arch, n_layer=3, n_expert=6, n_expert_used=2)
    d = reader.describe(p)
    routed, other, per = _expected(p)
    assert (d["routed_expert_bytes"], d["other_bytes"]) == (routed, other)  # gpt-oss: expert biases included
    assert d["tensor_bytes"] <= d["file_size"]
    n_dense = 1 if arch == "deepseek2" else 0
    assert d["moe_layers"] == list(range(n_dense, 3)) and d["n_expert"] == 6 and d["n_expert_used"] == 2
    assert (d["shared"] is not None) == (arch in ("qwen2moe", "deepseek2"))
    for (il, kind), (tname, bpe) in per.items():
        assert d["expert_tensors"][kind]["layers"][il]["bytes_per_expert"] == bpe == 64 * 32 * 4


def test_expert_variant_names_the_variant_and_whether_the_engine_runs_it(tmp_path, capsys):
    """Each MoE layer's variant, from the file's tensors and the architecture (upstream's type_op per arch): a
    plain SiLU-GLU file, and variants upstream's build_moe_ffn builds but the engine leaves to upstream (biases
    stored as F16, a gated squared ReLU), which the report says with the reason."""
    p = make_tiny_model(tmp_path / "q3.gguf", "qwen3moe")
    d = reader.describe(p)
    assert set(d["expert_variants"]) == set(d["moe_layers"])
    v = d["expert_variants"][0]
    assert v["name"] == "SiLU-GLU" and v["engine"] and not v["fused_gate_up"] and v["scales"] == []
    rc, out, _ = _run([str(p)], capsys)
    assert rc == 0 and "expert variant:      SiLU-GLU (layers 0-1): the engine runs it" in out
    w = {"down": {"layers": {0: {}}}, "gate": {"layers": {0: {}}}, "up": {"layers": {0: {}}}}
    f16 = {"up": {"layers": {0: {"type": "F16"}}}}
    v = reader.expert_variant("gpt-oss", 0, w, f16, {})
    assert v["activation"] == "swiglu_oai" and not v["engine"] and "F32" in v["why"]
    v = reader.expert_variant("nemotron_h_moe", 0, w, {}, {})
    assert v["activation"] == "relu_sqr" and not v["engine"] and "squared ReLU" in v["why"]
    ungated = {"down": {"layers": {0: {}}}, "up": {"layers": {0: {}}}}
    assert reader.expert_variant("nemotron_h_moe", 0, ungated, {}, {})["engine"]
    v = reader.expert_variant("step35", 0, w, {}, {}, clamp=[7.0])
    assert v["clamp"] == 7.0 and v["clamp_form"] == "clamp_silu_mul" and v["engine"]
    assert reader.expert_variant("deepseek4", 0, w, {}, {}, clamp=7.0)["clamp_form"] == "swiglu_clamp"
    assert reader.expert_variant("llama4", 0, w, {}, {})["weight_before_ffn"]


def test_info_estimates_the_disk_traffic_at_a_ram_budget(tmp_path, capsys):
    """``--moe-ram-cache``: simulated disk bytes per token for hybrimoe's RAM tier and upstream's mmap, decode and
    prefill; more RAM reads less from disk (the simulator is the oracle of the figures, the ordering is checked)."""
    import json

    p = make_tiny_model(tmp_path / "m.gguf", "qwen3moe", n_expert=16, n_layer=3)
    rc, out, err = _run([str(p), "--moe-ram-cache", "25%"], capsys)
    assert rc == 0, err
    assert "RAM tier:" in out and "MiB/token from disk" in out
    per = {}
    for budget in ("25%", "75%"):
        rc, out, err = _run([str(p), "--moe-ram-cache", budget, "--json"], capsys)
        assert rc == 0, err
        recs = json.loads(out)["ram_traffic"]
        assert {(r["stage"], r["ram_policy"]) for r in recs} == {(s, q) for s in ("decode", "prefill")
                                                               for q in ("hybrimoe", "mmap")}
        per[budget] = {(r["stage"], r["ram_policy"]): r for r in recs}
    for key in per["25%"]:
        assert per["25%"][key]["bytes_disk_per_token"] > per["75%"][key]["bytes_disk_per_token"] > 0, key
    assert per["25%"][("decode", "mmap")]["page_faults_per_token"] > 0
    assert per["25%"][("decode", "hybrimoe")]["page_faults_per_token"] == 0


def test_info_takes_auto_as_run_does(tmp_path, capsys):
    """``--moe-ram-cache auto``: the budget run's "auto" would take on this machine now (auto_ram_slots), in bytes;
    a tiny model fits whole there."""
    import json

    from hybrimoe.runtime.engine_facts import engine_facts

    p = make_tiny_model(tmp_path / "m.gguf", "qwen3moe", n_expert=16, n_layer=3)
    rc, out, err = _run([str(p), "--moe-ram-cache", "auto", "--json"], capsys)
    assert rc == 0, err
    f = engine_facts(p)
    recs = json.loads(out)["ram_traffic"]
    assert {r["ram_budget_bytes"] for r in recs} == {len(f.moe_layers) * f.n_expert * f.slot_bytes}, recs[0]


def test_info_refuses_a_bad_ram_budget(tmp_path, capsys):
    p = make_tiny_model(tmp_path / "m.gguf", "qwen3moe")
    rc, out, err = _run([str(p), "--moe-ram-cache", "lots"], capsys)
    assert rc == 1 and err.startswith("hybrimoe info: error:") and "lots" in err
    rc, out, err = _run([str(p), "--moe-ram-cache", "25%", "--disk", "floppy"], capsys)
    assert rc == 1 and "floppy" in err
