"""The reuse-predicting cache policy (hybrimoe.policy.ReusePolicy, docs/design.md §4 "Reuse prediction"): its update
rule against a replica written here from the documented rule, its start (MRS's ranking), what it learns on routing
with structure MRS does not see, and the engine with it on the RPC stand-in against upstream's same placement."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hybrimoe import _core
from hybrimoe import policy as pol

from .test_policy_cache import obs


class Replica:
    """The documented rule, written again: MRS scores at alpha 0.5, 0.1, 0.01 (times top_k), features [1, the three
    scores, used now, 2^-(age / H), the mean over this visit's experts a of count(a, then e) / count(a), the same
    with counts that decay by 0.995 per visit], the snapshot of visit t - H labelled 'used at a visit after it' and
    one SGD step per expert on the log-loss (only where the snapshot, the visits since and this one are
    decode-sized), then every expert predicted with the new weights; a visit of more than 4 tokens ranks its layer by
    -2 + 4 x top_k x MRS's alpha-0.5 score (here, at most 2 top_k experts per visit, the alpha-0.5 feature itself).
    Without router scores."""

    def __init__(self, L, E, H, rate):
        self.E, self.H, self.rate = E, H, rate
        self.w = np.array([-2.0, 4.0, 0, 0, 0, 0, 0, 0])
        self.follow = np.zeros((L, E, E))
        self.follow_n = np.zeros((L, E))
        self.recent = np.zeros((L, E, E))
        self.recent_n = np.zeros((L, E))
        self.prev = [[] for _ in range(L)]
        self.s = np.zeros((3, L, E))
        self.last = np.full((L, E), -1)
        self.visits = np.zeros(L, int)
        self.last_large = np.full(L, -1)
        self.snap = {}
        self.p = np.full((L, E), 1 / (1 + math.exp(2.0)))

    def observe(self, layer, experts, loads, n_tokens=1):
        t = self.visits[layer]
        self.visits[layer] += 1
        small = n_tokens <= 4
        if not small:
            self.last_large[layer] = t
        v = np.zeros(self.E)
        for e, n in zip(experts, loads):
            v[e] = min(1.0, n / n_tokens)
            self.last[layer, e] = t
        cur = sorted(set(experts)) if small else []
        self.recent[layer] *= 0.995
        self.recent_n[layer] *= 0.995
        if cur:
            for a in self.prev[layer]:
                self.follow_n[layer, a] += 1
                self.follow[layer, a, cur] += 1
                self.recent_n[layer, a] += 1
                self.recent[layer, a, cur] += 1
        self.prev[layer] = cur

        def mean_follow(table, n):
            rows = [table[layer, a] / n[layer, a] if self.follow_n[layer, a] else np.zeros(self.E) for a in cur]
            return np.mean(rows, axis=0) if rows else np.zeros(self.E)

        fol, rec = mean_follow(self.follow, self.follow_n), mean_follow(self.recent, self.recent_n)
        for i, a in enumerate((0.5, 0.1, 0.01)):
            self.s[i, layer] = a * v + (1 - a) * self.s[i, layer]
        if t >= self.H and self.last_large[layer] < t - self.H:
            f = self.snap[(layer, t - self.H)]
            for e in range(self.E):
                p = 1 / (1 + math.exp(-float(self.w @ f[e])))
                y = 1.0 if self.last[layer, e] > t - self.H else 0.0
                self.w = self.w - self.rate * (p - y) * f[e]
        f = np.zeros((self.E, 8), np.float32)
        for e in range(self.E):
            last = self.last[layer, e]
            f[e] = [1, self.s[0, layer, e], self.s[1, layer, e], self.s[2, layer, e], float(last == t),
                    0.0 if last < 0 else 2.0 ** (-(t - last) / self.H), fol[e], rec[e]]
        z = f.astype(np.float64) @ self.w if small else -2.0 + 4.0 * f[:, 1].astype(np.float64)
        self.p[layer] = 1 / (1 + np.exp(-z))
        self.snap[(layer, t)] = f.astype(np.float64)


def test_the_update_rule_matches_a_replica_of_the_documented_one():
    rng = np.random.default_rng(3)
    L, E, H, rate = 2, 6, 3, 0.2
    p = _core.ReusePolicy(horizon=H, rate=rate)
    p.reset(L, E)
    rep = Replica(L, E, H, rate)
    for step in range(40):
        for layer in range(L):
            experts = sorted(rng.choice(E, 2, replace=False).tolist())
            # every 9th visit a prefill-sized ubatch of 6 tokens: it neither learns nor counts transitions
            n = 6 if step % 9 == 4 else 1
            p.observe(obs(layer, experts, [n, 1], n_tokens=n, step=step, n_experts=E, top_k=2))
            rep.observe(layer, experts, [n, 1], n)
            got = [p.probability(layer, e) for e in range(E)]
            assert got == pytest.approx(rep.p[layer], rel=1e-5, abs=1e-6), (step, layer)
    assert p.weights() == pytest.approx(rep.w.tolist(), rel=1e-5, abs=1e-6)
    # a prefill visit at t spoils the samples labelled at t .. t + H (its own snapshot's and those whose window
    # holds it)
    spoiled = {u for t in range(40) if t % 9 == 4 for u in range(t, t + H + 1)}
    assert p.samples == L * sum(1 for t in range(H, 40) if t not in spoiled) * E


def test_the_decaying_table_matches_the_replica_across_its_rescales():
    """20,000 visits of one layer: the decaying transition counts are rescaled about every 9,200 visits (a growing
    weight per count, scaled back before it leaves float's range), and the predictions still match the replica's,
    whose counts decay by multiplication at every visit."""
    rng = np.random.default_rng(11)
    E, H, rate = 4, 2, 0.01
    p = _core.ReusePolicy(horizon=H, rate=rate)
    p.reset(1, E)
    rep = Replica(1, E, H, rate)
    # a routing whose transitions change halfway: the recent table must forget the first half's
    for step in range(20000):
        first = int(rng.integers(E)) if rng.random() < 0.3 else (step % E if step < 10000 else (3 * step) % E)
        experts = sorted({first, int(rng.integers(E))})
        p.observe(obs(0, experts, step=step, n_experts=E, top_k=2))
        rep.observe(0, experts, [1] * len(experts))
    got = [p.probability(0, e) for e in range(E)]
    assert got == pytest.approx(rep.p[0], rel=1e-4, abs=1e-5)
    assert p.weights() == pytest.approx(rep.w.tolist(), rel=1e-4, abs=1e-5)


def test_a_repeated_expert_counts_once_and_the_cache_ranks_by_the_logit():
    """An observation that lists an expert twice teaches what one listing it once does (the transition counts of
    feature 6 included); a verification ubatch of 5 tokens counts no transitions; priority() is the logit of
    probability() (the cache's order without the exponential)."""
    rng = np.random.default_rng(5)
    E = 6
    a, b = _core.ReusePolicy(horizon=2, rate=0.3), _core.ReusePolicy(horizon=2, rate=0.3)
    a.reset(1, E)
    b.reset(1, E)
    for step in range(30):
        experts = sorted(rng.choice(E, 2, replace=False).tolist())
        a.observe(obs(0, experts, step=step, n_experts=E, top_k=2))
        b.observe(obs(0, experts + experts[:1], [1, 1, 1], step=step, n_experts=E, top_k=2))
    assert b.weights() == pytest.approx(a.weights(), rel=1e-12) and a.weights()[6] != 0.0
    for e in range(E):
        p = a.probability(0, e)
        assert a.priority(0, e) == pytest.approx(math.log(p / (1 - p)), rel=1e-9, abs=1e-9)
    # visits of 5 tokens (prefill-sized), after decode visits that taught it: no step learns from them, and the
    # layer ranks exactly as MRS (alpha 0.5, its Top-P: at most 2 top_k experts updated per visit, 5 routed here)
    E = 8
    c = _core.ReusePolicy(horizon=2, rate=0.3)
    c.reset(1, E)
    mrs = _core.MRSPolicy(alpha=0.5)
    mrs.reset(1, E)
    for step in range(40):
        large = step >= 20
        experts = sorted(rng.choice(E, 5 if large else 2, replace=False).tolist())
        loads = [2, 1, 1, 1, 0][: len(experts)] if large else [1, 1]
        loads = [max(1, x) for x in loads]
        for q in (c, mrs):
            q.observe(obs(0, experts, loads, n_tokens=5 if large else 1, step=step, n_experts=E, top_k=2))
        if step == 19:
            taught = c.weights()
            assert taught != [-2.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        if large:
            assert c.weights() == taught
            for i in range(E):
                for j in range(E):
                    assert (c.priority(0, i) < c.priority(0, j)) == (mrs.score(0, i) < mrs.score(0, j)), (step, i, j)
                    assert (c.priority(0, i) == c.priority(0, j)) == (mrs.score(0, i) == mrs.score(0, j)), (step, i, j)


def test_it_starts_ranking_as_mrs():
    """Before a label exists (fewer visits than the horizon) the predicted probability orders a layer's experts as
    MRS with alpha 0.5 scores them (HybriMoE §IV.D), ties included, where a visit scores only its routed experts (no
    router scores, at most MRS's p = 2 top_k of them: with router scores MRS keeps the top p, this policy all)."""
    E = 8
    reuse = _core.ReusePolicy(horizon=16)
    mrs = _core.MRSPolicy(alpha=0.5)
    for p in (reuse, mrs):
        p.reset(1, E)
    for t, experts in enumerate([[0, 1], [1, 2], [2, 3], [3, 4], [0, 2]]):
        for p in (reuse, mrs):
            p.observe(obs(0, experts, step=t, n_experts=E, top_k=2))
    a = [reuse.probability(0, e) for e in range(E)]
    b = [mrs.score(0, e) for e in range(E)]
    for i in range(E):
        for j in range(E):
            assert (a[i] < a[j]) == (b[i] < b[j]) and (a[i] == a[j]) == (b[i] == b[j]), (i, j)
    assert reuse.samples == 0 and reuse.log_loss == 0.0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="horizon"):
        _core.ReusePolicy(horizon=0)
    with pytest.raises(ValueError, match="rate"):
        _core.ReusePolicy(rate=0.0)
    with pytest.raises(ValueError, match="horizon"):
        _core.ReusePolicy(horizon=10**6)
    with pytest.raises(ValueError, match="rate"):
        _core.ReusePolicy(rate=2.0)
    # the starting weights from construction on; a key outside the sizes is an IndexError, before reset too
    fresh = _core.ReusePolicy()
    assert fresh.weights() == [-2.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(IndexError, match="reset"):
        fresh.priority(0, 0)
    for made in (_core.ReusePolicy(), _core.MRSPolicy(), _core.LFUPolicy()):
        made.reset(2, 4)
        for key in ((2, 0), (0, 4), (-1, 0), (10**7, 0)):
            with pytest.raises(IndexError, match="outside 2 layers x 4 experts"):
                made.priority(*key)
        assert made.priority(1, 3) == made.priority(1, 3)


def test_every_policy_checks_what_python_hands_it():
    """Keys, observations and resets from Python are checked before any state changes (IndexError / ValueError,
    never a read out of bounds): a static policy's admit, MRS's and LFU's observe (expert ids, loads, top_k), and a
    reset that fails leaves no sizes to check against."""
    static = _core.StaticPolicy([5])
    with pytest.raises(IndexError, match="reset"):
        static.admit(0, 0)
    static.reset(2, 4)
    assert static.admit(1, 1) and not static.admit(1, 0)
    with pytest.raises(IndexError, match="outside 2 layers x 4 experts"):
        static.admit(2, 0)
    with pytest.raises(ValueError, match="key 5"):
        static.reset(1, 4)
    with pytest.raises(IndexError, match="reset"):  # the failed reset left no sizes
        static.priority(1, 1)
    for made in (_core.MRSPolicy(), _core.LFUPolicy()):
        made.reset(2, 4)
        before = [made.priority(1, e) for e in range(4)]
        for bad, message in ((obs(1, [4], n_experts=4), "expert out of range"),
                             (obs(1, [1, 2], [1], n_experts=4), "loads"),
                             (obs(1, [1], n_experts=4, top_k=0), "top_k"),
                             (obs(2, [1], n_experts=4), "layer")):
            with pytest.raises(ValueError, match=message):
                made.observe(bad)
        assert [made.priority(1, e) for e in range(4)] == before
        with pytest.raises(ValueError, match="n_layers"):
            made.reset(0, 4)
    p = _core.ReusePolicy(horizon=2)
    p.reset(2, 4)
    for t in range(5):
        p.observe(obs(0, [t % 4], step=t, n_experts=4))
    before = ([p.probability(0, e) for e in range(4)], p.weights(), p.samples)
    with pytest.raises(ValueError, match="n_experts"):
        p.observe(obs(0, [1], n_experts=5))
    with pytest.raises(ValueError, match="expert out of range"):
        p.observe(obs(0, [1, 4], n_experts=4))
    with pytest.raises(ValueError, match="expert out of range"):
        p.observe(obs(0, [-1], n_experts=4))
    with pytest.raises(ValueError, match="scores"):
        p.observe(obs(0, [1], n_experts=4, scores=[0.5, 0.5]))
    # a refused observation changed nothing: the next visit learns as if it had not been offered
    assert ([p.probability(0, e) for e in range(4)], p.weights(), p.samples) == before
    q = _core.ReusePolicy(horizon=2)
    q.reset(2, 4)
    for t in range(6):
        q.observe(obs(0, [t % 4], step=t, n_experts=4))
    p.observe(obs(0, [5 % 4], step=5, n_experts=4))
    assert [p.probability(0, e) for e in range(4)] == [q.probability(0, e) for e in range(4)]
    assert isinstance(_core.make_cache_policy("reuse"), _core.ReusePolicy)
    assert pol.ReusePolicy is _core.ReusePolicy and _core.make_cache_policy("reuse").name() == "reuse"
    # horizon 2: per expert 2 snapshots of 8 features (floats), two transition rows of 4 floats and their counts,
    # a last-visit slot; per layer a visit count, how many experts the last visit used, the decaying table's gain and
    # the last prefill-sized visit
    assert p.bytes_per_layer == 4 * (6 * 8 + 2 * 8 * 4 + 2 * 5 * 4 + 4) + 8 + 4 + 8 + 8


def _stream(rng, T, E, hot_every):
    """One layer's routing, top-1: expert 0 every ``hot_every`` visits, else a random one of the others: a
    periodic reuse that recency alone misjudges between uses."""
    return [[0] if t % hot_every == 0 else [int(rng.integers(1, E))] for t in range(T)]


def test_it_learns_what_recency_misses():
    """A periodic expert (every 3rd visit) among random ones: after learning, the predictor's log-loss is below the
    base rate's entropy (what a constant guess scores) and below that of its starting weights (rate ~0: MRS's
    ranking as a probability, never updated), and it ranks the periodic expert first between its uses, where MRS
    ranks the one used last above it."""
    rng = np.random.default_rng(0)
    E, T = 16, 3000
    routing = _stream(rng, T, E, 3)
    learned, frozen, mrs = _core.ReusePolicy(horizon=2, rate=0.05), _core.ReusePolicy(horizon=2, rate=1e-12), \
        _core.MRSPolicy(alpha=0.5)
    for p in (learned, frozen, mrs):
        p.reset(1, E)
    for t, ex in enumerate(routing):
        for p in (learned, frozen, mrs):
            p.observe(obs(0, ex, step=t, n_experts=E))
    q = learned.positive_rate
    entropy = -(q * math.log(q) + (1 - q) * math.log(1 - q))
    assert learned.log_loss < 0.9 * entropy, (learned.log_loss, entropy)
    assert learned.log_loss < frozen.log_loss
    # the last visit (t = T-1, T-1 = 2999 = 2 mod 3) used a random expert; the periodic one was used at T-3
    last = routing[-1][0]
    assert last != 0
    assert learned.probability(0, 0) > learned.probability(0, last)
    assert mrs.score(0, 0) < mrs.score(0, last)


def test_cache_replay_of_a_trace_counts_its_hits():
    """``hybrimoe simulate --hit-rates``'s cache-only replay lists it (``reuse``) beside MRS, LRU, LFU and Belady,
    and no policy beats Belady's clairvoyant bound."""
    from hybrimoe.sim.simulator import Setup, cache_hit_rates
    from hybrimoe.traces.synthetic import synthetic_trace

    tr = synthetic_trace("qwen3-30b-a3b", 400, locality="high", seed=0)
    s = Setup(tr, pol.load_hardware("rtx4090-desktop"), "25%", "decode", max_tokens=300)
    hr = cache_hit_rates(s)
    assert set(hr) == {"mrs", "lru", "lfu", "reuse", "belady"}
    assert 0.0 < hr["reuse"]["hit_rate"] <= hr["belady"]["hit_rate"]


# ---- the engine --------------------------------------------------------------------------------------------------

def test_engine_with_the_reuse_cache_matches_upstream_and_reports_its_learning(tiny_model, rpc_server,
                                                                                split_cost_model):
    """``moe_policy="hybrimoe-reuse"`` on the stand-in GPU: upstream's tokens and logits with the same placement (a
    cache policy moves experts, never numbers), and ``moe_stats()["engine"]["predictor"]`` shows it learned (samples,
    a log-loss, weights moved from their start); a policy without a predictor reports ``{}``."""
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import slot_bytes
    from hybrimoe.testing.upstream import greedy_with_logits, prompt_tokens

    path = tiny_model("deepseek2", "Q8_0", n_layer=4, n_expert=16, n_expert_used=4)
    common = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=512, n_batch=512, n_ubatch=16, seed=0,
                  verbose=False, no_repack=True)
    llm = Llama(str(path), moe_cache=12 * slot_bytes(path), moe_policy="hybrimoe-reuse",
                moe_cost_model=split_cost_model, **common)
    try:
        tokens = prompt_tokens(llm, 40)
        out, lg = greedy_with_logits(llm, tokens, 16)
        st = llm.moe_stats()["engine"]
    finally:
        llm.close()
    ref = Llama(str(path), tensor_buft_overrides="exps=CPU", **common)
    try:
        ref_out, ref_lg = greedy_with_logits(ref, tokens, 16)
    finally:
        ref.close()
    assert out == ref_out and np.array_equal(lg, ref_lg)
    pr = st["predictor"]
    assert st["policy"] == "hybrimoe-reuse" and pr["samples"] > 0 and pr["log_loss"] > 0
    assert len(pr["weights"]) == 8 and pr["weights"] != [-2.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert st["ram"] == {}
    plain = Llama(str(path), moe_cache=12 * slot_bytes(path), moe_cost_model=split_cost_model, **common)
    try:
        assert plain.moe_stats()["engine"]["predictor"] == {}
    finally:
        plain.close()
