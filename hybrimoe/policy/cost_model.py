"""The planner's cost model file format (HybriMoE §IV.B's cost model, as JSON).

Cost model JSON, schema ``hybrimoe.cost_model/4`` (all times in seconds, bandwidth in bytes/s; ``/3`` files, without
the disk fields, read with no disk figures (bandwidth 0, latency 0, queue depth 1); ``/2`` files, without
``cpu_copy_overlap`` and ``cpu_c_s`` either, read with 1 and 0; ``/1`` files, without ``copy_overlap`` either, read
with it 1)::

    {"schema": "hybrimoe.cost_model/4",
     "cpu_a_s": float, "cpu_b_s": float, "cpu_c_s": float,         # CPU expert: a + b*n + c*min(n, 8) (n tokens)
     "cpu_startup_s": float,                                        # (+ start-up once per layer)
     "gpu_a_s": float, "gpu_b_s": float,                            # GPU expert: a + b*tokens
     "h2d_bandwidth_Bps": float, "h2d_latency_s": float,            # copy: bytes/bandwidth + latency
     "act_a_s": float, "act_b_s": float,                            # activation round trip of a GPU share
     "layer_a_s": float, "layer_b_s": float,                        # non-expert work of a MoE layer
     "dense_a_s": float, "dense_b_s": float,                        # a dense layer
     "copy_overlap": float,                                         # 0..1: device computes while it copies
     "cpu_copy_overlap": float,                                     # 0..1: host CPU share runs while it copies
     "disk_bandwidth_Bps": float, "disk_latency_s": float,          # disk read: bytes/bandwidth + latency (0: none)
     "disk_queue_depth": float,                                     # >= 1: reads in flight that share the bandwidth
     "sources": {field: str, ...}}                                  # optional: where each number comes from

Every listed number is required, finite and >= 0 (link bandwidth > 0, the overlaps <= 1, the disk queue depth >= 1);
unknown keys are errors; NaN and Infinity (which Python's json reads and writes) are reported as bad values.
``copy_overlap``: the share of a host-to-device copy's time during which the device still computes (1: a GPU's copy
engine runs beside compute; 0: the device does one thing at a time, as the RPC stand-in does). ``cpu_copy_overlap``:
the share of a copy's time during which the host's CPU share still runs at full speed (1: copies cost the CPU
nothing; 0: the copies issued for a layer delay its CPU share by their whole time; between: host-memory contention).
The disk fields describe the tier below host RAM (the model file's disk, for models larger than RAM); a disk
bandwidth of 0 says none is known. This module is the only reader and writer of these files
(:func:`load_cost_model`, :func:`save_cost_model`, :func:`cost_model_from_dict`, :func:`cost_model_to_dict`); the
engine and the simulator are handed the resulting ``CostModel`` object.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional, Union

from hybrimoe import _core

COST_MODEL_SCHEMA = "hybrimoe.cost_model/4"         # written
COST_MODEL_SCHEMA_V3 = "hybrimoe.cost_model/3"      # still read: no disk fields (read as no disk figures)
COST_MODEL_SCHEMA_V2 = "hybrimoe.cost_model/2"      # still read: no cpu_copy_overlap (read as 1), no cpu_c_s (0)
COST_MODEL_SCHEMA_V1 = "hybrimoe.cost_model/1"      # still read: no copy_overlap either (both read as 1)
COST_MODEL_SCHEMAS = (COST_MODEL_SCHEMA, COST_MODEL_SCHEMA_V3, COST_MODEL_SCHEMA_V2, COST_MODEL_SCHEMA_V1)  # read
#: the schema version each field first appeared in (an older document reads CostModel's default for it: overlaps
#: 1, cpu_c_s 0, no disk figures)
_FIELD_SINCE = {"copy_overlap": 2, "cpu_copy_overlap": 3, "cpu_c_s": 3, "disk_bandwidth_Bps": 4, "disk_latency_s": 4,
                "disk_queue_depth": 4}
#: the disk tier's fields (CostModel.disk_read; 0 bandwidth: no disk figures)
DISK_FIELDS = ("disk_bandwidth_Bps", "disk_latency_s", "disk_queue_depth")
COST_FIELDS = ("cpu_a_s", "cpu_b_s", "cpu_c_s", "cpu_startup_s", "gpu_a_s", "gpu_b_s", "h2d_bandwidth_Bps",
               "h2d_latency_s", "act_a_s", "act_b_s", "layer_a_s", "layer_b_s", "dense_a_s", "dense_b_s",
               "copy_overlap", "cpu_copy_overlap") + DISK_FIELDS


class CostModelError(ValueError):
    """A cost-model or hardware-preset file that cannot be used (names the file and the problem)."""


def _json_type(v) -> str:
    """JSON's name for the type of a parsed value (a Python type name for what JSON cannot hold)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (list, tuple)):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _shown(v) -> str:
    """A bad value as an error message shows it: a number as JSON writes it (NaN, Infinity), a string quoted, else
    its JSON type."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    return _json_type(v)


def _cost_model_and_sources(doc, where: str) -> tuple["_core.CostModel", dict]:
    """(CostModel, sources) of a parsed cost-model document; raises CostModelError naming ``where`` and the field."""
    if not isinstance(doc, dict):
        raise CostModelError(f"{where}: expected a JSON object, got {_json_type(doc)}")
    schema = doc.get("schema")
    if schema not in COST_MODEL_SCHEMAS:
        got = "nothing" if "schema" not in doc else _shown(schema) if isinstance(schema, str) else _json_type(schema)
        older = "', '".join(COST_MODEL_SCHEMAS[1:])
        raise CostModelError(f"{where}: 'schema' must be '{COST_MODEL_SCHEMA}' (or '{older}'), got {got}")
    version = len(COST_MODEL_SCHEMAS) - COST_MODEL_SCHEMAS.index(schema)
    unknown = [str(k) for k in doc if k not in ("schema", "sources", *COST_FIELDS)]
    if unknown:
        raise CostModelError(f"{where}: unknown field(s) {', '.join(unknown)}")
    cm = _core.CostModel()
    for f in COST_FIELDS:
        if _FIELD_SINCE.get(f, 1) > version:
            if f in doc:
                raise CostModelError(f"{where}: field '{f}' is not in schema {schema}")
            continue  # an older schema: CostModel's default (overlaps 1, c 0, no disk figures)
        if f not in doc:
            raise CostModelError(f"{where}: missing field '{f}'")
        v = doc[f]
        try:
            x = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
        except OverflowError:  # an integer beyond the float range
            x = math.inf
        if not (math.isfinite(x) and x >= 0.0):
            raise CostModelError(f"{where}: field '{f}' must be a finite number >= 0, got {_shown(v)}")
        setattr(cm, f, x)
    if cm.h2d_bandwidth_Bps <= 0.0:
        raise CostModelError(f"{where}: field 'h2d_bandwidth_Bps' must be > 0")
    for f in ("copy_overlap", "cpu_copy_overlap"):
        if getattr(cm, f) > 1.0:
            raise CostModelError(f"{where}: field '{f}' must be in [0, 1]")
    if cm.disk_queue_depth < 1.0:
        raise CostModelError(f"{where}: field 'disk_queue_depth' must be >= 1 (reads in flight at once)")
    sources = doc.get("sources", {})
    if not isinstance(sources, dict):
        raise CostModelError(f"{where}: 'sources' must be an object of strings, got {_json_type(sources)}")
    for k, v in sources.items():
        if not isinstance(v, str):
            raise CostModelError(f"{where}: sources['{k}'] must be a string")
    try:
        cm.validate()  # the C++ rules the engine and the simulator hold a CostModel to
    except ValueError as e:
        raise CostModelError(f"{where}: {e}") from e
    return cm, dict(sources)


def cost_model_from_dict(d: dict, where: str = "cost model") -> "_core.CostModel":
    """CostModel from a ``hybrimoe.cost_model/4`` (or ``/3``, ``/2``, ``/1``) dict, as :func:`json.load` gives it.

    Raises:
        CostModelError: not a dict, wrong schema, or a missing, unknown or bad field (named, with ``where``).
    """
    return _cost_model_and_sources(d, where)[0]


def cost_model_to_dict(cm: "_core.CostModel", sources: Optional[dict] = None,
                       where: str = "cost model") -> dict:
    """The ``hybrimoe.cost_model/4`` dict of a CostModel: the schema, every field as a float, and ``"sources"``
    (str -> str, sorted by field) when given and not empty.

    Raises:
        CostModelError: a field is not finite (named, with ``where``): JSON has no such number.
    """
    d: dict = {"schema": COST_MODEL_SCHEMA}
    for f in COST_FIELDS:
        x = float(getattr(cm, f))
        if not math.isfinite(x):
            raise CostModelError(f"{where}: field '{f}' is not finite ({_shown(x)}) and cannot be written")
        d[f] = x
    src = _sources_map(sources)
    if src:
        d["sources"] = dict(sorted(src.items()))
    return d


def _sources_map(sources: Optional[dict]) -> dict:
    """``sources`` as the str -> str map the schema stores."""
    return {str(k): str(v) for k, v in (sources or {}).items()}


def load_cost_model(path: Union[str, os.PathLike]) -> "_core.CostModel":
    """Reads a cost-model JSON file (UTF-8).

    Raises:
        CostModelError (a ValueError), naming the path: unreadable file, not JSON (with line and column), or a
        document :func:`cost_model_from_dict` refuses.
    """
    p = os.fspath(path)
    where = f"cost model {p}"
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise CostModelError(f"cannot read cost model {p}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise CostModelError(f"{where} is not valid JSON: not UTF-8 text (byte {e.start})") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CostModelError(f"{where} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from e
    except RecursionError as e:
        raise CostModelError(f"{where} is not valid JSON: nesting too deep") from e
    return _cost_model_and_sources(doc, where)[0]


def save_cost_model(cm: "_core.CostModel", path: Union[str, os.PathLike], sources: Optional[dict] = None) -> None:
    """Writes a cost-model JSON file (schema above, UTF-8, indented). Numbers are written as Python's ``repr`` of
    the float, the shortest text that reads back to the same double, so a saved model loads bit for bit.

    Raises:
        CostModelError, naming the path: a field is not finite, or the file cannot be written.
    """
    p = os.fspath(path)
    text = json.dumps(cost_model_to_dict(cm, sources, where=f"cost model {p}"), indent=2, ensure_ascii=False,
                      allow_nan=False) + "\n"
    try:
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise CostModelError(f"cannot write cost model {p}: {e.strerror or e}") from e
