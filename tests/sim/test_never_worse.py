"""hybrimoe is never slower than static placement, nor its RAM tier than the ways users run a model larger than RAM
today, and the clairvoyant bounds bound (simulation).

For every trace (the shared DeepSeek-V2-Lite routing when present, and synthetic traces of the shapes of
Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 and gpt-oss-120b at low and high temporal locality), seed (0, 1, 2: the
synthetic trace, the truth model's noise and the predictor), hardware preset (paper-a6000, rtx4090-desktop, h200),
cache size (10, 25, 50, 75%) and stage (decode: TPOT, prefill: TTFT), on the first 2,000 tokens:

- hybrimoe's time is at most 1.01 x the best static placement's (every preset whose cache is static: nothing is
  loaded at run time);
- the ``oracle`` bound is at least as fast as hybrimoe and every static placement, on seed 0's table of each trace
  (every hardware preset, cache size and stage; the oracle costs about twice hybrimoe's simulation, so seeds 1 and 2
  leave it out; tests/sim/test_bounds.py checks it against every policy on random small traces). The oracle is the
  fastest of several plans (hybrimoe.sim.simulator.Setup.run); here it stops at the first plan that is already
  within the check's tolerance (total_times' ``bound_tolerance``), which gives every check the verdict the fastest
  plan would, and where none is, every plan runs and a failure reports the bound itself.

Several GPUs (2x-rtx3090, 4x-rtx3090; a cache per GPU), for the shared trace and the synthetic shapes above plus
Qwen3-235B-A22B and GLM-4.5-Air (high locality), every cache size per GPU and stage, seed 0, 1,000 tokens: hybrimoe
is at most 1.01 x the best of upstream's layer split with the best --n-cpu-moe, each GPU's last or leading layers
that fit, and each GPU's hot set.

The RAM tier (a model larger than host RAM; CPU only, so that only the RAM tier differs): for the shared trace and
synthetic traces of the shapes above and Kimi-K2's (384 experts), at low and high locality, seed 0, rtx4090-desktop
with the PCIe 4.0 disk, RAM for 25, 50 and 75% of the routed experts, both stages, on the first 1,000 tokens:

- hybrimoe's RAM tier (MRS, router look-ahead reads) is at most 1.01 x the best of upstream's mmap (an LRU page
  cache, faulting reads), a static hot set pinned in RAM, and ik_llama.cpp-style reads at the layer of use
  (hybrimoe.policy.presets.RAM_BASELINES);
- the RAM tier's ``oracle`` (a Belady RAM cache and a look-ahead that knows the routing, or the better of two such
  plans) bounds them all, to 0.1% (RAM_BOUND_TOLERANCE says why not to rounding).

The synthetic traces' router scores are an assumption (hybrimoe.traces.synthetic); the truth model charges host-memory
contention per overlapped second while the planner charges a fixed share of each copy (policy.cost_model_from_hardware,
policy.truth_model_for), so the planner is not judged by its own formula.
"""
from __future__ import annotations

import os

import pytest

from hybrimoe import policy as pol
from hybrimoe.testing.tables import TablePool

HARDWARE = ("paper-a6000", "rtx4090-desktop", "h200")
CACHES = ("10%", "25%", "50%", "75%")
SEEDS = (0, 1, 2)
TOKENS = 2000
STATIC = pol.STATIC_PRESETS
#: the oracle may exceed the best of the others by this relative rounding margin and still bound them
BOUND_TOLERANCE = 1e-9
#: runs where hybrimoe is known to be more than 1% slower than the best static placement: (shape, locality, seed,
#: hardware, cache, stage) -> the ratio measured when it was listed. An entry that stops failing fails the test
#: (remove it then). Empty since demand loads in large ubatches stream (policy.STREAMING_FRACTION): before, gpt-oss-
#: shaped routing without locality at a 75% cache in prefill on rtx4090-desktop was 1.09x the profiled hot set.
KNOWN_SHORTFALLS: dict = {}
TRACES = [("dsv2lite", None)] + [(shape, loc) for shape in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3",
                                                            "gpt-oss-120b") for loc in ("low", "high")]


def _trace(shape, locality, seed, request):
    """The trace spec (hybrimoe.testing.tables) of one table: the shared trace (the ``dev_trace`` fixture, which
    skips without it), or a synthetic one of the shape."""
    if locality is None:
        return ("file", str(request.getfixturevalue("dev_trace")))
    # enough prompts after the simulator's 20% profile for 2,000 evaluated tokens
    return ("synthetic", shape, TOKENS * 5 // 4 + 200, locality, seed)


def _workers() -> int:
    """Processes for the tables: the machine's cores (``HYBRIMOE_TEST_WORKERS`` overrides; 1 runs in this process)."""
    return max(1, int(os.environ.get("HYBRIMOE_TEST_WORKERS", os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """One pool of workers for every table of this module (hybrimoe.testing.tables.TablePool): each synthetic trace
    is built once, by a worker, while the others simulate."""
    pool = TablePool(_workers(), tmp_path_factory.mktemp("never-worse-traces"))
    yield pool
    pool.close()


def _tables(pool, jobs):
    """``total_times`` of each job ``(trace spec, hw, cache, stage, names, kwargs)``, in order."""
    return pool.run(jobs, max_tokens=TOKENS)


CONFIGS = [(hw, cache, stage) for hw in HARDWARE for cache in CACHES for stage in ("decode", "prefill")]


@pytest.mark.parametrize("shape,locality", TRACES, ids=[f"{s}-{loc or 'real'}" for s, loc in TRACES])
def test_hybrimoe_never_slower_than_static_and_the_oracle_bounds(tables, shape, locality, request):
    assert len(STATIC) >= 2, STATIC
    worse, unbounded = [], []
    keys, jobs = [], []
    for seed in SEEDS:
        tr = _trace(shape, locality, seed, request)
        names = ("hybrimoe",) + STATIC + (("oracle",) if seed == 0 else ())
        for hw_name, cache, stage in CONFIGS:
            keys.append((seed, hw_name, cache, stage))
            jobs.append((tr, hw_name, cache, stage, names,
                         dict(seed=seed + 1, bound_tolerance=BOUND_TOLERANCE if seed == 0 else None)))
    for (seed, hw_name, cache, stage), t in zip(keys, _tables(tables, jobs)):
        best_static = min(t[p] for p in STATIC)
        where = f"seed {seed} {hw_name} {cache} {stage}"
        known = (shape, locality, seed, hw_name, cache, stage) in KNOWN_SHORTFALLS
        if (t["hybrimoe"] > 1.01 * best_static) != known:
            worse.append(f"{where}: hybrimoe {t['hybrimoe']:.4g} s vs best static {best_static:.4g} s"
                         + (" (a known shortfall that no longer fails: remove it)" if known else ""))
        if "oracle" in t and t["oracle"] > min(t["hybrimoe"], best_static) * (1 + BOUND_TOLERANCE):
            unbounded.append(f"{where}: oracle {t['oracle']:.4g} s vs {min(t['hybrimoe'], best_static):.4g} s")
    assert not worse, f"{shape} {locality}: hybrimoe slower than static placement in {len(worse)} runs: " + \
        "; ".join(worse[:10])
    assert not unbounded, f"{shape} {locality}: the oracle is not a bound in {len(unbounded)} runs: " + \
        "; ".join(unbounded[:10])


@pytest.mark.parametrize("scale", [0.5, 1.5])
@pytest.mark.parametrize("shape,locality", [("dsv2lite", None), ("mixtral-8x7b", "low"), ("mixtral-8x7b", "high")],
                         ids=["dsv2lite-real", "mixtral-8x7b-low", "mixtral-8x7b-high"])
def test_never_slower_when_the_truth_contention_differs_from_the_planners(tables, shape, locality, scale, request):
    """The planner charges a fixed share of each copy to the CPU share (cost_model_from_hardware's
    cpu_copy_overlap); the truth charges contention per overlapped second. With the truth's contention at 0.5x and
    1.5x the preset's value hybrimoe still stays within 1.01 x the best static placement (seed 0)."""
    tr = _trace(shape, locality, 0, request)
    assert all(pol.truth_model_for(pol.load_hardware(hw), 1).contention > 0 for hw in HARDWARE)
    worse = []
    jobs = [(tr, hw, cache, stage, ("hybrimoe",) + STATIC, dict(seed=1, contention_scale=scale))
            for hw, cache, stage in CONFIGS]
    for (hw_name, cache, stage), t in zip(CONFIGS, _tables(tables, jobs)):
        best_static = min(t[p] for p in STATIC)
        if t["hybrimoe"] > 1.01 * best_static:
            worse.append(f"{hw_name} {cache} {stage}: {t['hybrimoe']:.4g} s vs {best_static:.4g} s")
    assert not worse, f"contention x{scale}: " + "; ".join(worse)


MULTI_HARDWARE = ("2x-rtx3090", "4x-rtx3090")
MULTI_TOKENS = 1000
MULTI_TRACES = [("dsv2lite", None)] + [(shape, loc) for shape in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3",
                                                                  "gpt-oss-120b") for loc in ("low", "high")] + \
    [("qwen3-235b-a22b", "high"), ("glm-4.5-air", "high")]


@pytest.mark.parametrize("shape,locality", MULTI_TRACES, ids=[f"{s}-{loc or 'real'}" for s, loc in MULTI_TRACES])
def test_several_gpus_never_slower_than_the_placements_users_run(tables, shape, locality, request):
    """Several GPUs (hardware files 2x-rtx3090 and 4x-rtx3090: a cache per GPU, each MoE layer on the GPU llama.cpp's
    layer split gives it; docs/design.md §19), every cache size per GPU and stage, seed 0, first 1,000 tokens:
    hybrimoe is at most 1.01 x the best of upstream's -ts with the best --n-cpu-moe N (upstream-ts-ncmoe), each
    GPU's last or leading layers that fit (upstream-ncmoe, ktransformers: per-GPU -ot rules) and each GPU's profiled
    hot set, at the same VRAM per GPU."""
    from hybrimoe.sim.simulator import TS_NCMOE

    assert all(pol.load_hardware(h).facts["gpu_count"] > 1 for h in MULTI_HARDWARE)
    names = ("hybrimoe",) + STATIC + (TS_NCMOE,)
    tr = _trace(shape, locality, 0, request)
    configs = [(hw, cache, stage) for hw in MULTI_HARDWARE for cache in CACHES for stage in ("decode", "prefill")]
    jobs = [(tr, hw, cache, stage, names, dict(seed=1)) for hw, cache, stage in configs]
    worse = []
    for (hw, cache, stage), t in zip(configs, tables.run(jobs, max_tokens=MULTI_TOKENS)):
        best = min(t[p] for p in names[1:])
        if t["hybrimoe"] > 1.01 * best:
            worse.append(f"{hw} {cache} {stage}: hybrimoe {t['hybrimoe']:.4g} s vs best placement {best:.4g} s ({t})")
    assert not worse, f"{shape} {locality}: " + "; ".join(worse)


RAM_CACHES = ("25%", "50%", "75%")
#: where the CPU is the bottleneck (Mixtral-shaped prefill: every plan reads every expert ahead in time and the CPU
#: computes the same experts) the RAM oracle's plans and hybrimoe's differ by where the truth model's noise lands,
#: about 0.03% measured; the RAM bound is checked to 0.1%, not to rounding
RAM_TOKENS = 1000
RAM_HARDWARE, RAM_DISK = "rtx4090-desktop", "pcie4-nvme"
RAM_BOUND_TOLERANCE = 1e-3
RAM_TRACES = [("dsv2lite", None)] + [(shape, loc) for shape in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3",
                                                                "kimi-k2", "gpt-oss-120b") for loc in ("low", "high")]


@pytest.mark.parametrize("shape,locality", RAM_TRACES, ids=[f"{s}-{loc or 'real'}" for s, loc in RAM_TRACES])
def test_the_ram_tier_is_never_slower_than_mmap_a_hot_set_or_reads_at_use(tables, shape, locality, request):
    baselines = pol.RAM_BASELINES
    assert set(baselines) == {"mmap", "hot-set", "prefetch-at-use"}
    tr = _trace(shape, locality, 0, request)
    configs = [(ram, stage) for ram in RAM_CACHES for stage in ("decode", "prefill")]
    jobs = [(tr, RAM_HARDWARE, "0", stage, ("hybrimoe",) + baselines + ("oracle",),
             dict(seed=1, ram_cache=ram, disk=RAM_DISK, bound_tolerance=RAM_BOUND_TOLERANCE))
            for ram, stage in configs]
    worse, unbounded = [], []
    for (ram, stage), t in zip(configs, tables.run(jobs, max_tokens=RAM_TOKENS)):
        best = min(t[p] for p in baselines)
        if t["hybrimoe"] > 1.01 * best:
            worse.append(f"RAM {ram} {stage}: hybrimoe {t['hybrimoe']:.4g} s vs best baseline {best:.4g} s ({t})")
        if t["oracle"] > min(t["hybrimoe"], best) * (1 + RAM_BOUND_TOLERANCE):
            unbounded.append(f"RAM {ram} {stage}: oracle {t['oracle']:.4g} s vs {min(t['hybrimoe'], best):.4g} s")
    assert not worse, f"{shape} {locality}: the RAM tier slower than a baseline: " + "; ".join(worse)
    assert not unbounded, f"{shape} {locality}: the RAM oracle is not a bound: " + "; ".join(unbounded)


THREE_TIER_TRACES = [("dsv2lite", None), ("qwen3-30b-a3b", "high")]
THREE_TIER_GPU_CACHE = "10%"


@pytest.mark.parametrize("shape,locality", THREE_TIER_TRACES,
                         ids=[f"{s}-{loc or 'real'}" for s, loc in THREE_TIER_TRACES])
def test_a_gpu_cache_over_exclusive_tiers_is_never_slower_than_another_combination(tables, shape, locality, request):
    """Three tiers (a GPU cache of 10% of the routed experts above a RAM tier of 25, 50 and 75%, disk pcie4-nvme,
    rtx4090-desktop, decode and prefill): hybrimoe's GPU cache over its exclusive RAM tier (``hybrimoe-exclusive``)
    is at most 1.01 x every other combination of a GPU preset (hybrimoe's, and each static placement) and a RAM
    preset (upstream's mmap, a hot set, reads at use, hybrimoe's inclusive tier), among them upstream-ncmoe over
    mmap and a static GPU set over hybrimoe's own RAM tier. The full table (bench/bench_never_worse.py
    --ram-caches, docs/benchmarks.md) has no row of 126 outside this (worst 0.993x, with the GPU cache's MRS at
    alpha 0.01 above exclusive tiers)."""
    tr = _trace(shape, locality, 0, request)
    ram_names = tuple(pol.RAM_BASELINES) + ("hybrimoe",)
    configs = [(ram, stage) for ram in RAM_CACHES for stage in ("decode", "prefill")]
    gpus = ("hybrimoe",) + STATIC
    jobs = [(tr, RAM_HARDWARE, THREE_TIER_GPU_CACHE, stage,
             ram_names + (("hybrimoe-exclusive",) if g == "hybrimoe" else ()),
             dict(seed=1, ram_cache=ram, disk=RAM_DISK, gpu_preset=g))
            for ram, stage in configs for g in gpus]
    times = tables.run(jobs, max_tokens=RAM_TOKENS)
    worse = []
    for i, (ram, stage) in enumerate(configs):
        t = {(g, r): s for g, res in zip(gpus, times[i * len(gpus):(i + 1) * len(gpus)]) for r, s in res.items()}
        ours = t.pop(("hybrimoe", "hybrimoe-exclusive"))
        best = min(t, key=t.get)
        if ours > 1.01 * t[best]:
            worse.append(f"RAM {ram} {stage}: {ours:.4g} s vs {best[0]} / {best[1]} {t[best]:.4g} s")
    assert not worse, f"{shape} {locality}: " + "; ".join(worse)
