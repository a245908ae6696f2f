"""Synthetic routing traces whose knobs are measured statistics of real routing (:mod:`hybrimoe.traces.stats`;
docs/design.md §13 has the fit to the DeepSeek-V2-Lite trace and what it does not reproduce).

Generator (:func:`synthetic_trace`): router logits ``z[t, l, e] = b[l, e] + u[t, l, e]``, the top-k of ``z`` routed.
``b[l]`` is a random permutation of ``sigma_b`` times the standard normal quantiles of E points (popularity); ``u``
is unit-variance Gaussian noise, ``sqrt(w)`` times a part drawn once per prompt plus ``sqrt(1 - w)`` times an AR(1)
process in t with coefficient ``rho`` (restarted at each prompt), so its correlation at lag n within a prompt is
``w + (1 - w) rho^n``; both parts' draws are correlated ``c`` across adjacent layers through a random expert mapping
per layer pair. ``sigma_b``, ``w``, ``rho`` and ``c`` are solved (:func:`solve_parameters`) so that the population
values of the statistics are the knobs; the marginal of ``u`` does not depend on ``w``, ``rho`` or ``c``, so the skew
has its own parameter, as does the cross-layer correlation (its lag is 0).

Router scores (the DeepSeek-V2-Lite trace has none; an ASSUMPTION, recorded in every synthetic trace's
``synthetic["score_model"]``): the logits are scaled by ``lam``, solved so that the mean softmax probability mass of
the k routed experts is ``topk_mass`` (default :data:`DEFAULT_TOPK_MASS`, not measured: no trace with scores was at
hand), then passed through the shape's gating: softmax over all experts; sigmoid (DeepSeek-V3: ``sigmoid(lam z)``,
no selection bias, no group-limited routing); for ``softmax_weight`` (gpt-oss) the raw logits ``lam z`` are stored, as
the trace format says.

Shapes (:data:`SHAPES`) are the :data:`hybrimoe.model.facts.MODEL_FACTS` entries; locality presets (:data:`LOCALITY`):
``high`` = the values fitted to the DeepSeek-V2-Lite development trace (:data:`FITTED_DSV2_LITE`), ``low`` = the same
skew and cross-layer correlation with no temporal locality (overlap and persistence 0: each token independent of the
previous ones given the popularity).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Union

import numpy as np

from hybrimoe.model.facts import MODEL_FACTS, ModelFacts
from hybrimoe.traces.format import RoutingTrace
from hybrimoe.traces.stats import PERSIST_LAG, intersections, lift, routing_stats, top_share

SYNTH_FORMAT = "hybrimoe.synth/1"
#: mean softmax mass of the k routed experts the generated scores get unless told: an ASSUMPTION (no trace with
#: router scores was at hand to measure it; the DeepSeek-V2-Lite trace has ids only)
DEFAULT_TOPK_MASS = 0.6
#: tokens per prompt unless told: the DeepSeek-V2-Lite trace's mean prompt length (170,338 tokens / 1,799 prompts)
DEFAULT_PROMPT_TOKENS = 95


def default_prompts(n_tokens: int) -> int:
    """The prompts a trace of ``n_tokens`` gets unless told: about one per :data:`DEFAULT_PROMPT_TOKENS` tokens,
    within 1..n_tokens/2."""
    return int(min(max(1, round(n_tokens / DEFAULT_PROMPT_TOKENS)), max(1, n_tokens // 2)))


@dataclass(frozen=True)
class Knobs:
    """The generator's knobs, in the units of :func:`routing_stats` (means over MoE layers).

    ``skew``: share of the activations taken by the hottest 25% of experts, in [0.25, 1); ``overlap``: temporal lift
    over chance of consecutive tokens' expert sets (lag 1), in [0, 1); ``persistence``: the same lift at lag
    :data:`PERSIST_LAG`, in [0, overlap] (how slowly locality fades within a prompt); ``cross_layer``: lift over
    chance of adjacent layers' sets through the best fixed expert mapping, in [0, 1).
    """

    skew: float
    overlap: float
    persistence: float
    cross_layer: float

    def validate(self) -> None:
        """Raises ValueError naming the first knob outside its range (or not a finite number)."""
        for name, lo in (("skew", 0.25), ("overlap", 0.0), ("persistence", 0.0), ("cross_layer", 0.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
                raise ValueError(f"knob '{name}' must be a finite number, got {v!r}")
            if not lo <= v < 1.0:
                raise ValueError(f"knob '{name}' must be in [{lo}, 1), got {v!r}")
        if self.persistence > self.overlap:
            raise ValueError(f"knob 'persistence' ({self.persistence}) must not exceed 'overlap' ({self.overlap}): "
                             "locality at a longer lag cannot be higher in this model")


#: fitted by :func:`fit_synthetic` to the DeepSeek-V2-Lite development trace (170,338 prefill tokens of 1,799 chat
#: prompts, 26 MoE layers, 64 experts, top-6, ids only; docs/design.md §12) on 2026-12-01; stored here because CI may
#: have no trace (tests/traces/test_synthetic.py refits it where the trace is present)
FITTED_DSV2_LITE = Knobs(skew=0.3304, overlap=0.1838, persistence=0.0602, cross_layer=0.388)

#: locality presets: ``high`` the fitted DeepSeek-V2-Lite values; ``low`` no temporal locality (overlap and
#: persistence 0: tokens independent given popularity), the same skew and cross-layer correlation
LOCALITY = {"high": FITTED_DSV2_LITE,
            "low": Knobs(skew=FITTED_DSV2_LITE.skew, overlap=0.0, persistence=0.0,
                         cross_layer=FITTED_DSV2_LITE.cross_layer)}

#: the named shapes synthetic traces can have (model facts with their sources: :mod:`hybrimoe.model.facts`)
SHAPES = {name: MODEL_FACTS[name] for name in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "kimi-k2",
                                                "gpt-oss-120b", "deepseek-v2-lite", "qwen3-235b-a22b",
                                                "glm-4.5-air")}


def fit_synthetic(trace: RoutingTrace) -> Knobs:
    """The knobs that make :func:`synthetic_trace` reproduce ``trace``'s statistics: its :func:`routing_stats` means
    (``skew``, ``overlap``, ``persistence``, ``cross_layer``), rounded to 4 digits and clipped into the knobs'
    ranges. For the DeepSeek-V2-Lite development trace they are :data:`FITTED_DSV2_LITE`.

    Raises:
        ValueError: as :func:`routing_stats`; a trace with no prompt longer than :data:`PERSIST_LAG` tokens.
    """
    s = routing_stats(trace)
    if not math.isfinite(s["persistence"]):
        raise ValueError(f"fit_synthetic needs prompts longer than {PERSIST_LAG} tokens (for 'persistence')")

    def clip(v, lo, hi=0.999):
        return round(float(min(max(v, lo), hi)), 4)

    overlap = clip(s["overlap"], 0.0)
    return Knobs(skew=clip(s["skew"], 0.25), overlap=overlap, persistence=clip(s["persistence"], 0.0, overlap),
                 cross_layer=clip(s["cross_layer"], 0.0))


# ---- solving the generator's parameters ----------------------------------------------------------------------------

_SOLVE_SAMPLES = 4096
_SOLVE_SEED = 12345
_solved: dict = {}


def _norm_sf(x: np.ndarray) -> np.ndarray:
    """P(N(0, 1) > x), elementwise, through Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7; numpy has no erf)."""
    x = np.asarray(x, np.float64) / math.sqrt(2.0)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    erfc = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erfc *= np.exp(-a * a)
    return 0.5 * np.where(x >= 0, erfc, 2.0 - erfc)


def _quantiles(E: int) -> np.ndarray:
    """Standard normal quantiles at (i + 0.5) / E, i = 0..E-1, descending (by bisection on :func:`_norm_sf`)."""
    p = (np.arange(E) + 0.5) / E                    # upper-tail probabilities: the first is the largest quantile
    lo, hi = np.full(E, -10.0), np.full(E, 10.0)
    for _ in range(60):
        mid = (lo + hi) / 2
        above = _norm_sf(mid) > p
        lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
    return (lo + hi) / 2


def _inclusion(b: np.ndarray, u: np.ndarray, k: int) -> np.ndarray:
    """float64 ``[E]``: P(expert e is in the top-k of b + noise), noise iid N(0, 1), estimated from the samples
    ``u`` ``[N, E]`` by conditioning on the others: e is routed when b_e + u_e beats the k-th largest of the other
    experts' values, so each sample gives P(N(0,1) > that - b_e) (far less noisy than counting)."""
    z = b + u
    part = -np.partition(-z, (k - 1, k), axis=1)
    kth, next_ = part[:, k - 1:k], part[:, k:k + 1]
    others = np.where(z >= kth, next_, kth)         # the k-th largest of the other experts
    return _norm_sf(others - b).mean(axis=0)


def _topk(z: np.ndarray, k: int) -> np.ndarray:
    """int64 ``[..., k]``: the ids of the k largest entries of each row of ``z`` (last axis), highest first, ties to
    the lower id. ``z`` is masked in place during the call and restored exactly. k passes of a vectorized argmax:
    for the top-k of a few experts (k <= 8 for every shape in :data:`SHAPES`) several times faster than
    ``np.argpartition`` plus a sort, whose per-row overhead dominates on rows of a few hundred."""
    flat = z.reshape(-1, z.shape[-1])                  # a view for a contiguous z; a copy otherwise, left unused
    rows = np.arange(flat.shape[0])
    ids = np.empty((flat.shape[0], k), np.int64)
    kept = np.empty((flat.shape[0], k), z.dtype)
    for i in range(k):
        ids[:, i] = flat.argmax(axis=1)
        kept[:, i] = flat[rows, ids[:, i]]
        flat[rows, ids[:, i]] = -np.inf
    for i in range(k):
        flat[rows, ids[:, i]] = kept[:, i]
    return ids.reshape(z.shape[:-1] + (k,))


def _bisect(fn, target: float, lo: float, hi: float, what: str, iters: int = 20) -> float:
    """x in [lo, hi] with fn(x) = target for an increasing fn; ValueError naming ``what`` when out of reach."""
    if target <= fn(lo):
        return lo
    top = fn(hi)
    if target > top:
        raise ValueError(f"knob '{what}' = {target} is out of reach for this shape (at most {top:.4f})")
    for _ in range(iters):
        mid = (lo + hi) / 2
        if fn(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def solve_parameters(n_experts: int, top_k: int, knobs: Knobs, topk_mass: float = DEFAULT_TOPK_MASS) -> dict:
    """The generator's internal parameters for a shape (E experts, top-k) and knobs: ``sigma_b`` (spread of the
    popularity biases, in units of the noise's standard deviation), ``r1`` and ``r_persist`` (the noise correlation
    at lag 1 and :data:`PERSIST_LAG` that give ``overlap`` and ``persistence``), ``w`` (variance share of the
    per-prompt component) and ``rho`` (AR(1) coefficient of the rest), so that corr(lag) = w + (1 - w) rho^lag;
    ``c`` (correlation of adjacent layers' noise through the expert mapping); ``lam`` (the scores' logit scale).

    Solved by bisection on a fixed-seed Monte Carlo sample of 4,096 tokens (or token pairs) so that the population
    statistics equal the knobs (a ``persistence`` below what the AR(1) part alone gives, ``r1^16``, gets w = 0);
    cached per (E, k, knobs, topk_mass).

    Raises:
        ValueError: a bad knob or ``topk_mass`` (outside (k/E, 1)), or a knob this shape cannot reach (named).
    """
    knobs.validate()
    E, k = int(n_experts), int(top_k)
    if not 1 <= k < E:
        raise ValueError(f"synthetic routing needs 1 <= top_k < n_experts, got top_k {k} of {E}")
    if (isinstance(topk_mass, bool) or not isinstance(topk_mass, (int, float)) or not math.isfinite(topk_mass)
            or not k / E < topk_mass < 1):
        raise ValueError(f"'topk_mass' must be in (top_k / n_experts = {k / E:.4f}, 1), got {topk_mass!r}")
    key = (E, k, knobs, float(topk_mass))
    if key in _solved:
        return dict(_solved[key])
    rng = np.random.default_rng(_SOLVE_SEED)
    N = _SOLVE_SAMPLES
    q = _quantiles(E)
    u1 = rng.standard_normal((N, E)).astype(np.float32)
    eta = rng.standard_normal((N, E)).astype(np.float32)
    perm_b = rng.permutation(E)          # the next layer's popularity order
    mapping = rng.permutation(E)         # expert a of a layer drives expert mapping[a] of the next

    def share_at(sb):
        f = _inclusion(sb * q, u1, k)
        return top_share(f / f.sum(), 0.25)

    sigma_b = _bisect(share_at, knobs.skew, 0.0, 8.0, "skew")
    b1 = (sigma_b * q).astype(np.float32)
    s1 = _topk(b1 + u1, k)
    f1 = _inclusion(b1, u1, k)
    f1 /= f1.sum()
    chance = float(k * np.sum(f1 * f1))

    def lift_at(r):
        s2 = _topk(b1 + r * u1 + math.sqrt(max(0.0, 1 - r * r)) * eta, k)
        return lift(float(intersections(s1, s2).mean()) / k, chance)

    r1 = _bisect(lift_at, knobs.overlap, 0.0, 0.9999, "overlap") if knobs.overlap > 0 else 0.0
    rp = _bisect(lift_at, knobs.persistence, 0.0, r1, "persistence") if knobs.persistence > 0 else 0.0
    n = PERSIST_LAG
    if rp <= r1 ** n:
        w, rho = 0.0, r1
    else:  # w + (1 - w) ((r1 - w) / (1 - w))^n = rp, increasing in w on [0, rp]
        w = _bisect(lambda w_: w_ + (1 - w_) * ((r1 - w_) / (1 - w_)) ** n, rp, 0.0, rp, "persistence", 50)
        rho = (r1 - w) / (1 - w)
    b2 = b1[perm_b]
    inv = np.argsort(mapping)
    cross_chance = float(k * np.sum(f1 * f1[perm_b][mapping]))

    def cross_at(c):  # with the true mapping: the population value routing_stats's fitted mapping converges to
        u2 = (c * u1 + math.sqrt(max(0.0, 1 - c * c)) * eta)[:, inv]   # u2[:, mapping[a]] tracks u1[:, a]
        s2 = _topk(b2 + u2, k)
        return lift(float((mapping[s1][:, :, None] == s2[:, None, :]).any(axis=2).mean()), cross_chance)

    c = _bisect(cross_at, knobs.cross_layer, 0.0, 0.9999, "cross_layer") if knobs.cross_layer > 0 else 0.0
    x0 = b1 + u1
    x0 = x0 - x0.max(axis=1, keepdims=True)
    routed = np.zeros((N, E), bool)
    np.put_along_axis(routed, s1, True, axis=1)

    def mass_at(lam):
        p = np.exp(lam * x0)
        return float(((p * routed).sum(axis=1) / p.sum(axis=1)).mean())

    lam = _bisect(mass_at, topk_mass, 0.0, 50.0, "topk_mass")
    out = {"sigma_b": float(sigma_b), "r1": float(r1), "r_persist": float(rp), "w": float(w), "rho": float(rho),
           "c": float(c), "lam": float(lam)}
    _solved[key] = dict(out)
    return out


# ---- generator -----------------------------------------------------------------------------------------------------

def _resolve_shape(shape) -> tuple[str, ModelFacts]:
    if isinstance(shape, ModelFacts):
        shape.validate(f"model facts {shape.name}")
        return shape.name, shape
    if isinstance(shape, str) and shape in SHAPES:
        return shape, SHAPES[shape]
    raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")


def resolve_knobs(locality: Optional[str] = None, *, skew=None, overlap=None, persistence=None,
                  cross_layer=None) -> Knobs:
    """Knobs from a :data:`LOCALITY` preset (default ``"high"``), any of ``skew``, ``overlap``, ``persistence``,
    ``cross_layer`` given replacing the preset's. An ``overlap`` given without ``persistence`` scales the preset's
    persistence by overlap / the preset's overlap (0 when the preset has none).

    Raises:
        ValueError: an unknown locality, or a knob outside its range (named).
    """
    if locality is None:
        locality = "high"
    if not isinstance(locality, str) or locality not in LOCALITY:
        raise ValueError(f"unknown locality {locality!r} (known: {', '.join(LOCALITY)})")
    base = LOCALITY[locality]
    if persistence is None and overlap is not None:
        ok = isinstance(overlap, (int, float, np.integer, np.floating)) and not isinstance(overlap, bool)
        persistence = (base.persistence * overlap / base.overlap if ok and base.overlap > 0 and
                       math.isfinite(overlap) else 0.0)
    k = Knobs(skew=base.skew if skew is None else skew, overlap=base.overlap if overlap is None else overlap,
              persistence=base.persistence if persistence is None else persistence,
              cross_layer=base.cross_layer if cross_layer is None else cross_layer)
    k.validate()
    return k


def _prompt_offsets(n_tokens: int, n_prompts: int) -> np.ndarray:
    return np.round(np.linspace(0, n_tokens, n_prompts + 1)).astype(np.int64)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def synthetic_trace(shape: Union[str, ModelFacts], n_tokens: int, *, locality: Optional[str] = None,
                    skew: Optional[float] = None, overlap: Optional[float] = None,
                    persistence: Optional[float] = None, cross_layer: Optional[float] = None,
                    n_prompts: Optional[int] = None, seed: int = 0, topk_mass: float = DEFAULT_TOPK_MASS,
                    scores: bool = True) -> RoutingTrace:
    """A synthetic routing trace of a named shape (:data:`SHAPES`) or any :class:`ModelFacts`.

    ``n_tokens`` tokens in ``n_prompts`` prompts of (nearly) equal length (default :func:`default_prompts`: one per
    :data:`DEFAULT_PROMPT_TOKENS` tokens; each prompt restarts the temporal process, and few long prompts make the
    skew of a short trace come out higher, as with real prompts); knobs from ``locality`` (:data:`LOCALITY`,
    default ``"high"``) unless given (:class:`Knobs`, :func:`resolve_knobs`; :func:`routing_stats` measures them
    back); ``seed`` fixes everything (same seed, same trace). ``scores``: router scores ``[tokens, moe_layers, E]``
    under the stated score model with mean top-k softmax mass ``topk_mass`` (an ASSUMPTION, module docstring);
    False leaves them out (the simulator then scores activated experts 1/top_k).

    Returns a :class:`RoutingTrace`: ``expert_ids`` int16 ``[n_tokens, n_moe_layers, top_k]`` (each row k distinct
    ids, highest logit first), ``prompt_offsets``, ``expert_bytes`` (the facts' bytes per MoE layer),
    ``n_dense_layers``, ``moe_layer_ids``, ``model`` (the shape's name), ``facts``, ``gating`` (the facts'),
    ``router_scores`` (float32) and ``synthetic``: a dict with the generator version, shape, seed, knobs, the
    solved internal parameters and the score model (marked as an assumption); :meth:`RoutingTrace.save` keeps
    it all. Memory: about ``12 x n_tokens x n_moe_layers x E`` bytes while generating (DeepSeek-V3, 2,000 tokens:
    0.36 GB).

    Raises:
        ValueError: an unknown shape or locality; a knob, ``topk_mass``, ``n_tokens`` (< 2), ``n_prompts``
            (< 1 or > n_tokens / 2) or ``seed`` (not an integer >= 0) out of range, each named.
    """
    name, facts = _resolve_shape(shape)
    if not _is_int(n_tokens) or n_tokens < 2:
        raise ValueError(f"'n_tokens' must be an integer >= 2, got {n_tokens!r}")
    if n_prompts is None:
        n_prompts = default_prompts(n_tokens)
    if not _is_int(n_prompts) or not 1 <= n_prompts <= n_tokens // 2:
        raise ValueError(f"'n_prompts' must be an integer in 1..n_tokens/2 ({n_tokens // 2}), got {n_prompts!r}")
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"'seed' must be an integer >= 0, got {seed!r}")
    knobs = resolve_knobs(locality, skew=skew, overlap=overlap, persistence=persistence, cross_layer=cross_layer)
    L, E, k = facts.n_moe_layers, facts.n_experts, facts.top_k
    p = solve_parameters(E, k, knobs, topk_mass)
    rng = np.random.default_rng(seed)
    T, P = int(n_tokens), int(n_prompts)
    q = (p["sigma_b"] * _quantiles(E)).astype(np.float32)
    bias = np.stack([q[rng.permutation(E)] for _ in range(L)])                   # [L, E]
    inv_maps = [np.argsort(rng.permutation(E)) for _ in range(L - 1)]
    c, rho, w = p["c"], p["rho"], p["w"]
    sc, sr = math.sqrt(max(0.0, 1 - c * c)), math.sqrt(max(0.0, 1 - rho * rho))

    def layered(n):
        """unit Gaussian [n, L, E], adjacent layers correlated c through the expert mappings"""
        x = np.empty((n, L, E), np.float32)
        x[:, 0] = rng.standard_normal((n, E), dtype=np.float32)
        for layer in range(1, L):
            noise = sc * rng.standard_normal((n, E), dtype=np.float32)
            x[:, layer] = (c * x[:, layer - 1] + noise)[:, inv_maps[layer - 1]]
        return x

    u = layered(T)                                                                 # innovations
    prompt_part = layered(P)                                                       # one per prompt
    off = _prompt_offsets(T, P)
    starts, lens = off[:-1], np.diff(off)
    for j in range(1, int(lens.max(initial=0))):       # AR(1) within each prompt: position j of every prompt at once
        t = starts[lens > j] + j
        u[t] = u[t] * sr + rho * u[t - 1]
    u *= math.sqrt(1 - w)
    sw = math.sqrt(w)
    for p_i in range(P):                                                           # the per-prompt part
        u[off[p_i]:off[p_i + 1]] += sw * prompt_part[p_i]
    z = u
    z += bias[None]
    ids = _topk(z, k).astype(np.int16)
    router_scores = None
    gating = facts.gating
    if scores:
        x = z
        x *= p["lam"]
        if gating == "sigmoid":
            np.negative(x, out=x)
            np.exp(x, out=x)
            x += 1.0
            np.reciprocal(x, out=x)
        elif gating != "softmax_weight":                                           # softmax over all experts
            x -= x.max(axis=-1, keepdims=True)
            np.exp(x, out=x)
            x /= x.sum(axis=-1, keepdims=True)
        router_scores = x
    how = {"sigmoid": "sigmoid(lam z) (no selection bias, no group-limited routing)",
           "softmax_weight": "the raw logits lam z, as the trace format stores them for softmax_weight"}
    score_model = (f"ASSUMPTION (no measured scores): logits lam z, lam = {p['lam']:.4g} so that the mean softmax "
                   f"mass of the {k} routed experts is {topk_mass}; stored as "
                   f"{how.get(gating, 'softmax(lam z) over all experts')}" if scores else
                   "none: no scores generated (MRS scores activated experts 1/top_k)")
    synthetic = {"generator": SYNTH_FORMAT, "shape": name, "seed": int(seed), "n_prompts": P,
                 "locality": locality or "high", "knobs": asdict(knobs), "params": p, "topk_mass": float(topk_mass),
                 "score_model": score_model,
                 "routing_model": "z = b + u, top-k of z: per-layer popularity biases b (standard normal quantiles "
                                  "x sigma_b, permuted per layer); unit Gaussian noise u = sqrt(w) x a per-prompt "
                                  "part + sqrt(1 - w) x AR(1) in tokens (rho, restarted per prompt), adjacent layers' "
                                  "noise correlated c through a random expert mapping"}
    tr = RoutingTrace(expert_ids=ids, prompt_offsets=off, num_experts=E, top_k=k,
                      expert_bytes=facts.per_layer_expert_bytes(), n_dense_layers=facts.n_dense_layers,
                      moe_layer_ids=np.asarray(facts.moe_layer_ids or range(facts.n_dense_layers,
                                                                            facts.n_dense_layers + L), np.int64),
                      router_scores=router_scores, model=name, gating=gating, facts=facts, synthetic=synthetic)
    tr.validate(check_tokens=False)
    return tr
