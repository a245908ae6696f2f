"""The statistics of hybrimoe's MoE hook and engine as :meth:`hybrimoe.Llama.moe_stats` returns them."""
from __future__ import annotations

from hybrimoe import _core


def layer_totals(layers: list) -> dict:
    """Sums of the engine's per-MoE-layer counters (``Engine.layer_stats()``) over the layers, plus
    ``bytes_copied`` (demand + prefetch + fill H2D bytes)."""
    tot = {k: sum(s[k] for s in layers) for k in (layers[0] if layers else {})}
    tot["bytes_copied"] = sum(tot.get(k, 0.0) for k in ("bytes_demand", "bytes_prefetch", "bytes_fill"))
    return tot


def hook_stats(hook) -> dict:
    """The hook's part of ``moe_stats()``: per model layer, plan-node runs, tokens and hook calls; the layers left on
    upstream's path (``unsupported``) or on the CPU-only path (``engine_skipped``) with the reason."""
    return {
        "runs": list(hook.runs()),
        "tokens": list(hook.tokens()),
        "hook_calls": list(hook.hook_calls()),
        "unsupported": [{"layer": il, "reason": why} for il, why in hook.unsupported()],
        "engine_skipped": [{"layer": il, "reason": why} for il, why in hook.engine_skipped()],
    }


def engine_stats(engine, setup) -> dict:
    """The engine's part of ``moe_stats()`` (``"engine"``): the set-up's choices (policy, cost model, cache size,
    profile), the slot pool, the cache's counters and the per-MoE-layer counters summed (see
    :meth:`hybrimoe.Llama.moe_stats`). ``engine``: ``hybrimoe._engine.Engine``; ``setup``:
    :class:`hybrimoe.runtime.setup.EngineSetup`."""
    layers = engine.layer_stats()
    tot = layer_totals(layers)
    devices = device_stats(engine, setup, layers)
    cs = _cache_counts([setup.policies.cache] + [d.policies.cache for d in setup.more_devices])
    return {
        "policy": setup.policies.name,
        "cost_model": setup.cost_source,
        "moe_cache": setup.slots_note,
        "profile": setup.profile_source,
        "n_slots": engine.n_slots,
        "slot_bytes": engine.slot_bytes,
        "slot_buffers": engine.slot_buffers,
        "hit_rate": cs["hits"] / cs["accesses"] if cs["accesses"] else 0.0,
        "cache": cs,
        **{k: tot[k] for k in ("cpu_experts", "cpu_late_experts", "gpu_experts", "bytes_demand", "bytes_prefetch",
                               "bytes_fill",
                               "bytes_copied")},
        "layer_s": tot["layer_s"] / tot["runs"] if tot["runs"] else 0.0,
        "all_cpu_reason": all_cpu_reason(engine.n_slots, tot, setup),
        "failed": engine.failed,
        # per MoE layer, whether the CPU share reads its (gate or gate_up, up, down) matrices repacked
        "repacked": [list(r) for r in engine.repacked()],
        # per MoE layer: the largest ubatch whose CPU share runs as one fused op, "any" for every size, None where
        # it does not (moe_cpu_fused off, or experts it does not fuse)
        "fused": [None if n < 0 else "any" if n >= 2 ** 62 else int(n) for n in engine.fused_max_tokens()],
        "fused_mode": {0: "off", 1: "exact", 2: "fast"}[setup.cpu_fused],
        "layers": layers,
        "ram": ram_stats(engine, setup),
        "devices": devices,
        "predictor": predictor_stats(setup.policies.cache.policy),
    }


def predictor_stats(policy) -> dict:
    """``moe_stats()["engine"]["predictor"]`` (and the RAM tier's ``"predictor"``): the state of a
    :class:`hybrimoe.policy.ReusePolicy` cache (``{}`` for any other policy; with several GPUs the first device's,
    each device's cache learning on its own layers): ``samples`` learned from, their mean
    ``log_loss`` (nats) and ``brier`` score, each prediction scored before it was learned from (progressive
    validation), ``positive_rate`` (the share of samples used within the horizon: a constant predictor of it scores
    that rate's entropy), ``horizon`` (visits of a layer), ``weights`` (bias first; features as
    docs/design.md §4 lists them) and ``bytes_per_layer`` (its state)."""
    if not isinstance(policy, _core.ReusePolicy):
        return {}
    return {"samples": policy.samples, "log_loss": policy.log_loss, "brier": policy.brier,
            "positive_rate": policy.positive_rate, "horizon": policy.horizon, "weights": policy.weights(),
            "bytes_per_layer": policy.bytes_per_layer}


def _cache_counts(caches) -> dict:
    """The counters of one or more ``ExpertCache`` objects, summed (one per device)."""
    out = {"accesses": 0, "hits": 0, "prefetch_hits": 0, "misses": 0, "admissions": 0, "evictions": 0, "declined": 0}
    for c in caches:
        cs = c.stats
        for k, v in (("accesses", cs.accesses), ("hits", cs.demand_hits + cs.prefetch_hits),
                     ("prefetch_hits", cs.prefetch_hits), ("misses", cs.misses), ("admissions", cs.admissions),
                     ("evictions", cs.evictions), ("declined", cs.declined)):
            out[k] += int(v)
    return out


def device_stats(engine, setup, layers: list) -> list:
    """``moe_stats()["engine"]["devices"]``: per device that holds expert slots, in device order: ``device`` (its
    label), ``n_slots``, ``slots_in_use``, ``moe_layers`` (the MoE layers whose GPU share it runs; of those,
    ``host_moe_layers`` are the ones llama.cpp left on the host, ``-ngl`` below the layer count), ``hit_rate`` and
    ``cache`` (its cache's counters), ``gpu_experts`` (experts it computed, summed over runs), ``bytes_copied``
    (H2D bytes of its loads) and ``cost_model`` (where its planner's costs came from). One entry with one device;
    the top-level figures are the totals."""
    shares = ([(setup.device_label, setup.policies, setup.cost_source)] +
              [(d.label, d.policies, d.cost_source) for d in setup.more_devices])
    out = []
    for i, (label, pol, cost_source) in enumerate(shares):
        mine = [ml for ml in range(len(layers)) if engine.device_of(ml) == i]
        tot = layer_totals([layers[ml] for ml in mine])
        cs = _cache_counts([pol.cache])
        out.append({
            "device": label,
            "n_slots": engine.device_slots(i),
            "slots_in_use": engine.device_slots_in_use(i),
            "moe_layers": mine,
            "host_moe_layers": [ml for ml in mine if ml in setup.host_layers],
            "hit_rate": cs["hits"] / cs["accesses"] if cs["accesses"] else 0.0,
            "cache": cs,
            "gpu_experts": int(tot.get("gpu_experts", 0)),
            "bytes_copied": float(engine.device_bytes_copied(i)),
            "cost_model": cost_source,
        })
    return out


def all_cpu_reason(n_slots: int, totals: dict, setup) -> str:
    """Why a GPU cache held nothing: "" unless the engine has slots (``n_slots``), ran experts (``totals``, the summed
    layer counters) and put none of them on the device, and the planner's cost model (``setup.cost``) prices an
    expert copied to the device and computed there above the same expert on the CPU. Then one sentence with those
    figures (one token, an expert of the model's mean size), e.g. on the RPC stand-in, whose copies cross a socket.
    """
    cost = setup.cost
    if n_slots <= 0 or totals.get("gpu_experts", 0) > 0 or totals.get("cpu_experts", 0) <= 0 or cost is None:
        return ""
    facts = setup.facts
    n = facts.n_expert * len(facts.moe_layers)
    expert = facts.total_expert_bytes / n if n else 0.0
    cpu, copy, gpu = cost.cpu(1), cost.h2d(expert), cost.gpu(1)
    if copy + gpu <= cpu:
        return ""
    return (f"the planner put every expert on the CPU: by its cost model the device takes {copy * 1e6:.0f} us to "
            f"copy an expert of {expert / 2**10:.1f} KiB in and {gpu * 1e6:.0f} us to compute it, the CPU "
            f"{cpu * 1e6:.0f} us; a GPU cache pays off where copies are faster (--moe-cost-model names other costs)")


def ram_stats(engine, setup) -> dict:
    """The RAM tier's part of ``moe_stats()["engine"]`` (``"ram"``; ``{}`` without ``moe_ram_cache``): the budget
    (``moe_ram_cache``: how the slots were chosen), ``n_slots`` and ``slot_bytes`` (bytes), ``hit_rate`` (RAM hits
    over lookups of the CPU share's experts), ``hits``, ``misses``, ``late`` (hits still being read: a prefetch in
    flight), ``bytes_demand`` / ``bytes_prefetch`` / ``bytes_read`` (file bytes read, on demand, ahead, both),
    ``demand_reads`` / ``prefetch_reads`` (experts read), ``prefetch_accuracy`` (prefetched experts used at their
    layer over those read ahead), ``reads_in_flight`` and ``pinned`` (RAM slots a read, a layer, a read ahead or a GPU
    copy holds; both now), ``buffers`` (host buffers the RAM slots are split over: the host buffer type's cap, or
    ``$HYBRIMOE_MAX_BUFFER_BYTES``), ``preads`` (system calls), ``direct_matrices`` (expert
    matrices read with O_DIRECT; the others were buffered reads), ``in_place_matrices`` (of those, read straight
    into their RAM slot: no staging buffer and no copy; the others' tensors have experts of a size that is not a
    multiple of 4 KiB, or the slots are repacked), ``evictions``, ``given_up`` and ``demotions``
    (``moe_ram_exclusive``: RAM slots given up by experts on the GPU, and GPU evictions copied back into RAM),
    ``exclusive`` (whether the tiers are exclusive), ``wait_s`` (seconds the engine waited
    for reads), ``policy`` (the RAM cache policy's name), ``read_ahead`` (the reads ahead judged at their layer,
    as ``[judged, used]`` counts over the recent reads, which the tier reads ahead by, not cleared by
    ``reset_stats``: ``"one"`` per distance 1, 2, 3+ for ubatches of one sequence's decode, ``"several"`` per
    distance and then per sampled tokens that predicted the expert, 1, 2, 3+, for ubatches of several sequences or
    a short prompt's tail, whose uniform prior of an expert's use is at least one half and below a prefill's 0.95;
    docs/design.md §18)."""
    st = engine.ram_stats()
    if not st:
        return {}
    acc = st["accesses"]
    return {
        "moe_ram_cache": setup.ram_note,
        "policy": setup.ram_policy.name() if setup.ram_policy is not None else "",
        "n_slots": engine.ram_slots,
        "slot_bytes": engine.ram_slot_bytes,
        "hit_rate": st["hits"] / acc if acc else 0.0,
        **{k: st[k] for k in ("accesses", "hits", "misses", "late", "demand_reads", "prefetch_reads", "bytes_demand",
                              "bytes_prefetch", "reads_in_flight", "pinned", "buffers", "preads", "direct_matrices",
                              "in_place_matrices", "evictions", "wait_s", "given_up", "demotions")},
        "exclusive": bool(getattr(setup, "ram_exclusive", False)),
        "predictor": predictor_stats(setup.ram_policy),
        "bytes_read": st["bytes_demand"] + st["bytes_prefetch"],
        "prefetch_accuracy": st["prefetch_used"] / st["prefetch_reads"] if st["prefetch_reads"] else 0.0,
        "read_ahead": _read_ahead_cells(st["ahead_cells"]),
    }


def _read_ahead_cells(cells) -> dict:
    """``RamTier::ahead_counts``' cells (3 one-sequence cells, then 3 x 3 several-sequence ones) as nested lists."""
    pairs = [[int(j), int(u)] for j, u in cells]
    return {"one": pairs[:3], "several": [pairs[3 + 3 * d:6 + 3 * d] for d in range(3)]}
