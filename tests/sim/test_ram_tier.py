"""The simulator's RAM tier (a model larger than host RAM): conservation of disk bytes and faults, a RAM tier that
holds everything costs nothing, the disk model's bandwidth and latency, the presets behave as named, bad input is
refused, and ``hybrimoe simulate --moe-ram-cache``."""
import json
import math

import numpy as np
import pytest

from hybrimoe import _core
from hybrimoe import policy as pol
from hybrimoe.commands import simulate as simulate_command
from hybrimoe.policy.presets import RAM_BASELINES, RAM_PRESETS, build_ram_tier
from hybrimoe.sim.simulator import Setup
from hybrimoe.traces.synthetic import synthetic_trace

from .test_simulator import MB, _args, cfg, costs, quiet_truth, synthetic

N_LAYERS, N_EXP, K = 5, 16, 2


def disk_costs(bw=2e9, lat=1e-4, qd=4):
    c = costs()
    c.disk_bandwidth_Bps, c.disk_latency_s, c.disk_queue_depth = bw, lat, qd
    return c


def ram_cfg(reads="queued", keep=True, lookahead=0, ready_first=False):
    r = _core.RamTierConfig()
    r.reads, r.keep, r.lookahead, r.ready_first = reads, keep, lookahead, ready_first
    return r


def run(tr, ram_budget, ram, c=None, policy=None, fill=(), stage="decode", truth=None):
    """CPU only (an empty GPU cache): every activated expert is computed from RAM."""
    c = c or disk_costs()
    gpu = _core.ExpertCache([2 * MB] * N_LAYERS, N_EXP, 0.0, _core.LRUPolicy())
    rc = _core.ExpertCache([2 * MB] * N_LAYERS, N_EXP, ram_budget, policy or _core.LRUPolicy())
    if fill:
        rc.fill(list(fill))
    conf = cfg(stage)
    conf.ram = ram
    res = _core.simulate(tr, gpu, _core.HybriMoEScheduler(), _core.NoPrefetcher(), c, c, truth or quiet_truth(),
                         conf, 0, tr.n_prompts, rc)
    return res


def activations(rt, stage="decode", ubatch=64):
    """Activated (layer, expert) pairs per step: per decode token, or per prefill ubatch of each prompt."""
    out = 0
    for p in range(rt.n_prompts):
        b, e = int(rt.prompt_offsets[p]), int(rt.prompt_offsets[p + 1])
        step = 1 if stage == "decode" else ubatch
        for s in range(b, e, step):
            ids = rt.expert_ids[s:min(e, s + step)]
            out += sum(len(np.unique(ids[:, layer])) for layer in range(rt.n_layers))
    return out


@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_a_ram_tier_that_holds_every_expert_costs_nothing(stage):
    """Every expert resident from the start: no read, and the same simulated time as without a RAM tier, to the
    last bit (the RAM tier draws nothing from the truth model's generator)."""
    rt = synthetic()
    tr = rt.to_core()
    truth = _core.TruthModel()  # with noise: the draws must stay in the same order
    every = [layer * N_EXP + e for layer in range(N_LAYERS) for e in range(N_EXP)]
    full = run(tr, N_LAYERS * N_EXP * 2 * MB, ram_cfg(lookahead=3, ready_first=True), fill=every, stage=stage,
               truth=truth)
    gpu = _core.ExpertCache([2 * MB] * N_LAYERS, N_EXP, 0.0, _core.LRUPolicy())
    conf = cfg(stage)
    none = _core.simulate(tr, gpu, _core.HybriMoEScheduler(), _core.NoPrefetcher(), disk_costs(), disk_costs(),
                          truth, conf, 0, tr.n_prompts)
    assert full.bytes_disk == 0 and full.disk_reads == 0 and full.ram_cache.misses == 0
    assert full.ram_cache.accesses == activations(rt, stage)
    assert full.total_s == none.total_s and full.tokens == none.tokens


@pytest.mark.parametrize("reads", ["queued", "faulting"])
def test_without_ram_every_use_reads_its_expert(reads):
    """A RAM budget of 0: every activated expert is read for its use, whole; faulting reads fault 2 MB in
    128 KiB pieces; the disk moves every byte at its bandwidth."""
    rt = synthetic()
    res = run(rt.to_core(), 0.0, ram_cfg(reads))
    n = activations(rt)
    assert res.disk_reads == n and res.ram_cache.misses == n == res.ram_cache.accesses
    assert res.bytes_disk == pytest.approx(n * 2 * MB)
    assert res.disk_busy_s == pytest.approx(res.bytes_disk / 2e9)
    assert res.page_faults == (n * math.ceil(2 * MB / 131072) if reads == "faulting" else 0)
    assert res.total_s > res.disk_busy_s  # the CPU-only run waits for each read; nothing overlaps them here


def test_reads_are_charged_by_bandwidth_latency_and_queue_depth():
    """Queued reads of one layer overlap their latency up to the queue depth and share the bandwidth, so a deeper
    queue never costs more, and a faulting read (every 128 KiB fault pays the latency) costs the most."""
    tr = synthetic().to_core()
    t = {qd: run(tr, 0.0, ram_cfg(), c=disk_costs(lat=2e-3, qd=qd)).total_s for qd in (1, 2, 8)}
    assert t[8] <= t[2] < t[1]
    faulting = run(tr, 0.0, ram_cfg("faulting"), c=disk_costs(lat=2e-3, qd=1)).total_s
    assert faulting > t[1]
    slow = run(tr, 0.0, ram_cfg(), c=disk_costs(bw=0.5e9)).total_s
    assert slow > run(tr, 0.0, ram_cfg()).total_s


def test_faults_at_a_measured_throughput_move_at_it_with_no_latency_of_their_own():
    """fault_bandwidth_Bps (a decode's faults timed under memory pressure) replaces the disk's queued figures for
    faulting reads: each expert's bytes move at it, its latency already inside, so the disk is busy bytes / that
    throughput and a CPU-only run that waits for every fault takes the compute time plus exactly that; a lower
    fault throughput is a slower run, the bytes and faults unchanged; a negative one is refused."""
    rt = synthetic()
    tr = rt.to_core()
    c = disk_costs(lat=2e-3)
    plain = run(tr, 0.0, ram_cfg("faulting"), c=c)
    r = ram_cfg("faulting")
    r.fault_bandwidth_Bps = 0.5e9
    slow = run(tr, 0.0, r, c=c)
    every = [layer * N_EXP + e for layer in range(N_LAYERS) for e in range(N_EXP)]
    in_ram = run(tr, N_LAYERS * N_EXP * 2 * MB, ram_cfg("faulting"), c=c, fill=every)
    assert slow.bytes_disk == plain.bytes_disk and slow.page_faults == plain.page_faults
    assert slow.disk_busy_s == pytest.approx(slow.bytes_disk / 0.5e9)
    assert slow.total_s == pytest.approx(in_ram.total_s + slow.disk_busy_s, rel=1e-6)
    r.fault_bandwidth_Bps = 4e9
    fast = run(tr, 0.0, r, c=c)
    assert fast.bytes_disk == slow.bytes_disk and fast.total_s < slow.total_s
    # the queued model's latency per 128 KiB fault (2 ms here) is not charged on top
    assert fast.total_s < plain.total_s
    r.fault_bandwidth_Bps = -1.0
    with pytest.raises(ValueError, match="fault_bandwidth_Bps"):
        r.validate()


@pytest.mark.parametrize("reads", ["queued", "faulting"])
def test_a_tier_s_own_read_throughput_moves_its_reads(reads):
    """read_bandwidth_Bps (calibrate --disk's tier_read_Bps or buffered_read_Bps) replaces the disk's bandwidth for
    the tier's reads outside a decode's faults: the same bytes, the disk busy bytes / it in a prefill (queued reads
    and a prefill's faults alike), a slower run at a lower figure; 0 is the disk's; a negative one is refused."""
    tr = synthetic().to_core()
    c = disk_costs(bw=2e9, lat=0.0, qd=1)
    plain = run(tr, 0.0, ram_cfg(reads), c=c, stage="prefill")
    r = ram_cfg(reads)
    r.read_bandwidth_Bps = 0.5e9
    slow = run(tr, 0.0, r, c=c, stage="prefill")
    assert slow.bytes_disk == plain.bytes_disk > 0
    assert plain.disk_busy_s == pytest.approx(plain.bytes_disk / 2e9)
    assert slow.disk_busy_s == pytest.approx(slow.bytes_disk / 0.5e9)
    assert slow.total_s > plain.total_s
    r.read_bandwidth_Bps = 0.0
    assert run(tr, 0.0, r, c=c, stage="prefill").total_s == pytest.approx(plain.total_s)
    r.read_bandwidth_Bps = -1.0
    with pytest.raises(ValueError, match="read_bandwidth_Bps"):
        r.validate()


def test_a_fault_s_read_around_reads_its_window_and_keeps_the_neighbours_it_holds():
    """Without RAM every use faults its expert in. A read-around of 1.8 holds no neighbour mostly: each fault reads
    1.8 times the expert's bytes, in as many faults of fault_bytes as those need, all waste. A read-around of 5
    holds the neighbours e +- 1 and e +- 2: in a prefill, whose ubatches use most experts of a layer, they are kept
    and used (prefetch hits), so it reads far less than 5 times what a read-around of 1 reads."""
    rt = synthetic()
    tr = rt.to_core()
    one = run(tr, 0.0, ram_cfg("faulting"))
    r = ram_cfg("faulting")
    r.read_around = 1.8
    waste = run(tr, 0.0, r)
    n = activations(rt)
    assert waste.bytes_disk == pytest.approx(1.8 * one.bytes_disk) == pytest.approx(1.8 * n * 2 * MB)
    assert waste.disk_busy_s == pytest.approx(1.8 * one.disk_busy_s)
    assert waste.page_faults == n * math.ceil(1.8 * 2 * MB / 131072)
    assert waste.total_s > one.total_s and waste.ram_cache.prefetch_hits == 0
    budget = N_LAYERS * N_EXP * 2 * MB / 2
    plain = run(tr, budget, ram_cfg("faulting"), stage="prefill")
    r.read_around, r.fault_bytes = 5.0, 4 * 1024 * 1024
    wide = run(tr, budget, r, stage="prefill")
    assert wide.ram_cache.prefetch_hits > 0 and plain.ram_cache.prefetch_hits == 0
    assert plain.bytes_disk < wide.bytes_disk < 5 * plain.bytes_disk / 2


def test_a_faulting_sweep_reads_ahead_while_the_cpu_computes():
    """A prefill's CPU share runs its experts in index order, and the first use of a page read ahead starts the
    kernel's asynchronous read of the next window: the disk reads while the CPU computes, so the run takes less
    than computing from RAM plus the disk's time, and no less than either. Without read-around each expert's
    faults wait for its whole read: computing plus the disk's time."""
    rt = synthetic()
    tr = rt.to_core()
    c = disk_costs()
    c.cpu_a_s = 1e-3  # an expert computes about as long as its read (2 MB at 2 GB/s)
    every = [layer * N_EXP + e for layer in range(N_LAYERS) for e in range(N_EXP)]
    budget = N_LAYERS * N_EXP * 2 * MB
    in_ram = run(tr, budget, ram_cfg("faulting"), c=c, fill=every, stage="prefill")
    one = run(tr, budget, ram_cfg("faulting"), c=c, stage="prefill")
    r = ram_cfg("faulting")
    r.read_around, r.fault_bytes = 5.0, 4 * 1024 * 1024
    wide = run(tr, budget, r, c=c, stage="prefill")
    assert in_ram.bytes_disk == 0 and one.bytes_disk > 0 and wide.bytes_disk > 0
    assert one.total_s == pytest.approx(in_ram.total_s + one.disk_busy_s + one.page_faults * c.disk_latency_s,
                                        rel=0.05)
    assert max(in_ram.total_s, wide.disk_busy_s) <= wide.total_s < in_ram.total_s + wide.disk_busy_s
    assert wide.total_s < one.total_s and wide.ram_cache.prefetch_hits > 0


def test_the_page_cache_drops_the_weights_outside_the_experts_only_when_it_must():
    """Faulting reads with other_bytes: where the RAM budget holds every expert nothing is read again; where a
    token's reads exceed what the page cache holds, a layer's other weights are faulted in again before it runs:
    more bytes and faults, a slower run, and at most once per layer and token."""
    rt = synthetic()
    tr = rt.to_core()
    every = [layer * N_EXP + e for layer in range(N_LAYERS) for e in range(N_EXP)]
    r = ram_cfg("faulting")
    r.other_bytes = 1 * MB
    fits = run(tr, N_LAYERS * N_EXP * 2 * MB, r, fill=every)
    assert fits.bytes_disk == 0 and fits.page_faults == 0
    small = 2 * 2 * MB
    without = run(tr, small, ram_cfg("faulting"))
    with_other = run(tr, small, r)
    extra = with_other.bytes_disk - without.bytes_disk
    n_tok = rt.expert_ids.shape[0]
    assert with_other.ram_cache.misses == without.ram_cache.misses  # the same experts read, plus whole shares
    assert 0 < extra <= n_tok * N_LAYERS * 1 * MB and extra == pytest.approx(round(extra / MB) * MB)
    assert with_other.page_faults > without.page_faults and with_other.total_s > without.total_s


@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_the_reads_cpu_time_delays_the_cpu_share_by_at_most_its_total(stage):
    """Queued reads that cost the CPU share c seconds per byte: the run is slower than with free reads, by at most
    c x the bytes read (the share's waits for its reads absorb some of it); with every expert in RAM nothing is
    read and nothing changes."""
    rt = synthetic()
    tr = rt.to_core()
    c = disk_costs(bw=4e9)
    c.cpu_a_s = 3e-3  # the CPU share computes longer than the disk reads: read ahead runs beside it
    free = run(tr, 10 * 2 * MB, ram_cfg(lookahead=2, ready_first=True), c=c, policy=_core.MRSPolicy(), stage=stage)
    r = ram_cfg(lookahead=2, ready_first=True)
    r.read_cpu_s_per_byte = 1e-9
    paid = run(tr, 10 * 2 * MB, r, c=c, policy=_core.MRSPolicy(), stage=stage)
    assert paid.bytes_disk == free.bytes_disk > 0
    assert free.total_s < paid.total_s <= free.total_s + 1e-9 * paid.bytes_disk * (1 + 1e-9)
    assert paid.cpu_busy_s > free.cpu_busy_s
    every = [layer * N_EXP + e for layer in range(N_LAYERS) for e in range(N_EXP)]
    full_free = run(tr, N_LAYERS * N_EXP * 2 * MB, ram_cfg(), c=c, fill=every, stage=stage)
    full_paid = run(tr, N_LAYERS * N_EXP * 2 * MB, r, c=c, fill=every, stage=stage)
    assert full_paid.bytes_disk == 0 and full_paid.total_s == full_free.total_s


def test_a_disk_file_s_measured_facts_reach_the_ram_tier(tmp_path):
    """A disk file with calibrate --disk's measured facts: the faulting presets fault with its read-around and
    fault size; the queued ones pay its CPU time per byte."""
    base = json.loads((pol.hardware.DISK_DIR / "pcie4-nvme.json").read_text())
    doc = dict(base, facts=dict(base["facts"], **{
        "read_cpu_s_per_byte": {"value": 2e-10, "source": "test"},
        "mmap_read_around": {"value": 4.0, "source": "test"},
        "mmap_fault_bytes": {"value": 8 * 2**20, "source": "test"},
        "mmap_fault_Bps": {"value": 0.7e9, "source": "test"},
        "tier_read_Bps": {"value": 3.1e9, "source": "test"},
        "buffered_read_Bps": {"value": 1.4e9, "source": "test"}}))
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(doc))
    tr = synthetic_trace("qwen3-30b-a3b", 200, locality="high", seed=0)
    s = Setup(tr, pol.load_hardware("rtx4090-desktop"), "0", "decode", max_tokens=50, ram_cache="25%",
              disk=str(path))
    cache, cfg_m = s.build_ram("mmap")
    assert cfg_m.read_around == 4.0 and cfg_m.fault_bytes == 8 * 2**20 and cfg_m.read_cpu_s_per_byte == 0.0
    assert cfg_m.fault_bandwidth_Bps == 0.7e9
    assert cfg_m.other_bytes == pytest.approx(s.facts.moe_layer_other_bytes()) and cfg_m.other_bytes > 0
    assert cache.budget_bytes == pytest.approx(s.ram_budget)
    cache, cfg_h = s.build_ram("hybrimoe")
    assert cfg_h.read_cpu_s_per_byte == 2e-10 and cfg_h.read_around == 1.0 and cfg_h.other_bytes == 0.0
    assert cfg_h.fault_bandwidth_Bps == 0.0
    assert cache.budget_bytes == pytest.approx(s.ram_budget)
    # each preset reads at its own path's throughput: through the page cache, or hybrimoe's direct reads
    assert cfg_m.read_bandwidth_Bps == 1.4e9 and cfg_h.read_bandwidth_Bps == 3.1e9
    assert s.build_ram("prefetch-at-use")[1].read_bandwidth_Bps == 1.4e9
    assert s.build_ram("hybrimoe-exclusive")[1].read_bandwidth_Bps == 3.1e9
    plain = Setup(tr, pol.load_hardware("rtx4090-desktop"), "0", "decode", max_tokens=50, ram_cache="25%")
    _, cfg_p = plain.build_ram("mmap")
    assert cfg_p.read_around == 1.0 and cfg_p.fault_bytes == 131072.0 and cfg_p.fault_bandwidth_Bps == 0.0
    assert cfg_p.read_bandwidth_Bps == 0.0
    with_facts = s.run("hybrimoe", ram="mmap")
    without = plain.run("hybrimoe", ram="mmap")
    assert with_facts["bytes_disk"] > without["bytes_disk"]
    doc["facts"]["mmap_read_around"]["value"] = 0.5
    path.write_text(json.dumps(doc))
    with pytest.raises(pol.CostModelError, match="mmap_read_around"):
        pol.hardware.load_disk(str(path))


def test_a_static_set_keeps_nothing_it_reads_and_a_cache_keeps_what_fits():
    rt = synthetic()
    tr = rt.to_core()
    hot = [0 * N_EXP + 0, 1 * N_EXP + 0]
    static = run(tr, 4 * MB, ram_cfg("faulting", keep=False), policy=_core.StaticPolicy(hot, []), fill=hot)
    assert static.ram_cache.admissions == 0 and static.ram_cache.demand_hits > 0
    lru = run(tr, 40 * 2 * MB, ram_cfg("faulting"))  # half the experts: more than a token's 10
    assert lru.ram_cache.admissions > 0 and lru.ram_cache.demand_hits > 0
    assert lru.bytes_disk < run(tr, 0.0, ram_cfg("faulting")).bytes_disk


def test_the_lookahead_reads_ahead_and_is_used():
    """With look-ahead the predicted experts of the next layers are read while a layer computes (here the CPU takes
    longer per expert than the disk: the disk idles otherwise): some lookups hit an expert read ahead, and the run
    is faster than reading at use. Where the disk is the bottleneck, nothing is read ahead (the reads would delay
    the next layer's own)."""
    tr = synthetic().to_core()
    c = disk_costs(bw=4e9)
    c.cpu_a_s = 3e-3
    at_use = run(tr, 10 * 2 * MB, ram_cfg(), c=c, policy=_core.MRSPolicy())
    ahead = run(tr, 10 * 2 * MB, ram_cfg(lookahead=2, ready_first=True), c=c, policy=_core.MRSPolicy())
    assert ahead.ram_prefetch_issued > 0 and ahead.ram_cache.prefetch_hits > 0
    assert ahead.bytes_disk_prefetch > 0 and at_use.bytes_disk_prefetch == 0
    assert ahead.total_s < at_use.total_s
    bound = run(tr, 10 * 2 * MB, ram_cfg(lookahead=2, ready_first=True), c=disk_costs(bw=1e9),
                policy=_core.MRSPolicy())
    assert bound.ram_prefetch_issued == 0


def test_bad_ram_tier_inputs():
    tr = synthetic().to_core()
    for field, value, word in (("reads", "mmap", "reads"), ("lookahead", -1, "lookahead"),
                               ("fault_bytes", 100.0, "fault_bytes"), ("read_around", 0.5, "read_around"),
                               ("read_cpu_s_per_byte", -1e-9, "read_cpu_s_per_byte"),
                               ("read_cpu_s_per_byte", float("nan"), "read_cpu_s_per_byte"),
                               ("other_bytes", -1.0, "other_bytes"), ("other_bytes", float("inf"), "other_bytes")):
        r = ram_cfg()
        setattr(r, field, value)
        with pytest.raises(ValueError, match=word):
            r.validate()
    with pytest.raises(ValueError, match="needs queued reads"):
        ram_cfg("faulting", lookahead=1).validate()
    with pytest.raises(ValueError, match="disk figures"):
        run(tr, 4 * MB, ram_cfg(), c=costs())
    gpu = _core.ExpertCache([2 * MB] * N_LAYERS, N_EXP, 0.0, _core.LRUPolicy())
    with pytest.raises(ValueError, match="another ExpertCache"):
        _core.simulate(tr, gpu, _core.HybriMoEScheduler(), _core.NoPrefetcher(), disk_costs(), disk_costs(),
                       quiet_truth(), cfg(), 0, tr.n_prompts, gpu)
    wrong = _core.ExpertCache([2 * MB] * 3, N_EXP, 4 * MB, _core.LRUPolicy())
    with pytest.raises(ValueError, match="does not match the trace"):
        _core.simulate(tr, gpu, _core.HybriMoEScheduler(), _core.NoPrefetcher(), disk_costs(), disk_costs(),
                       quiet_truth(), cfg(), 0, tr.n_prompts, wrong)
    with pytest.raises(ValueError, match="unknown RAM-tier preset 'swap'"):
        build_ram_tier("swap", [2 * MB] * N_LAYERS, N_EXP, 4 * MB)
    with pytest.raises(ValueError, match="hot_keys"):
        build_ram_tier("hot-set", [2 * MB] * N_LAYERS, N_EXP, 4 * MB)


def test_setup_runs_every_ram_preset_and_records_the_tier():
    tr = synthetic_trace("qwen3-30b-a3b", 500, locality="high", seed=0)
    s = Setup(tr, pol.load_hardware("rtx4090-desktop"), "0", "decode", max_tokens=150, ram_cache="25%")
    assert s.ram_budget == pytest.approx(0.25 * s.total_bytes) and s.disk.name == "pcie4-nvme"
    assert s.planner.has_disk and s.truth_cost.has_disk
    recs = {r: s.run("hybrimoe", ram=r) for r in RAM_PRESETS}
    for name, rec in recs.items():
        assert rec["ram_policy"] == name and rec["bytes_disk"] > 0 and rec["tokens"] == 150
        assert "ram_tier" in rec["assumptions"] and rec["moe_ram_cache"] == "25%"
    assert recs["mmap"]["page_faults"] > 0 and recs["hybrimoe"]["page_faults"] == 0
    assert recs["hybrimoe"]["ram_prefetch_issued"] > 0 and recs["prefetch-at-use"]["ram_prefetch_issued"] == 0
    assert s.run("hybrimoe")["ram_policy"] == "hybrimoe" and s.run("oracle")["ram_policy"] == "oracle"
    plain = Setup(tr, pol.load_hardware("rtx4090-desktop"), "0", "decode", max_tokens=150)
    assert "ram_policy" not in plain.run("hybrimoe")
    with pytest.raises(ValueError, match="no RAM tier"):
        plain.run("hybrimoe", ram="mmap")
    with pytest.raises(ValueError, match="unknown disk"):
        Setup(tr, pol.load_hardware("rtx4090-desktop"), "0", "decode", ram_cache="25%", disk="floppy")
    assert set(RAM_BASELINES) == {"mmap", "hot-set", "prefetch-at-use"}


def test_simulate_command_with_a_ram_tier(tmp_path, capsys):
    path = tmp_path / "t.npz"
    synthetic_trace("mixtral-8x7b", 300, locality="high", seed=1).save(path)
    out = tmp_path / "r.json"
    rc = simulate_command.run(_args(trace=path, moe_cache="0", moe_ram_cache="50%", disk="pcie5-nvme",
                                    ram_policies="hybrimoe,mmap", max_tokens=100, json=out, no_progress=True))
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    recs = json.loads(out.read_text())
    assert [(r["policy"], r["ram_policy"]) for r in recs] == [("hybrimoe", "hybrimoe"), ("hybrimoe", "mmap")]
    assert all(r["disk"] == "pcie5-nvme" for r in recs) and "RAM policy" in text and "disk pcie5-nvme" in text
    for bad, word in ((dict(ram_policies="mmap,swap"), "swap"), (dict(moe_ram_cache="200%"), "0..100"),
                      (dict(disk="floppy"), "floppy")):
        kw = dict(trace=path, moe_ram_cache="50%", no_progress=True)
        kw.update(bad)
        assert simulate_command.run(_args(**kw)) == 2
        assert word in capsys.readouterr().err
    for alone in (dict(disk="pcie4-nvme"), dict(ram_policies="mmap")):
        assert simulate_command.run(_args(trace=path, no_progress=True, **alone)) == 2
        assert "needs --moe-ram-cache" in capsys.readouterr().err


def _two_tier_run(s, ram):
    """(GPU cache, RAM cache, result) of hybrimoe's GPU tier over RAM preset ``ram`` on Setup ``s``, the caches
    kept to be looked at after the run."""
    cache, sched, pre, conf = s.build("hybrimoe", ram)
    ram_cache, conf.ram = s.build_ram(ram)
    if conf.ram.exclusive:
        s._start_exclusive(cache, ram_cache, ram)
    res = _core.simulate(s.core_trace, cache, sched, pre, s.planner, s.truth_cost, s.truth, conf, s.first, s.end,
                         ram_cache)
    return cache, ram_cache, res


def _both(s, gpu, ram):
    L, E = s.trace.n_layers, s.trace.num_experts
    return sum(1 for k in range(L * E) if gpu.resident(k // E, k % E) and ram.resident(k // E, k % E))


def test_exclusive_tiers_hold_each_expert_once_and_copy_the_gpu_s_evictions_back():
    """Exclusive tiers (RamTierConfig.exclusive, the hybrimoe-exclusive preset): after the run no expert is in both
    the GPU cache and the RAM tier, the GPU's evictions came back to RAM (demotions, their bytes one expert each),
    and with the two budgets no longer overlapping fewer bytes are read from the disk than with inclusive tiers,
    which (the control) end with experts in both."""
    tr = synthetic_trace("qwen3-30b-a3b", 500, locality="high", seed=0)
    s = Setup(tr, pol.load_hardware("rtx4090-desktop"), "15%", "decode", max_tokens=300, ram_cache="30%")
    gpu_x, ram_x, ex = _two_tier_run(s, "hybrimoe-exclusive")
    gpu_i, ram_i, inc = _two_tier_run(s, "hybrimoe")
    assert _both(s, gpu_x, ram_x) == 0
    assert _both(s, gpu_i, ram_i) > 0
    eb = np.asarray(s.expert_bytes)
    assert ex.demotions > 0 and ex.demotions * eb.min() <= ex.bytes_demoted <= ex.demotions * eb.max()
    assert inc.demotions == 0 and inc.bytes_demoted == 0
    assert ex.bytes_disk < inc.bytes_disk
    rec = s.run("hybrimoe", ram="hybrimoe-exclusive")
    assert rec["demotions"] == ex.demotions and rec["ram_policy"] == "hybrimoe-exclusive"


@pytest.mark.parametrize("ram", ["prefetch-at-use", "hybrimoe-exclusive"])
def test_a_gpu_prefetch_of_an_expert_on_disk_reads_nothing(ram):
    """The engine's rule (Engine::Placement::load): a GPU prefetch or fill of an expert whose weights are not in RAM
    copies nothing and starts no disk read; its GPU slot waits for the expert's first use, whose read and copy run
    then. With a RAM tier that reads nothing ahead (prefetch-at-use) every disk read is then a use's RAM miss
    (inclusive and exclusive tiers alike), while the GPU still prefetches the experts that are in RAM."""
    tr = synthetic_trace("qwen3-30b-a3b", 300, locality="high", seed=0)
    s = Setup(tr, pol.load_hardware("rtx4090-desktop"), "15%", "decode", max_tokens=200, ram_cache="20%")
    _, _, res = _two_tier_run(s, ram)
    assert res.prefetch_issued > 0 and res.disk_reads > 0
    if ram == "prefetch-at-use":
        assert res.disk_reads == res.ram_cache.misses
    else:  # the hybrimoe tier's own look-ahead reads ahead of use too; nothing else reads
        assert res.disk_reads <= res.ram_cache.misses + res.ram_prefetch_issued


def test_a_demoted_expert_enters_ram_only_over_lower_ranked_residents():
    """ExpertCache.admit_demoted: into a full RAM cache it displaces only a resident ranked below it (MRS scores
    set by hand), never one ranked above; with room it always enters."""
    c = _core.ExpertCache([1.0] * 2, 4, 2.0, _core.MRSPolicy())
    pol_ = c.policy
    assert c.admit_demoted(0, 0, 0.0) and c.admit_demoted(0, 1, 0.0)  # room for two
    pol_.set_score(0, 0, 0.9)
    pol_.set_score(0, 1, 0.5)
    pol_.set_score(0, 2, 0.1)
    pol_.set_score(0, 3, 0.7)
    assert not c.admit_demoted(0, 2, 0.0)  # below both residents: refused, nothing evicted
    assert c.resident(0, 0) and c.resident(0, 1) and not c.resident(0, 2)
    assert c.admit_demoted(0, 3, 0.0)  # above the lowest (0.5): it goes
    assert c.resident(0, 3) and c.resident(0, 0) and not c.resident(0, 1)


def test_exclusive_tiers_need_queued_reads():
    r = ram_cfg(reads="faulting")
    r.exclusive = True
    with pytest.raises(ValueError, match="exclusive needs queued reads"):
        r.validate()
