"""The engine's figures over HTTP: ``GET /moe/stats`` (JSON) and ``GET /metrics`` (Prometheus text format 0.0.4), read
from the served model's snapshot (:attr:`hybrimoe.server.model.ServedLlama.moe_snapshot`), never waiting for the model
lock."""
from __future__ import annotations

import math

import llama_cpp.server.app as lcp_app


def stats_json(state) -> dict:
    """``GET /moe/stats`` for ``state`` (:class:`hybrimoe.server.app.AppState`): ``model`` (its name), ``model_busy`` (a
    request holds the model lock now, read without taking it; with ``--parallel`` above 1, a request holds a slot),
    then :attr:`ServedLlama.moe_snapshot` (the figures as of the last decode; ``parallel``: the slots, None without
    ``--parallel``)."""
    snap = state.proxy.llm.moe_snapshot
    par = snap.get("parallel")
    # with --parallel the model lock is not taken: busy while a request holds a slot
    busy = par["active"] > 0 if par else lcp_app.llama_inner_lock.locked()
    return {"object": "moe.stats", "model": state.proxy.alias, "model_busy": busy, **snap}


def _label(value: str) -> str:
    # Prometheus text format: label values escape backslash, double quote and line feed
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics_text(state) -> str:
    """``GET /metrics``: the snapshot's figures in Prometheus' text format (0.0.4), labelled with the model.

    With ``--parallel`` above 1 also the slots, the slots busy, the requests waiting, the batched decodes by how
    many requests each carried (``sequences="<n>"``), and per slot (``slot="<id>"``) whether it is busy and its
    request's tokens.

    Counters (``_total``, since the server started): decodes, tokens decoded, cache accesses / hits / misses /
    evictions, experts run per side (``side="cpu"|"gpu"``, distinct experts per layer and ubatch), H2D bytes per
    kind (``kind="demand"|"prefetch"|"fill"``). Gauges: the model lock held, the hit rate, the mean seconds per MoE
    layer run, the GPU expert slots and their bytes; per device its slots, hit rate, experts run and bytes copied
    (``device="<index>", device_label="<label>"``). Engine figures only with ``--moe-cache`` or ``--moe-ram-cache``;
    with the RAM tier also its lookups, hits, hit rate, bytes read from the files per kind (``kind="demand"|
    "prefetch"``), reads in flight, seconds waited for reads and its slots (``ram_*``)."""
    snap = stats_json(state)
    model = f'model="{_label(state.proxy.alias)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP hybrimoe_{name} {help_text}")
        lines.append(f"# TYPE hybrimoe_{name} {kind}")
        for labels, value in samples:
            v = float(value)
            text = "NaN" if math.isnan(v) else repr(v) if not v.is_integer() else str(int(v))
            lines.append(f"hybrimoe_{name}{{{model}{labels}}} {text}")

    metric("decodes_total", "counter", "Model decodes (one per generated token, per batch of a prompt).",
           [("", snap["decodes"])])
    metric("tokens_decoded_total", "counter", "Tokens decoded (prompt and generated).", [("", snap["tokens_decoded"])])
    metric("model_busy", "gauge", "1 while a request holds the model.", [("", 1 if snap["model_busy"] else 0)])
    par = snap.get("parallel")
    if par:
        metric("slots", "gauge", "Sequences decoded together at most (--parallel).", [("", par["slots"])])
        metric("slots_busy", "gauge", "Requests holding a slot (prefilling or generating).", [("", par["active"])])
        metric("requests_waiting", "gauge", "Requests waiting for a slot.", [("", par["waiting"])])
        metric("batch_steps_total", "counter", "Batched decodes, by how many requests each carried.",
               [(f',sequences="{k}"', v) for k, v in par["sequences_per_step"].items()])
        metric("slot_busy", "gauge", "1 while a request holds the slot (prefilling or generating).",
               [(f',slot="{d["id"]}"', d["state"] != "idle") for d in par["per_slot"]])
        metric("slot_context_tokens", "gauge", "Tokens of the slot's request: prompt decoded and tokens generated "
               "(the last one enters the context at the next step).",
               [(f',slot="{d["id"]}"', d["n_prompt_tokens_processed"] + d["n_decoded"]) for d in par["per_slot"]])
    e = snap.get("engine")
    if e:
        c = e["cache"]
        metric("cache_accesses_total", "counter", "Activated experts looked up in the GPU expert cache.",
               [("", c["accesses"])])
        metric("cache_hits_total", "counter", "Activated experts resident on the GPU when their layer ran.",
               [("", c["hits"])])
        metric("cache_misses_total", "counter", "Activated experts not resident when their layer ran.",
               [("", c["misses"])])
        metric("cache_evictions_total", "counter", "Experts evicted from the GPU expert cache.", [("", c["evictions"])])
        metric("cache_hit_rate", "gauge", "Hits / accesses since the server started.", [("", e["hit_rate"])])
        metric("experts_total", "counter", "Experts run, distinct per MoE layer and ubatch, by side.",
               [(',side="cpu"', e["cpu_experts"]), (',side="gpu"', e["gpu_experts"])])
        metric("h2d_bytes_total", "counter", "Expert bytes copied host to device, by kind.",
               [(',kind="demand"', e["bytes_demand"]), (',kind="prefetch"', e["bytes_prefetch"]),
                (',kind="fill"', e["bytes_fill"])])
        metric("moe_layer_seconds", "gauge", "Mean seconds per MoE layer run (plan to GPU share done).",
               [("", e["layer_s"])])
        metric("gpu_expert_slots", "gauge", "Expert slots of the GPU expert cache.", [("", e["n_slots"])])
        metric("gpu_expert_slot_bytes", "gauge", "Bytes per expert slot.", [("", e["slot_bytes"])])
        devs = e.get("devices") or []
        if devs:
            def per(key):
                # the index keeps two devices of one label apart (two stand-ins of the same memory)
                return [(f',device="{i}",device_label="{_label(d["device"])}"', d[key]) for i, d in enumerate(devs)]

            metric("device_expert_slots", "gauge", "Expert slots of each device's cache.", per("n_slots"))
            metric("device_cache_hit_rate", "gauge", "Each device's cache: hits / accesses since the server started.",
                   per("hit_rate"))
            metric("device_experts_total", "counter", "Experts each device computed, distinct per MoE layer and "
                   "ubatch.", per("gpu_experts"))
            metric("device_h2d_bytes_total", "counter", "Expert bytes copied host to each device.",
                   per("bytes_copied"))
        r = e.get("ram")
        if r:
            metric("ram_accesses_total", "counter", "CPU-share experts looked up in the RAM tier.",
                   [("", r["accesses"])])
            metric("ram_hits_total", "counter", "CPU-share experts resident in RAM when their layer ran.",
                   [("", r["hits"])])
            metric("ram_hit_rate", "gauge", "RAM tier hits / accesses since the server started.", [("", r["hit_rate"])])
            metric("ram_read_bytes_total", "counter", "Expert bytes read from the model's files, by kind.",
                   [(',kind="demand"', r["bytes_demand"]), (',kind="prefetch"', r["bytes_prefetch"])])
            metric("ram_reads_in_flight", "gauge", "Expert reads queued or in flight.", [("", r["reads_in_flight"])])
            metric("ram_wait_seconds_total", "counter", "Seconds the engine waited for expert reads.",
                   [("", r["wait_s"])])
            metric("ram_expert_slots", "gauge", "Expert slots of the RAM tier.", [("", r["n_slots"])])
    return "\n".join(lines) + "\n"


def json_default(obj):
    """``json.dumps``' fallback for the engine's per-layer counters: numpy scalars and arrays as lists, else text."""
    # numpy scalars and arrays in the engine's per-layer counters
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)
