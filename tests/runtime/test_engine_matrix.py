"""Pairwise correctness matrix of the hybrid engine (docs/design.md §12), slow suite (CI runs it: ``pytest``).

Every pair of values of any two dimensions appears in some run (allpairspy), not the full product:
architecture x quantisation x cache size (expert slots: 0, 1, top-k - 1, top-k, all) x policy x ubatch x prompt
length (1, ub - 1, ub, ub + 1, 3 ub + 7; lengths below 1 skipped). Each run: hybrimoe vs upstream llama.cpp with
the same placement (RPC device, ``-ot exps=CPU``): same 32 greedy tokens, logits NMSE <= 1e-6. Both sides keep the
file's layout (``no_repack``): the stand-in computes the GPU share with the plain CPU kernels, which upstream's
repacked ones need not match bit for bit; tests/runtime/test_engine_repack.py covers repacked CPU weights.
"""
from __future__ import annotations

import numpy as np
import pytest

from hybrimoe.testing.upstream import greedy_reference, greedy_with_logits, nmse
from hybrimoe.testing.fixtures import ENGINE_ARCHS

ARCHS = list(ENGINE_ARCHS)
QUANTS = ["Q8_0", "Q4_K_M", "mix"]
CACHES = ["0", "1", "k-1", "k", "all"]
POLICIES = ["hybrimoe", "hybrimoe-lru", "ktransformers", "hot-set", "upstream-ncmoe", "gpu-on-demand"]
UBATCHES = [1, 2, 31, 32, 33, 512]
LENGTHS = ["1", "ub-1", "ub", "ub+1", "3ub+7"]


def _cases():
    from allpairspy import AllPairs

    cases = []
    for i, c in enumerate(AllPairs([ARCHS, QUANTS, CACHES, POLICIES, UBATCHES, LENGTHS])):
        cases.append(pytest.param(*c, id=f"{i:02d}-" + "-".join(str(x) for x in c)))
    return cases


def _length(spec: str, ub: int) -> int:
    return {"1": 1, "ub-1": ub - 1, "ub": ub, "ub+1": ub + 1, "3ub+7": 3 * ub + 7}[spec]


def _slots(spec: str, facts) -> int:
    k = facts.top_k
    return {"0": 0, "1": 1, "k-1": k - 1, "k": k, "all": len(facts.moe_layers) * facts.n_expert}[spec]


def test_pairwise_covers_every_pair():
    """The generated cases really cover every pair of values (guards against a silently shrunken matrix)."""
    import itertools

    dims = [ARCHS, QUANTS, CACHES, POLICIES, UBATCHES, LENGTHS]
    rows = [p.values for p in _cases()]
    for a, b in itertools.combinations(range(len(dims)), 2):
        seen = {(r[a], r[b]) for r in rows}
        assert seen == set(itertools.product(dims[a], dims[b])), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("arch, quant, cache, policy, ub, length", _cases())
def test_engine_matrix(arch, quant, cache, policy, ub, length, tiny_model, rpc_server, split_cost_model):
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts

    n_prompt = _length(length, ub)
    if n_prompt < 1:
        pytest.skip("prompt length below 1")
    path = tiny_model(arch, quant)
    facts = engine_facts(path)
    n_slots = _slots(cache, facts)
    common = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=n_prompt + 64, n_batch=512,
                  n_ubatch=ub, seed=0, verbose=False, no_repack=True)
    tokens, ref_out, ref_lg = greedy_reference(str(path), n_prompt, 32, tensor_buft_overrides="exps=CPU", **common)
    from hybrimoe.policy import PROFILE_PRESETS

    # hot-set's profile: seeded random counts per (MoE layer, expert)
    profile = (np.random.default_rng(0).integers(0, 50, (len(facts.moe_layers), facts.n_expert))
               if policy in PROFILE_PRESETS else None)
    llm = Llama(str(path), moe_cache=n_slots * facts.slot_bytes, moe_policy=policy, moe_profile=profile,
                moe_cost_model=split_cost_model, **common)
    try:
        out, lg = greedy_with_logits(llm, tokens, 32)
        st = llm.moe_stats()
        assert llm.moe_engine.pinned_count() == 0
        assert llm.moe_engine.slots_in_use() == llm.moe_setup.policies.cache.n_resident <= n_slots
    finally:
        llm.close()
    assert out == ref_out
    assert nmse(lg, ref_lg) <= 1e-6
    e = st["engine"]
    assert e["cpu_experts"] + e["gpu_experts"] > 0
    if n_slots == 0:
        assert e["gpu_experts"] == 0 and e["bytes_copied"] == 0
    if policy == "gpu-on-demand" and n_slots >= facts.top_k:
        assert e["gpu_experts"] > 0, e
