"""Cost-model JSON, hardware presets and cache budgets: round trips, derived values, clear errors."""
import json
import re
import struct

import pytest

from hybrimoe import _core
from hybrimoe import policy as pol
from hybrimoe.model.facts import MODEL_FACTS


def test_cost_model_json_roundtrip(tmp_path):
    cm = pol.cost_model_from_hardware(pol.load_hardware("rtx4090-desktop"), MODEL_FACTS["deepseek-v2-lite"])
    pol.save_cost_model(cm, tmp_path / "c.json", sources={"cpu_a_s": "test"})
    back = pol.load_cost_model(tmp_path / "c.json")
    for f in pol.COST_FIELDS:
        assert getattr(back, f) == getattr(cm, f)


def test_saved_numbers_read_back_bit_for_bit(tmp_path):
    """Values with no short decimal form (thirds, 0.1 + 0.2, the smallest subnormal, the largest double, -0.0)
    come back as the same doubles; the file is schema /4 with every field and the sources, sorted."""
    cm = _core.CostModel()
    cm.cpu_a_s, cm.cpu_b_s, cm.gpu_b_s = 1e-4 / 3, 0.1 + 0.2, 5e-324
    cm.h2d_bandwidth_Bps, cm.layer_b_s, cm.dense_a_s, cm.copy_overlap = 24.7e9, 1.7976931348623157e308, -0.0, 2 / 3
    sources = {"gpu_b_s": "caf\u00e9 \u2713", "cpu_a_s": 'measured "here"\n'}
    path = tmp_path / "c.json"
    pol.save_cost_model(cm, path, sources)
    back = pol.load_cost_model(path)
    for f in pol.COST_FIELDS:
        assert struct.pack("<d", getattr(back, f)) == struct.pack("<d", getattr(cm, f)), f
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert list(doc) == ["schema", *pol.COST_FIELDS, "sources"] and doc["schema"] == "hybrimoe.cost_model/4"
    assert list(doc["sources"].items()) == sorted(sources.items())
    assert pol.cost_model_to_dict(back, sources) == doc
    # no sources: no "sources" key
    pol.save_cost_model(cm, path)
    assert "sources" not in json.loads(path.read_text())


@pytest.mark.parametrize("text,msg", [
    ("{not json", r"is not valid JSON: .* \(line 1, column 2\)"),
    ('{"a": 1} x', r"is not valid JSON: Extra data \(line 1, column 10\)"),
    ("[1, 2]", "expected a JSON object, got array"),
    ('"x"', "expected a JSON object, got string"),
    (json.dumps({"schema": "x"}),
     "'schema' must be 'hybrimoe.cost_model/4' \\(or 'hybrimoe.cost_model/3', 'hybrimoe.cost_model/2', "
     "'hybrimoe.cost_model/1'\\), got "
     "\"x\""),
    (json.dumps({"cpu_a_s": 1}), "'schema' must be .* got nothing"),
    (json.dumps({"schema": 2}), "'schema' must be .* got number"),
    (json.dumps({"schema": pol.COST_MODEL_SCHEMA}), "missing field 'cpu_a_s'"),
])
def test_corrupt_cost_model(tmp_path, text, msg):
    (tmp_path / "c.json").write_text(text)
    with pytest.raises(pol.CostModelError, match=f"^cost model {re.escape(str(tmp_path / 'c.json'))}.*{msg}"):
        pol.load_cost_model(tmp_path / "c.json")


def _doc(**changes):
    """A valid schema /3 document with some keys changed."""
    return dict(pol.cost_model_to_dict(_core.CostModel()), **changes)


@pytest.mark.parametrize("doc,msg", [
    (_doc(cpu_b_s=float("nan")), "field 'cpu_b_s' must be a finite number >= 0, got NaN"),
    (_doc(gpu_a_s=float("inf")), "field 'gpu_a_s' must be a finite number >= 0, got Infinity"),
    (_doc(act_a_s=float("-inf")), "field 'act_a_s' must be a finite number >= 0, got -Infinity"),
    (_doc(gpu_b_s=-1), "field 'gpu_b_s' must be a finite number >= 0, got -1"),
    (_doc(layer_a_s=-1e-300), "field 'layer_a_s' must be a finite number >= 0, got -1e-300"),
    (_doc(cpu_b_s=True), "field 'cpu_b_s' must be a finite number >= 0, got boolean"),
    (_doc(dense_b_s="1.0"), "field 'dense_b_s' must be a finite number >= 0, got \"1.0\""),
    (_doc(h2d_latency_s=None), "field 'h2d_latency_s' must be a finite number >= 0, got null"),
    (_doc(cpu_a_s=[1.0]), "field 'cpu_a_s' must be a finite number >= 0, got array"),
    (_doc(cpu_startup_s=10 ** 400), "field 'cpu_startup_s' must be a finite number >= 0, got 1000"),
    (_doc(h2d_bandwidth_Bps=0), "field 'h2d_bandwidth_Bps' must be > 0"),
    (_doc(copy_overlap=1.5), "field 'copy_overlap' must be in \\[0, 1\\]"),
    (_doc(cpu_copy_overlap=1.5), "field 'cpu_copy_overlap' must be in \\[0, 1\\]"),
    (_doc(zz=1, aa=2), "unknown field\\(s\\) zz, aa"),
    (_doc(sources=[]), "'sources' must be an object of strings, got array"),
    (_doc(sources={"x": 1}), "sources\\['x'\\] must be a string"),
])
def test_each_bad_field_is_named(tmp_path, doc, msg):
    """Through a file (Python's json writes NaN / Infinity as bare literals: still read, then refused) and as a
    dict, with the file or the given name in the message."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(pol.CostModelError, match=f"^cost model {re.escape(str(path))}: {msg}"):
        pol.load_cost_model(path)
    with pytest.raises(pol.CostModelError, match=f"^where: {msg}"):
        pol.cost_model_from_dict(doc, "where")


def test_unreadable_and_unwritable_files_are_named(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(pol.CostModelError, match=f"cannot read cost model {re.escape(str(missing))}: No such file"):
        pol.load_cost_model(missing)
    (tmp_path / "latin1.json").write_bytes(b'{"schema": "caf\xe9"}')
    with pytest.raises(pol.CostModelError, match="latin1.json is not valid JSON: not UTF-8"):
        pol.load_cost_model(tmp_path / "latin1.json")
    out = tmp_path / "no-such-dir" / "c.json"
    with pytest.raises(pol.CostModelError, match=f"cannot write cost model {re.escape(str(out))}"):
        pol.save_cost_model(_core.CostModel(), out)
    cm = _core.CostModel()
    cm.gpu_a_s = float("nan")
    with pytest.raises(pol.CostModelError, match=f"cost model {re.escape(str(tmp_path))}/c.json: field 'gpu_a_s' is "
                                                 "not finite"):
        pol.save_cost_model(cm, tmp_path / "c.json")
    assert not (tmp_path / "c.json").exists()


def test_older_schemas_read_with_the_overlaps_they_lack_at_1():
    """Files of schema /2 (before cpu_copy_overlap) and /1 (before copy_overlap too) still load, the missing
    overlaps at 1 (copies beside compute, free for the CPU); /3 requires both, an older schema refuses a field it
    did not have, and both must lie in [0, 1]."""
    d = pol.cost_model_to_dict(_core.CostModel())
    assert d["schema"] == "hybrimoe.cost_model/4" and d["copy_overlap"] == 1.0 and d["cpu_copy_overlap"] == 1.0
    d["copy_overlap"], d["cpu_copy_overlap"] = 0.25, 0.5
    back = pol.cost_model_from_dict(d)
    assert (back.copy_overlap, back.cpu_copy_overlap) == (0.25, 0.5)
    d = {k: v for k, v in d.items() if k not in pol.DISK_FIELDS}
    d["schema"] = "hybrimoe.cost_model/3"
    v2 = dict({k: v for k, v in d.items() if k not in ("cpu_copy_overlap", "cpu_c_s")}, schema="hybrimoe.cost_model/2")
    back = pol.cost_model_from_dict(v2)
    assert (back.copy_overlap, back.cpu_copy_overlap) == (0.25, 1.0)
    assert pol.cost_model_from_dict(v2).cpu_c_s == 0.0
    v1 = dict({k: v for k, v in v2.items() if k != "copy_overlap"}, schema="hybrimoe.cost_model/1")
    back = pol.cost_model_from_dict(v1)
    assert (back.copy_overlap, back.cpu_copy_overlap) == (1.0, 1.0)
    with pytest.raises(ValueError, match="missing field 'cpu_c_s'"):
        pol.cost_model_from_dict(dict(v2, schema="hybrimoe.cost_model/3"))
    with pytest.raises(ValueError, match="missing field 'cpu_copy_overlap'"):
        pol.cost_model_from_dict(dict(v2, schema="hybrimoe.cost_model/3", cpu_c_s=0.0))
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


def test_disk_fields_since_schema_4():
    """Schema /4 carries the disk tier's figures; a /3 file reads as no disk figures (bandwidth 0, queue depth 1),
    refuses a disk field, and /4 requires them; a queue depth below 1 or a negative latency is refused in the file
    and by CostModel.validate."""
    cm = _core.CostModel()
    assert (cm.disk_bandwidth_Bps, cm.disk_latency_s, cm.disk_queue_depth, cm.has_disk) == (0.0, 0.0, 1.0, False)
    assert cm.disk_read(1e6) == float("inf")
    cm.disk_bandwidth_Bps, cm.disk_latency_s, cm.disk_queue_depth = 5e9, 1e-4, 4.0
    assert cm.has_disk and cm.disk_read(5e6) == pytest.approx(5e6 / 5e9 + 1e-4)
    d = pol.cost_model_to_dict(cm)
    back = pol.cost_model_from_dict(d)
    assert [getattr(back, f) for f in pol.DISK_FIELDS] == [5e9, 1e-4, 4.0]
    v3 = dict({k: v for k, v in d.items() if k not in pol.DISK_FIELDS}, schema="hybrimoe.cost_model/3")
    old = pol.cost_model_from_dict(v3)
    assert not old.has_disk and old.disk_queue_depth == 1.0 and old.cpu_a_s == cm.cpu_a_s
    with pytest.raises(ValueError, match="'disk_latency_s' is not in schema hybrimoe.cost_model/3"):
        pol.cost_model_from_dict(dict(v3, disk_latency_s=1e-4))
    with pytest.raises(ValueError, match="missing field 'disk_bandwidth_Bps'"):
        pol.cost_model_from_dict(dict(v3, schema="hybrimoe.cost_model/4"))
    with pytest.raises(ValueError, match="'disk_queue_depth' must be >= 1"):
        pol.cost_model_from_dict(dict(d, disk_queue_depth=0.5))
    with pytest.raises(ValueError, match="'disk_latency_s' must be a finite number >= 0"):
        pol.cost_model_from_dict(dict(d, disk_latency_s=-1.0))
    cm.disk_queue_depth = 0.0
    with pytest.raises(ValueError, match="disk_queue_depth must be >= 1"):
        cm.validate()


def test_disk_files_have_sources_and_set_the_cost_model(tmp_path):
    """The bundled disks (a PCIe 4.0 and a PCIe 5.0 NVMe SSD) load with a source per fact and set the cost
    model's disk fields; a hardware file carries the host's RAM (optional: files without it still load); bad disk
    files are refused naming the file and the fact."""
    assert set(pol.disk_names()) >= {"pcie4-nvme", "pcie5-nvme"}
    facts = MODEL_FACTS["deepseek-v2-lite"]
    hw = pol.load_hardware("rtx4090-desktop")
    assert hw.facts["host_memory_bytes"] == 64e9 and hw.sources["host_memory_bytes"].strip()
    assert not pol.cost_model_from_hardware(hw, facts).has_disk
    speeds = {}
    for name in pol.disk_names():
        disk = pol.load_disk(name)
        assert all(disk.sources[f].strip() for f in ("read_bandwidth_Bps", "read_latency_s", "queue_depth"))
        cm = pol.cost_model_from_hardware(hw, facts, disk)
        assert (cm.disk_bandwidth_Bps, cm.disk_latency_s, cm.disk_queue_depth) == (
            disk.facts["read_bandwidth_Bps"], disk.facts["read_latency_s"], disk.facts["queue_depth"])
        # an expert from disk costs more than over PCIe from RAM, which costs more than computing it on the CPU
        assert cm.disk_read(facts.expert_bytes) > cm.h2d(facts.expert_bytes) > cm.cpu(1)
        speeds[name] = cm.disk_read(facts.expert_bytes)
        assert pol.set_disk(cm, None).has_disk is False
    assert speeds["pcie5-nvme"] < speeds["pcie4-nvme"]
    d = json.loads((pol.HARDWARE_DIR / "h200.json").read_text())
    del d["facts"]["host_memory_bytes"]
    (tmp_path / "hw.json").write_text(json.dumps(d))
    assert "host_memory_bytes" not in pol.load_hardware(str(tmp_path / "hw.json")).facts
    with pytest.raises(ValueError, match="unknown disk 'nope' \\(known: pcie4-nvme, pcie5-nvme"):
        pol.load_disk("nope")
    d = json.loads((pol.hardware.DISK_DIR / "pcie4-nvme.json").read_text())
    d["facts"]["queue_depth"]["value"] = 0.5
    (tmp_path / "d.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="d.json: fact 'queue_depth' must be >= 1"):
        pol.load_disk(str(tmp_path / "d.json"))
    d["facts"].pop("read_latency_s")
    (tmp_path / "d.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="disk .*d.json: missing fact 'read_latency_s'"):
        pol.load_disk(str(tmp_path / "d.json"))
    (tmp_path / "h.json").write_text(json.dumps(dict(d, schema="hybrimoe.hardware/1")))
    with pytest.raises(ValueError, match="expected schema 'hybrimoe.disk/1'"):
        pol.load_disk(str(tmp_path / "h.json"))


def test_presets_have_sources_and_derive_sane_costs():
    facts = MODEL_FACTS["deepseek-v2-lite"]
    assert set(pol.hardware_names()) >= {"paper-a6000", "rtx4090-desktop", "h200"}
    for name in pol.hardware_names():
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
    with pytest.raises(ValueError, match="unknown hardware preset 'nope' .*no such file either"):
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
    assert pol.parse_budget("1.5TB", total, one) == 1.5e12 and pol.parse_budget("1TiB", total, one) == 1024 ** 4
    assert pol.parse_budget("2t", total, one) == 2e12
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


def test_a_document_written_by_hand_reads(tmp_path):
    """Compact JSON, integers for floats, keys in any order, schema /1: what a user may write."""
    cm = pol.cost_model_from_hardware(pol.load_hardware("paper-a6000"), MODEL_FACTS["deepseek-v2-lite"])
    d = pol.cost_model_to_dict(cm)
    d["cpu_startup_s"] = 0
    d.pop("copy_overlap")
    d.pop("cpu_copy_overlap")
    d.pop("cpu_c_s")
    for f in pol.DISK_FIELDS:
        d.pop(f)
    d["schema"] = "hybrimoe.cost_model/1"
    (tmp_path / "p.json").write_text(json.dumps(dict(reversed(list(d.items()))), separators=(",", ":")))
    back = pol.load_cost_model(tmp_path / "p.json")
    assert back.cpu_startup_s == 0.0 and back.copy_overlap == 1.0 and back.cpu_copy_overlap == 1.0
    # the fields a /1 document lacks read as their defaults; the preset's own cpu_copy_overlap is below 1
    assert cm.cpu_copy_overlap < 1.0
    assert all(getattr(back, f) == getattr(cm, f) for f in pol.COST_FIELDS
               if f not in ("cpu_startup_s", "copy_overlap", "cpu_copy_overlap", "cpu_c_s"))


def test_the_policy_core_has_no_json_of_its_own():
    """hybrimoe.policy is the one reader and writer; the C++ core only holds a CostModel (and validates it)."""
    assert not [n for n in dir(_core) if "json" in n.lower() or n.endswith("_cost_model") or "SCHEMA" in n]
    cm = _core.CostModel()
    cm.copy_overlap = 1.5
    with pytest.raises(ValueError, match="CostModel.copy_overlap must be in"):
        cm.validate()


def test_cpu_expert_cost_pays_the_small_row_term_up_to_its_knee():
    """cpu(n) = a + b*n + c*min(n, CPU_SMALL_ROWS): the first rows of an expert (row-by-row kernels) cost c more."""
    cm = _core.CostModel()
    cm.cpu_a_s, cm.cpu_b_s, cm.cpu_c_s = 1.0, 0.5, 0.25
    knee = _core.CPU_SMALL_ROWS
    assert knee == 8
    assert cm.cpu(1) == pytest.approx(1.0 + 0.5 + 0.25)
    assert cm.cpu(knee) == pytest.approx(1.0 + 0.5 * knee + 0.25 * knee)
    assert cm.cpu(100) == pytest.approx(1.0 + 0.5 * 100 + 0.25 * knee)
