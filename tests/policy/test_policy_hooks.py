"""Python policy subclasses run inside the C++ simulator (trampolines), give the same results as the equivalent
C++ policies, and their exceptions surface as Python errors naming the policy."""
import numpy as np
import pytest

from hybrimoe import _core

MB = 1e6


def synthetic_trace(n_tok=300, n_layers=4, n_exp=16, k=2, seed=0):
    rng = np.random.default_rng(seed)
    hot = rng.permutation(n_exp)
    ids = np.empty((n_tok, n_layers, k), dtype=np.int16)
    for t in range(n_tok):
        for l in range(n_layers):
            # skewed routing so caches matter
            p = np.exp(-np.arange(n_exp) / 4.0)
            ids[t, l] = hot[rng.choice(n_exp, size=k, replace=False, p=p / p.sum())]
    offsets = np.array([0, 100, 180, 300])
    return _core.Trace(ids, offsets, [2 * MB] * n_layers, n_exp, 1)


def costs():
    c = _core.CostModel()
    c.cpu_a_s, c.cpu_b_s, c.cpu_startup_s = 1e-4, 1e-6, 2e-5
    c.gpu_a_s, c.gpu_b_s = 2e-5, 1e-7
    c.h2d_bandwidth_Bps, c.h2d_latency_s = 12e9, 1e-5
    c.act_a_s, c.layer_a_s, c.dense_a_s = 2e-5, 1e-4, 2e-4
    return c


class PyLRU(_core.CachePolicy):
    def name(self):
        return "py-lru"

    def priority(self, layer, expert):
        return 0.0


class PyMRS(_core.CachePolicy):
    """MRS written in Python (HybriMoE §IV.D), fallback scores 1/top_k, mean aggregation, p = 2*top_k."""

    def __init__(self, alpha=0.5):
        super().__init__()
        self.alpha = alpha

    def name(self):
        return "py-mrs"

    def reset(self, n_layers, n_experts):
        self.S = np.zeros((n_layers, n_experts))

    def observe(self, obs):
        s = np.zeros(obs.n_experts)
        for e, load in zip(obs.experts, obs.loads):
            s[e] = load / (obs.n_tokens * obs.top_k)
        p = 2 * obs.top_k
        if np.count_nonzero(s) > p:
            keep = np.lexsort((np.arange(len(s)), -s))[:p]
            mask = np.zeros_like(s, dtype=bool)
            mask[keep] = True
            s[~mask] = 0.0
        self.S[obs.layer] = self.alpha * s + (1 - self.alpha) * self.S[obs.layer]

    def priority(self, layer, expert):
        return float(self.S[layer, expert])


class PyKTransformers(_core.SchedulePolicy):
    def name(self):
        return "py-kt"

    def split(self, layer_input, cost):
        return [bool(c) for c in layer_input.cached]


class PyTopK(_core.PrefetchPolicy):
    def name(self):
        return "py-topk"

    def plan(self, ctx, cache, cost):
        out = []
        for p in ctx.predictions:
            if p.distance != 1:
                continue
            order = sorted(range(len(p.experts)), key=lambda i: -p.loads[i])  # stable like the C++ one
            for i in order:
                if len(out) >= ctx.top_k:
                    break
                if not cache.resident(p.layer, p.experts[i]):
                    out.append((p.layer, p.experts[i]))
        return out


def run(trace, cache_policy, sched, pre, stage="decode"):
    cache = _core.ExpertCache([2 * MB] * trace.n_layers, trace.n_experts, 8 * MB, cache_policy)
    cfg = _core.SimConfig()
    cfg.stage = stage
    cfg.ubatch = 64
    truth = _core.TruthModel()
    c = costs()
    return _core.simulate(trace, cache, sched, pre, c, c, truth, cfg, 0, trace.n_prompts)


def same(a, b):
    assert a.total_s == b.total_s
    assert (a.cache.demand_hits, a.cache.prefetch_hits, a.cache.misses) == \
           (b.cache.demand_hits, b.cache.prefetch_hits, b.cache.misses)
    assert a.bytes_h2d == b.bytes_h2d


@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_python_cache_policies_match_cpp(stage):
    tr = synthetic_trace()
    h = _core.HybriMoEScheduler
    same(run(tr, PyLRU(), h(), _core.ImpactPrefetcher(), stage), run(tr, _core.LRUPolicy(), h(),
                                                                      _core.ImpactPrefetcher(), stage))
    same(run(tr, PyMRS(), h(), _core.ImpactPrefetcher(), stage), run(tr, _core.MRSPolicy(), h(),
                                                                      _core.ImpactPrefetcher(), stage))


def test_python_schedule_and_prefetch_policies_match_cpp():
    tr = synthetic_trace(seed=3)
    a = run(tr, _core.LRUPolicy(), PyKTransformers(), PyTopK())
    b = run(tr, _core.LRUPolicy(), _core.CpuUncachedScheduler(), _core.TopKPrefetcher())
    same(a, b)
    assert a.prefetch_issued == b.prefetch_issued > 0


def test_python_policy_exception_names_the_policy():
    class Broken(_core.CachePolicy):
        def name(self):
            return "broken"

        def priority(self, layer, expert):
            raise KeyError("no score for this expert")

    tr = synthetic_trace()
    with pytest.raises(RuntimeError, match=r"CachePolicy 'Broken'\.priority failed: KeyError") as info:
        run(tr, Broken(), _core.HybriMoEScheduler(), _core.NoPrefetcher())
    assert isinstance(info.value.__cause__, KeyError)

    class BadSplit(_core.SchedulePolicy):
        def name(self):
            return "bad"

        def split(self, layer_input, cost):
            return [1]  # wrong length

    with pytest.raises(ValueError, match="BadSplit'.split returned 1 flags"):
        run(tr, _core.LRUPolicy(), BadSplit(), _core.NoPrefetcher())

    class BadPrefetch(_core.PrefetchPolicy):
        def name(self):
            return "bad-prefetch"

        def plan(self, ctx, cache, cost):
            return [(ctx.layer, 0)]  # its own layer: not ahead

    with pytest.raises(ValueError, match="prefetch policy 'bad-prefetch' asked for"):
        run(tr, _core.LRUPolicy(), _core.HybriMoEScheduler(), BadPrefetch())

    class NotPairs(_core.PrefetchPolicy):
        def plan(self, ctx, cache, cost):
            return ["x"]

    with pytest.raises((TypeError, RuntimeError), match="NotPairs"):
        run(tr, _core.LRUPolicy(), _core.HybriMoEScheduler(), NotPairs())


def test_missing_override_is_a_clear_error():
    class NoPriority(_core.CachePolicy):
        pass

    cache = _core.ExpertCache([1 * MB], 4, 1 * MB, NoPriority())
    cache.admit(0, 0)
    with pytest.raises(TypeError, match="must override priority"):
        cache.admit(0, 1)


def test_python_policy_kept_alive_by_cache():
    cache = _core.ExpertCache([1 * MB], 4, 1 * MB, PyLRU())   # no Python reference left
    import gc

    gc.collect()
    cache.admit(0, 0)
    assert cache.admit(0, 1)
    assert cache.policy.name() == "py-lru"
