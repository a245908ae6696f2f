"""Cost-model JSON, hardware presets and cache budgets: round trips, derived values, clear errors."""
import json

import pytest

from hybrimoe import _core
from hybrimoe import policy as pol
from hybrimoe.trace import MODEL_FACTS


def test_cost_model_json_roundtrip(tmp_path):
    cm = pol.cost_model_from_hardware(pol.load_hardware("rtx4090-desktop"), MODEL_FACTS["deepseek-v2-lite"])
    pol.save_cost_model(cm, tmp_path / "c.json", sources={"cpu_a_s": "test"})
    back = pol.load_cost_model(tmp_path / "c.json")
    for f in pol.COST_FIELDS:
        assert getattr(back, f) == getattr(cm, f)


@pytest.mark.parametrize("text,msg", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"schema": "x"}), "'schema' must be"),
    (json.dumps({"schema": pol.COST_MODEL_SCHEMA}), "missing field 'cpu_a_s'"),
])
def test_corrupt_cost_model(tmp_path, text, msg):
    (tmp_path / "c.json").write_text(text)
    with pytest.raises(pol.CostModelError, match=msg):
        pol.load_cost_model(tmp_path / "c.json")


def test_cost_model_bad_values(tmp_path):
    d = pol.cost_model_to_dict(_core.CostModel())
    d["gpu_b_s"] = -1
    with pytest.raises(ValueError, match="'gpu_b_s' must be a finite number >= 0"):
        pol.cost_model_from_dict(d)
    d["gpu_b_s"] = 0
    d["extra"] = 1
    with pytest.raises(ValueError, match="unknown field"):
        pol.cost_model_from_dict(d)


def test_presets_have_sources_and_derive_sane_costs():
    facts = MODEL_FACTS["deepseek-v2-lite"]
    assert set(pol.preset_names()) >= {"paper-a6000", "rtx4090-desktop", "h200"}
    for name in pol.preset_names():
        hw = pol.load_hardware(name)
        assert all(hw.sources[f].strip() for f in pol.HARDWARE_FACTS)
        cm = pol.cost_model_from_hardware(hw, facts)
        # hand check of the CPU decode cost: bytes / (bandwidth * efficiency)
        want = facts.expert_bytes / (hw.facts["cpu_mem_bandwidth_Bps"] * hw.facts["cpu_mem_efficiency"])
        assert cm.cpu_a_s == pytest.approx(want)
        assert cm.h2d(facts.expert_bytes) == pytest.approx(facts.expert_bytes / hw.facts["h2d_bandwidth_Bps"]
                                                           + hw.facts["h2d_latency_s"])
        assert cm.gpu(1) < cm.cpu(1) < cm.h2d(facts.expert_bytes)  # decode: copying an expert costs most


def test_bad_preset(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware preset 'nope'"):
        pol.load_hardware("nope")
    d = json.loads((pol.PRESET_DIR / "h200.json").read_text())
    d["facts"]["h2d_latency_s"].pop("source")
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="'h2d_latency_s' has no source"):
        pol.load_hardware(str(tmp_path / "p.json"))
    (tmp_path / "q.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        pol.load_hardware(str(tmp_path / "q.json"))


def test_budgets():
    total, one = 100e6, 6e6
    assert pol.parse_budget("25%", total, one) == pytest.approx(25e6)
    assert pol.parse_budget("0", total, one) == 0.0
    assert pol.parse_budget("0%", total, one) == 0.0
    assert pol.parse_budget("1GiB", total, one) == 1024 ** 3
    assert pol.parse_budget(7e6, total, one) == 7e6
    with pytest.raises(ValueError, match="negative"):
        pol.parse_budget(-1, total, one)
    with pytest.raises(ValueError, match="within 0..100"):
        pol.parse_budget("-5%", total, one)
    with pytest.raises(ValueError, match="smaller than one expert"):
        pol.parse_budget("5MB", total, one)
    with pytest.raises(ValueError, match="cannot parse"):
        pol.parse_budget("lots", total, one)


def test_unknown_system_preset():
    with pytest.raises(ValueError, match="unknown policy preset 'fast'"):
        pol.system_preset("fast")
