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


def test_older_schemas_read_with_the_overlaps_they_lack_at_1():
    """Files of schema /2 (before cpu_copy_overlap) and /1 (before copy_overlap too) still load, the missing
    overlaps at 1 (copies beside compute, free for the CPU); /3 requires both, an older schema refuses a field it
    did not have, and both must lie in [0, 1]."""
    d = pol.cost_model_to_dict(_core.CostModel())
    assert d["schema"] == "hybrimoe.cost_model/3" and d["copy_overlap"] == 1.0 and d["cpu_copy_overlap"] == 1.0
    d["copy_overlap"], d["cpu_copy_overlap"] = 0.25, 0.5
    back = pol.cost_model_from_dict(d)
    assert (back.copy_overlap, back.cpu_copy_overlap) == (0.25, 0.5)
    v2 = dict({k: v for k, v in d.items() if k != "cpu_copy_overlap"}, schema="hybrimoe.cost_model/2")
    back = pol.cost_model_from_dict(v2)
    assert (back.copy_overlap, back.cpu_copy_overlap) == (0.25, 1.0)
    v1 = dict({k: v for k, v in v2.items() if k != "copy_overlap"}, schema="hybrimoe.cost_model/1")
    back = pol.cost_model_from_dict(v1)
    assert (back.copy_overlap, back.cpu_copy_overlap) == (1.0, 1.0)
    with pytest.raises(ValueError, match="missing field 'cpu_copy_overlap'"):
        pol.cost_model_from_dict(dict(v2, schema="hybrimoe.cost_model/3"))
    with pytest.raises(ValueError, match="missing field 'copy_overlap'"):
        pol.cost_model_from_dict(dict(v1, schema="hybrimoe.cost_model/2"))
    with pytest.raises(ValueError, match="'copy_overlap' is not in schema hybrimoe.cost_model/1"):
        pol.cost_model_from_dict(dict(v1, copy_overlap=0.5))
    with pytest.raises(ValueError, match="'cpu_copy_overlap' is not in schema hybrimoe.cost_model/2"):
        pol.cost_model_from_dict(dict(v2, cpu_copy_overlap=0.5))
    with pytest.raises(ValueError, match="copy_overlap' must be in \\[0, 1\\]"):
        pol.cost_model_from_dict(dict(d, copy_overlap=1.5))
    with pytest.raises(ValueError, match="cpu_copy_overlap' must be in \\[0, 1\\]"):
        pol.cost_model_from_dict(dict(d, cpu_copy_overlap=1.5))


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


def test_cpp_json_reader_writer(tmp_path):
    """The C++ reader/writer (used by the engine without Python): exact round trip, sources, clear errors."""
    cm = _core.CostModel()
    cm.cpu_a_s, cm.gpu_b_s, cm.h2d_bandwidth_Bps = 1e-4 / 3, 0.1 + 0.2, 24.7e9
    _core.save_cost_model(cm, str(tmp_path / "c.json"), {"cpu_a_s": 'measured "here"\n'})
    back, sources = _core.load_cost_model(str(tmp_path / "c.json"))
    assert (back.cpu_a_s, back.gpu_b_s, back.h2d_bandwidth_Bps) == (cm.cpu_a_s, cm.gpu_b_s, cm.h2d_bandwidth_Bps)
    assert sources == {"cpu_a_s": 'measured "here"\n'}
    # Python's json reads the C++ document, and the C++ reader reads Python's (escapes, exponents, ints).
    d = json.loads((tmp_path / "c.json").read_text())
    assert d["schema"] == _core.COST_MODEL_SCHEMA and d["cpu_a_s"] == cm.cpu_a_s
    d["sources"] = {"gpu_a_s": "caf\u00e9 \u2713"}
    d["gpu_a_s"] = 2
    again, src = _core.cost_model_from_json(json.dumps(d))
    assert again.gpu_a_s == 2.0 and src == {"gpu_a_s": "caf\u00e9 \u2713"}
    for text, msg in [
        ('{"schema": "hybrimoe.cost_model/1",', "not valid JSON"),
        ('{"a": 1} x', "not valid JSON"),
        ('"x"', "expected a JSON object, got string"),
        (json.dumps({**d, "cpu_b_s": float("nan")}), "'cpu_b_s' must be a finite number >= 0, got NaN"),
        (json.dumps({**d, "cpu_b_s": True}), "'cpu_b_s' must be a finite number >= 0, got boolean"),
        (json.dumps({**d, "h2d_bandwidth_Bps": 0}), "'h2d_bandwidth_Bps' must be > 0"),
        (json.dumps({**d, "zz": 1, "aa": 2}), r"unknown field\(s\) zz, aa"),
        (json.dumps({**d, "sources": {"x": 1}}), r"sources\['x'\] must be a string"),
    ]:
        with pytest.raises(ValueError, match=msg):
            _core.cost_model_from_json(text, "t.json")
    with pytest.raises(ValueError, match="cannot read cost model"):
        _core.load_cost_model(str(tmp_path / "missing.json"))
    with pytest.raises(pol.CostModelError, match="cannot read cost model"):
        pol.load_cost_model(tmp_path / "missing.json")


def test_bundled_cost_model_presets_read_the_same_in_cpp_and_python(tmp_path):
    cm = pol.cost_model_from_hardware(pol.load_hardware("paper-a6000"), MODEL_FACTS["deepseek-v2-lite"])
    (tmp_path / "p.json").write_text(json.dumps(pol.cost_model_to_dict(cm)))  # written by Python's json
    back = pol.load_cost_model(tmp_path / "p.json")
    assert all(getattr(back, f) == getattr(cm, f) for f in pol.COST_FIELDS)
