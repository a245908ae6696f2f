"""The engine-log replay: a real engine's decision records (``Llama.moe_log()`` / ``moe_take_log()``) replayed
through the policy core's copy of its rules (``_core.replay_decisions``, the same decision code the simulator runs),
so that the simulator's decisions can be checked against the engine's, record by record."""
from __future__ import annotations

from typing import Sequence

from hybrimoe import _core
from hybrimoe.runtime.setup import build_policies


def replay_engine_log(llm, log: Sequence[dict], policies=None) -> list[dict]:
    """Replays an engine's decision records through the simulator's copy of its rules.

    ``llm``: the :class:`hybrimoe.Llama` whose engine logged ``log`` (``llm.moe_log()`` before its first decode,
    then ``llm.moe_take_log()``). ``policies``: fresh policy objects built as the engine's were
    (:func:`hybrimoe.runtime.setup.build_policies`); by default they are rebuilt from the Llama's ``moe_policy``,
    ``moe_cache``, ``moe_prefetch_layers`` and ``moe_profile``, which needs a preset name or a dict of names
    (policy *objects* keep state: pass fresh ones). The cost model is the engine's. Returns the simulator's records
    (the keys of ``moe_take_log()``); :func:`hybrimoe._core.first_difference` compares them with ``log``. With
    several devices each device's records are replayed through its own rebuilt policies and cost model.

    Raises:
        ValueError: the Llama has no MoE engine, the log does not start at the engine's first ubatch (the replay
            needs the cache as it was then), or the policies cannot be rebuilt; a malformed record.
    """
    setup = getattr(llm, "moe_setup", None)
    if setup is None or getattr(llm, "moe_engine", None) is None:
        raise ValueError("replay_engine_log needs a Llama with the MoE engine on (moe_cache=...)")
    log = list(log)
    if log and (not isinstance(log[0], dict) or "ubatch" not in log[0]):
        raise ValueError("decision record 0 is not a record of moe_take_log() (no 'ubatch')")
    if log and log[0]["ubatch"] != 0:
        raise ValueError(f"the log starts at ubatch {log[0]['ubatch']}: turn logging on before the first decode (the "
                         "replay starts from the engine's initial cache)")
    spec = setup.policy_spec
    if policies is None or setup.more_devices:
        if policies is not None:
            raise ValueError("the engine runs on several devices: the policies are rebuilt per device from "
                             "moe_policy; pass none")
        if not (isinstance(spec, str) or (isinstance(spec, dict) and
                                          all(isinstance(v, (str, bool)) for v in spec.values()))):
            raise ValueError("moe_policy was given as policy objects, which keep state: pass fresh ones as "
                             "policies=hybrimoe.runtime.setup.build_policies(...)")
    if not setup.more_devices:
        if policies is None:
            policies = build_policies(spec, setup.facts, setup.n_slots, setup.prefetch_layers, setup.profile,
                                      ram_preset=setup.ram_preset)
        return _core.replay_decisions(log, policies.cache, policies.scheduler, policies.prefetcher, setup.cost,
                                      has_slots=setup.n_slots > 0, prefetch_layers=int(setup.prefetch_layers),
                                      fill_on_miss=policies.fill_on_miss)
    # several devices: each device's rules saw only its own layers' records, with its own cache and cost model
    out: list = [None] * len(log)
    shares = [(setup.n_slots, setup.cost)] + [(d.n_slots, d.cost or setup.cost) for d in setup.more_devices]
    def device(r: dict) -> int:
        # a prefetch-only record is the device of the layers it prefetched for, planned at another device's layer
        if r.get("prefetch_only") and r.get("predictions"):
            return setup.layer_device[int(r["predictions"][0]["layer"])]
        return setup.layer_device[int(r["layer"])]

    for i, (n_slots, cost) in enumerate(shares):
        mask = [x == i for x in setup.layer_device]
        idx = [j for j, r in enumerate(log) if device(r) == i]
        pols = build_policies(spec, setup.facts, n_slots, setup.prefetch_layers, setup.profile, layers=mask,
                              ram_preset=setup.ram_preset)
        recs = _core.replay_decisions([log[j] for j in idx], pols.cache, pols.scheduler, pols.prefetcher, cost,
                                      has_slots=n_slots > 0, prefetch_layers=int(setup.prefetch_layers),
                                      fill_on_miss=pols.fill_on_miss)
        for j, r in zip(idx, recs):
            out[j] = r
    return out
