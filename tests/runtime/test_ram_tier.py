"""The RAM expert tier (``Llama(moe_ram_cache=...)``): routed experts read from the GGUF file into RAM slots, the CPU
share computed over them.

Oracle: upstream llama.cpp on the CPU with the tier's placement: the routed experts in the file's layout, as the
tier's slots keep them (``lazy_experts=True``, patch 0007: they stay in the model's mapping, which llama.cpp never
repacks; ``-ot exps=CPU`` would not do: upstream's loader takes the CPU's repacked buffer type for an override to
the CPU), the other CPU weights as users run them (repacked where this CPU repacks them), the same tokens: same greedy tokens and bit-identical logits, at the smallest budget the
tier takes (every layer's experts evict another layer's, so experts are read from the file every token). With
``HYBRIMOE_RAM_REPACK=1`` the tier repacks each expert after its read: upstream's default placement is the oracle;
with ``no_repack`` on both sides, the file's layout everywhere. Residency: mincore(2) on the model's mapping (hybrimoe.testing.residency)."""
from __future__ import annotations

import errno
import os
import re
import shutil
import threading

import numpy as np
import pytest

from hybrimoe.runtime.disk_calibration import drop_from_page_cache
from hybrimoe.testing.fixtures import ENGINE_ARCHS
from hybrimoe.testing.residency import cold_expert_pages, resident_pages
from hybrimoe.testing.upstream import decode_together, greedy_with_logits, prompt_tokens

N_GEN = 12
QUANTS = ("Q8_0", "Q4_K_M", "mix")
UBATCHES = (1, 7, 64)


def _kw(ub=64, **kw):
    d = dict(n_ctx=512, n_batch=64, n_ubatch=ub, seed=0, verbose=False)
    d.update(kw)
    return d


def _min_budget(path, ub) -> int:
    """Bytes of the smallest RAM budget for ubatches of ``ub`` tokens (hybrimoe.runtime.ram_tier.min_ram_slots)."""
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.ram_tier import min_ram_slots

    f = engine_facts(path)
    return min_ram_slots(f, ub) * f.ram_slot_bytes


def _reference(path, tokens, ub, repacked_experts=False, **kw):
    """Upstream's greedy tokens and logits with the tier's placement: the experts in the file's layout (left in the
    mapping), unless ``repacked_experts`` (upstream's default: repacked where ggml-cpu repacks them)."""
    from hybrimoe import Llama

    if not repacked_experts:
        kw.setdefault("lazy_experts", True)
    ref = Llama(str(path), **_kw(ub, **kw))
    try:
        return greedy_with_logits(ref, tokens, N_GEN)
    finally:
        ref.close()


def _ram_run(path, tokens, ub, budget=None, **kw):
    from hybrimoe import Llama

    llm = Llama(str(path), moe_ram_cache=_min_budget(path, ub) if budget is None else budget,
                moe_cost_model="rtx4090-desktop", **_kw(ub, **kw))
    try:
        out, lg = greedy_with_logits(llm, tokens, N_GEN)
        return out, lg, llm.moe_stats()["engine"]
    finally:
        llm.close()


def _tokens(path, n):
    from hybrimoe import Llama

    llm = Llama(str(path), vocab_only=True, verbose=False)
    try:
        return prompt_tokens(llm, n)
    finally:
        llm.close()


def _cases():
    from allpairspy import AllPairs

    return [pytest.param(*c, id="-".join(map(str, c))) for c in AllPairs([list(ENGINE_ARCHS), list(QUANTS),
                                                                          list(UBATCHES)])]


@pytest.mark.parametrize("arch, quant, ub", _cases())
def test_reads_every_token_and_matches_upstream(arch, quant, ub, tiny_model):
    """At the smallest budget: upstream's greedy tokens and logits bit for bit, while experts are read from the
    file during the decode (at least one read per generated token, and evictions)."""
    path = tiny_model(arch, quant)
    tokens = _tokens(path, 2 * ub + 3)
    ref_out, ref_lg = _reference(path, tokens, ub)
    out, lg, st = _ram_run(path, tokens, ub)
    ram = st["ram"]
    assert out == ref_out
    assert np.array_equal(lg, ref_lg)
    assert ram["demand_reads"] + ram["prefetch_reads"] >= N_GEN and ram["evictions"] > 0, ram
    assert ram["reads_in_flight"] == 0
    assert st["gpu_experts"] == 0


@pytest.mark.parametrize("repack_env, no_repack", [("", False), ("1", False), ("1", True), ("0", True)])
@pytest.mark.parametrize("quant", ["Q4_0", "Q4_K_M"])
def test_slots_are_repacked_only_when_asked(quant, repack_env, no_repack, tiny_model, monkeypatch):
    """By default the slots keep the file's layout and the CPU share runs the plain kernels on them: upstream's
    numbers with the experts in plain CPU buffers. With ``HYBRIMOE_RAM_REPACK=1`` the tier repacks each expert after
    its read where upstream's load repacks CPU weights, and runs the repacked kernels: upstream's numbers with its
    default placement. With no_repack on both sides, the file's layout and plain kernels whatever the variable."""
    from hybrimoe.runtime.engine_facts import cpu_repacked_types

    monkeypatch.setenv("HYBRIMOE_RAM_REPACK", repack_env)
    path = tiny_model("qwen3moe", quant)
    tokens = _tokens(path, 19)
    want = repack_env == "1" and not no_repack and bool({"Q4_0", "Q4_K"} & set(cpu_repacked_types()))
    ref_out, ref_lg = _reference(path, tokens, 7, repacked_experts=repack_env == "1", no_repack=no_repack)
    out, lg, st = _ram_run(path, tokens, 7, no_repack=no_repack)
    assert out == ref_out and np.array_equal(lg, ref_lg)
    assert any(any(r) for r in st["repacked"]) == want, st["repacked"]
    assert st["ram"]["demand_reads"] + st["ram"]["prefetch_reads"] > 0  # experts went through the reads


def test_weights_outside_the_experts_never_fault(tiny_model):
    """With the RAM tier the weights outside the routed experts are read into RAM at load (``use_mmap`` defaults to
    False): once the file has left the page cache, prefill and decode take no major page fault (the experts come
    through the tier's reads). Negative control: with the mapping kept (``use_mmap=True``), the same run faults
    those weights back in."""
    import resource

    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q4_K_M")
    tokens = _tokens(path, 40)
    faults = {}
    for use_mmap in (None, True):
        kw = {} if use_mmap is None else {"use_mmap": True}
        llm = Llama(str(path), moe_ram_cache="100%", moe_cost_model="rtx4090-desktop", **_kw(64, **kw))
        try:
            assert llm.uses_mmap == (use_mmap is True)
            drop_from_page_cache(path)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            greedy_with_logits(llm, tokens, 8)
            faults[use_mmap] = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before
        finally:
            llm.close()
    assert faults[None] == 0, faults
    assert faults[True] > 0, faults


_CGROUP_CHILD = """
import json, resource, sys
from hybrimoe import Llama
from hybrimoe.runtime.disk_calibration import drop_from_page_cache
from hybrimoe.testing.upstream import greedy_with_logits, prompt_tokens
path, mmap = sys.argv[1], sys.argv[2] == "1"
llm = Llama(path, moe_ram_cache="auto", moe_cost_model="rtx4090-desktop", n_ctx=512, n_batch=64, n_ubatch=64,
            seed=0, verbose=False, **({"use_mmap": True} if mmap else {}))
tokens = prompt_tokens(llm, 40)
drop_from_page_cache(path)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
out, _ = greedy_with_logits(llm, tokens, 8)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0
ram = llm.moe_stats()["engine"]["ram"]
llm.close()
print("ROW " + json.dumps({"faults": faults, "out": out, "budget": ram["moe_ram_cache"], "misses": ram["misses"]}))
"""


def test_weights_outside_the_experts_never_fault_under_a_memory_cgroup(tiny_model):
    """The same under a memory cgroup (hybrimoe.runtime.cgroup.MemoryCgroup, 1 GiB, which counts the page cache
    too), with ``moe_ram_cache="auto"``: the budget comes from the cgroup (its message says so), prefill and decode
    take no major page fault (every one would be a weight outside the experts: the tier's reads are O_DIRECT), and
    the greedy tokens are those of the run with the mapping kept, the negative control, which faults. Skipped where
    this process may not make a memory cgroup."""
    import json
    import subprocess
    import sys

    from hybrimoe.runtime.cgroup import MemoryCgroup

    path = tiny_model("qwen3moe", "Q4_K_M")
    try:
        cg = MemoryCgroup(1 << 30)
    except OSError as e:
        pytest.skip(f"no memory cgroup here: {e}")
    rows = {}
    try:
        for mmap in ("0", "1"):
            r = subprocess.run([sys.executable, "-c", _CGROUP_CHILD, str(path), mmap], preexec_fn=cg.enter,
                               capture_output=True, text=True, timeout=300)
            got = [ln[4:] for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
            assert r.returncode == 0 and got, r.stderr[-2000:]
            rows[mmap] = json.loads(got[0])
    finally:
        cg.close()
    assert "cgroup" in rows["0"]["budget"], rows["0"]["budget"]
    assert rows["0"]["faults"] == 0, rows
    assert rows["1"]["faults"] > 0, rows
    assert rows["0"]["out"] == rows["1"]["out"]


@pytest.mark.parametrize("quant", ["Q8_0", "MXFP4"])
def test_gpt_oss_biases_come_with_the_slot(quant, tmp_path_factory, tiny_model):
    """gpt-oss: expert biases (ggml_add_id, indexed by RAM slot) and SwiGLU-OAI, Q8_0 or MXFP4 matrices."""
    from hybrimoe.tiny import make_tiny_model

    if quant == "Q8_0":
        path = tiny_model("gpt-oss", "Q8_0")
    else:
        path = make_tiny_model(tmp_path_factory.mktemp("mxfp4") / "gpt-oss-mxfp4.gguf", "gpt-oss",
                               quant={"base": "Q8_0", r"ffn_(gate|up|down)_exps": "MXFP4"})
    tokens = _tokens(path, 20)
    ref_out, ref_lg = _reference(path, tokens, 7)
    out, lg, st = _ram_run(path, tokens, 7)
    assert out == ref_out
    assert np.array_equal(lg, ref_lg)
    assert st["ram"]["misses"] > 0


@pytest.mark.parametrize("variant", [
    dict(arch="llama4", n_layer=4, n_expert=6, n_expert_used=2, n_shared=1),            # weights before the FFN
    dict(arch="deepseek2", n_layer=3, n_expert=6, n_expert_used=2, n_shared=1, fused_gate_up=True),
    dict(arch="qwen3moe", n_expert=8, n_expert_used=2, expert_scales=True),           # per-expert scales
], ids=["weight-before", "fused-gate-up", "scales"])
def test_expert_variants_match_upstream(variant, tmp_path):
    from hybrimoe.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "variant.gguf", quant="Q8_0", **variant)
    tokens = _tokens(path, 17)
    ref_out, ref_lg = _reference(path, tokens, 7)
    out, lg, st = _ram_run(path, tokens, 7)
    assert out == ref_out
    assert np.array_equal(lg, ref_lg)
    assert st["ram"]["misses"] > 0


@pytest.mark.parametrize("arch, ub", [("qwen3moe", 1), ("deepseek2", 7), ("gpt-oss", 1)])
def test_two_passes_over_one_layer_match_upstream(arch, ub, tiny_model):
    """With half the experts in RAM a layer's CPU share runs in two passes: the experts in RAM at its plan while the
    others are read, then those. Upstream's tokens and logits bit for bit, with both passes computing experts in
    the same layers (the RAM tier both hit and missed)."""
    path = tiny_model(arch, "Q4_K_M")
    tokens = _tokens(path, 2 * ub + 5)
    ref_out, ref_lg = _reference(path, tokens, ub)
    out, lg, st = _ram_run(path, tokens, ub, budget="50%")
    assert out == ref_out
    assert np.array_equal(lg, ref_lg)
    assert 0 < st["ram"]["hit_rate"] < 1, st["ram"]
    both = [s for s in st["layers"] if 0 < s["cpu_late_experts"] < s["cpu_experts"]]
    assert both, [(s["cpu_late_experts"], s["cpu_experts"]) for s in st["layers"]]


@pytest.mark.parametrize("env, two", [("0", False), ("1", True), (None, True)])
def test_one_pass_or_two(env, two, tiny_model, monkeypatch):
    """HYBRIMOE_RAM_TWO_PASS: 0 one pass after every read; 1 or unset two passes. The numbers are the same; the
    second pass computes experts only in two-pass runs."""
    if env is None:
        monkeypatch.delenv("HYBRIMOE_RAM_TWO_PASS", raising=False)
    else:
        monkeypatch.setenv("HYBRIMOE_RAM_TWO_PASS", env)
    path = tiny_model("qwen3moe", "Q4_K_M")
    tokens = _tokens(path, 7)
    ref_out, ref_lg = _reference(path, tokens, 1)
    out, lg, st = _ram_run(path, tokens, 1, budget="50%")
    assert out == ref_out and np.array_equal(lg, ref_lg)
    assert st["ram"]["demand_reads"] > 0
    assert (st["cpu_late_experts"] > 0) == two, st["cpu_late_experts"]


def test_a_bad_two_pass_setting_is_refused(tiny_model, monkeypatch):
    monkeypatch.setenv("HYBRIMOE_RAM_TWO_PASS", "sometimes")
    with pytest.raises(ValueError, match="HYBRIMOE_RAM_TWO_PASS"):
        _ram_run(tiny_model("qwen3moe", "Q4_K_M"), [1, 2, 3], 1, budget="50%")


@pytest.mark.parametrize("policy, prefetch", [("lru", 3), ("mrs", 0), ("lfu", 1)])
def test_every_policy_and_prefetch_depth_matches_upstream(policy, prefetch, tiny_model):
    path = tiny_model("qwen3moe", "Q8_0")
    tokens = _tokens(path, 15)
    ref_out, ref_lg = _reference(path, tokens, 7)
    out, lg, st = _ram_run(path, tokens, 7, moe_ram_policy=policy, moe_prefetch_layers=prefetch)
    assert out == ref_out
    assert np.array_equal(lg, ref_lg)
    assert st["ram"]["policy"] == policy
    if prefetch == 0:
        assert st["ram"]["prefetch_reads"] == 0
    else:
        assert st["ram"]["prefetch_reads"] > 0, st["ram"]


@pytest.mark.parametrize("policy", [None, "lru", "lfu", "object"])
def test_the_engines_ram_cache_is_the_simulators_preset(policy, tiny_model, monkeypatch):
    """The engine's RAM cache is built as the simulator's hybrimoe RAM preset (build_ram_tier): TinyLFU admission,
    LIP insertion of a prefill's demand reads, and MRS at RAM_MRS_ALPHA (an observed score moves by alpha)."""
    from hybrimoe import _core
    from hybrimoe.policy import RAM_MRS_ALPHA, STREAMING_FRACTION, build_ram_tier
    from hybrimoe.runtime.engine_facts import engine_module
    from hybrimoe.runtime.setup import ram_cache_policy

    mod = engine_module()
    real, seen = mod.Engine, {}

    class Capture:  # the Engine class, recording the RAM cache it is built with
        def __call__(self, *a, **kw):
            seen["cache"] = kw.get("ram_cache")
            return real(*a, **kw)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(mod, "Engine", Capture())
    obj = _core.LRUPolicy() if policy == "object" else None
    path = tiny_model("qwen3moe", "Q8_0")
    out, _, st = _ram_run(path, _tokens(path, 9), 7, moe_ram_policy=obj if obj is not None else policy)
    assert out, st
    rc = seen["cache"]
    assert rc.frequency_admission
    assert rc.streaming_demand == STREAMING_FRACTION
    sim, _ = build_ram_tier("hybrimoe", [1.0], 4, 2.0)
    assert sim.frequency_admission == rc.frequency_admission
    assert sim.streaming_demand == rc.streaming_demand
    if obj is not None:
        assert rc.policy is obj  # the caller's object itself
    else:
        assert rc.policy.name() == (policy or "mrs")
    if policy is None:
        # one observation of expert 1 with score 1.0 from 0 moves its score by alpha (MRS's S <- alpha * s + (1 -
        # alpha) * S), in the engine's policy object (its run has ended) as in a fresh default one
        assert type(rc.policy) is type(ram_cache_policy(None)) is _core.MRSPolicy
        mrs = rc.policy
        mrs.reset(1, 4)
        obs = _core.LayerObservation()
        obs.layer, obs.n_tokens, obs.top_k, obs.n_experts = 0, 1, 1, 4
        obs.experts, obs.loads, obs.scores = [1], [1], [0.0, 1.0, 0.0, 0.0]
        mrs.observe(obs)
        assert mrs.score(0, 1) == pytest.approx(RAM_MRS_ALPHA)


def test_two_sequences_in_one_batch_match_upstream(tiny_model):
    """n_seq = 2: two sequences decoded together, each step's logits of both bit-identical to upstream's."""
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    prompts = [_tokens(path, 9), _tokens(path, 13)[2:]]
    ref = Llama(str(path), n_seq_max=2, **_kw(7))
    try:
        want = decode_together(ref, prompts, 6)
    finally:
        ref.close()
    llm = Llama(str(path), moe_ram_cache=_min_budget(path, 7), n_seq_max=2, moe_cost_model="rtx4090-desktop",
                **_kw(7))
    try:
        have = decode_together(llm, prompts, 6)
        st = llm.moe_stats()["engine"]["ram"]
    finally:
        llm.close()
    assert st["misses"] > 0
    for a, b in zip(want, have):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_split_model_reads_from_each_shard(tiny_model, tmp_path):
    """A split GGUF (model-0000N-of-0000M.gguf): the experts are read from the shard that holds them."""
    from hybrimoe.tiny import split_gguf

    path = tiny_model("qwen3moe", "Q8_0")
    first = split_gguf(path, tmp_path / "split.gguf", n_shards=3)
    tokens = _tokens(path, 15)
    ref_out, ref_lg = _reference(path, tokens, 7)
    out, lg, st = _ram_run(first, tokens, 7)
    assert out == ref_out
    assert np.array_equal(lg, ref_lg)
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.ram_tier import expert_file_ranges

    files = expert_file_ranges(engine_facts(first))["files"]
    assert len(files) > 1, files


@pytest.fixture(scope="module")
def big_model(tiny_model):
    # 16 experts of 256 x 1024 F16 (512 KiB per matrix): most expert pages lie beyond what the header's parse reads
    return tiny_model("qwen3moe", "F16", n_embd=256, n_ff_exp=1024, n_expert=16)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_the_engine_leaves_no_expert_page_in_the_page_cache(big_model, direct, monkeypatch):
    """After loading and decoding, the experts' file pages are no more resident than hybrimoe's own header check
    leaves them (the tier reads with O_DIRECT, or with buffered reads and drops what it read): the RAM the experts
    use is the tier's."""
    from hybrimoe import Llama

    monkeypatch.setenv("HYBRIMOE_RAM_DIRECT_IO", "1" if direct else "0")

    pages, by_check, total = cold_expert_pages(big_model)
    llm = Llama(str(big_model), moe_ram_cache="50%", moe_cost_model="rtx4090-desktop", **_kw(7))
    try:
        tokens = prompt_tokens(llm, 15)
        greedy_with_logits(llm, tokens, 8)
        resident, _ = resident_pages(big_model, pages)
        st = llm.moe_stats()["engine"]["ram"]
    finally:
        llm.close()
    assert st["bytes_read"] > 0
    if not direct:
        assert st["direct_matrices"] == 0
    elif st["direct_matrices"] == 0:
        pytest.skip("this file system takes no O_DIRECT reads (tmpfs?): the buffered case covers it")
    if len(by_check) > total // 4:
        pytest.skip("this file system keeps dropped pages (tmpfs?): residency cannot be told")
    assert resident <= by_check, f"{len(resident - by_check)} of {total} expert pages left in the page cache"


def test_a_read_error_names_the_file_and_offset(tiny_model):
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), moe_ram_cache=_min_budget(path, 7), moe_cost_model="rtx4090-desktop", **_kw(7))
    try:
        tokens = prompt_tokens(llm, 9)
        llm.moe_engine.ram_inject_read_error(errno.EIO, 1)
        with pytest.raises(RuntimeError, match=r"offset \d+ of .*" + os.path.basename(path) + ".*Input/output error"):
            llm.eval(tokens)
        llm.moe_engine.ram_inject_read_error(0)
        llm.reset()
        out, _ = greedy_with_logits(llm, tokens, 4)  # the next decode reads again, and works
    finally:
        llm.close()
    ref_out, _ = _reference(path, tokens, 7)
    assert out == ref_out[:4]


def test_a_file_truncated_while_running_is_a_clear_error(tiny_model, tmp_path):
    """The file cut short under a running model: the reads past its end are named, no crash, no output (the
    weights outside the experts were read into RAM: use_mmap=False)."""
    from hybrimoe import Llama

    path = tmp_path / "m.gguf"
    shutil.copy(tiny_model("qwen3moe", "Q8_0"), path)
    llm = Llama(str(path), moe_ram_cache=_min_budget(path, 7), use_mmap=False, moe_prefetch_layers=0,
                moe_cost_model="rtx4090-desktop", **_kw(7))
    try:
        tokens = prompt_tokens(llm, 9)
        os.truncate(path, os.path.getsize(path) // 3)
        with pytest.raises(RuntimeError, match=r"m\.gguf.*(ends there|truncated|changed while the model runs)"):
            for _ in range(4):
                llm.eval(tokens)
                llm.reset()
    finally:
        llm.close()


def test_a_file_written_in_place_while_running_is_a_clear_error(tiny_model, tmp_path):
    """Bytes of the file overwritten in place (same size: a copy over it) under a running model: the next ubatch
    stops with an error naming the file instead of computing with other weights."""
    from hybrimoe import Llama

    path = tmp_path / "m.gguf"
    shutil.copy(tiny_model("qwen3moe", "Q8_0"), path)
    llm = Llama(str(path), moe_ram_cache=_min_budget(path, 7), moe_cost_model="rtx4090-desktop", **_kw(7))
    try:
        tokens = prompt_tokens(llm, 9)
        llm.eval(tokens)
        llm.reset()
        size = os.path.getsize(path)
        with open(path, "r+b") as f:  # the last tenth of the file (expert data) replaced, the size kept
            f.seek(size - size // 10)
            f.write(bytes(size // 10))
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a clock too coarse to move it is not tested
        with pytest.raises(RuntimeError, match=r"m\.gguf changed while the model runs: it was modified"):
            llm.eval(tokens)
    finally:
        llm.close()


def test_a_file_changed_since_the_load_is_refused(tiny_model, tmp_path, monkeypatch):
    """The tier checks each file's size and modification time when it opens it: another file is refused."""
    from hybrimoe import Llama
    from hybrimoe.runtime import ram_tier

    path = tmp_path / "m.gguf"
    shutil.copy(tiny_model("qwen3moe", "Q8_0"), path)
    real = ram_tier.expert_file_ranges

    def stale(facts):
        r = real(facts)
        r["mtimes_ns"] = [m - 10**9 for m in r["mtimes_ns"]]  # as if the file had been replaced after the stat
        return r

    monkeypatch.setattr(ram_tier, "expert_file_ranges", stale)
    with pytest.raises(RuntimeError, match=r"m\.gguf changed: it was modified"):
        Llama(str(path), moe_ram_cache=_min_budget(path, 7), moe_cost_model="rtx4090-desktop", **_kw(7))


def test_budgets_out_of_range_are_refused_with_the_numbers(tiny_model):
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.ram_tier import machine_memory, ram_slots

    path = tiny_model("qwen3moe", "Q8_0")
    f = engine_facts(path)
    with pytest.raises(ValueError, match=rf"holds {f.n_expert - 1} experts.*route to {f.n_expert} experts.*at least "
                                         rf"{f.n_expert * f.ram_slot_bytes} bytes"):
        Llama(str(path), moe_ram_cache=(f.n_expert - 1) * f.ram_slot_bytes, **_kw(64))
    mem = machine_memory()
    with pytest.raises(ValueError, match=rf"{mem['total'] + 1} bytes, more than the {mem['total']} bytes"):
        ram_slots(mem["total"] + 1, f, 64, memory=mem)
    with pytest.raises(ValueError, match="moe_ram_cache"):
        Llama(str(path), moe_ram_cache="lots", **_kw(64))
    # the tier has no "no cache": 0 is below the minimum, and the message does not offer it
    with pytest.raises(ValueError, match="smaller than one expert") as e:
        ram_slots(f.ram_slot_bytes - 1, f, 64, memory=mem)
    assert "use 0" not in str(e.value)
    with pytest.raises(ValueError, match="holds 0 experts|smaller than one expert"):
        ram_slots(0, f, 64, memory=mem)
    # a float below 1 is a share written as bytes: refused with the percentage it meant
    with pytest.raises(ValueError, match=r"'50%'"):
        Llama(str(path), moe_ram_cache=0.5, **_kw(64))
    with pytest.raises(ValueError, match=r"'50%'"):  # as a command line gives it
        ram_slots("0.5", f, 64, memory=mem)
    with pytest.raises(ValueError, match=r"moe_cache: .*'25%'"):
        Llama(str(path), moe_cache="0.25", **_kw(64))
    # at n_ubatch 1 no smaller ubatch would help
    with pytest.raises(ValueError) as e:
        ram_slots((f.top_k - 1) * f.ram_slot_bytes, f, 1, memory=mem)
    assert "smaller n_ubatch" not in str(e.value)


def test_options_that_do_not_go_with_the_ram_tier_are_refused(tiny_model):
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    with pytest.raises(ValueError, match="use_mlock"):
        Llama(str(path), moe_ram_cache="100%", use_mlock=True, **_kw())
    with pytest.raises(ValueError, match="moe_ram_policy set without moe_ram_cache"):
        Llama(str(path), moe_ram_policy="lru", **_kw())
    with pytest.raises(ValueError, match="belady"):
        Llama(str(path), moe_ram_cache="100%", moe_ram_policy="belady", **_kw())
    # a GPU cache above the RAM tier needs an accelerator (tests/runtime/test_ram_tier_gpu.py runs it on one)
    with pytest.raises(ValueError, match="accelerator"):
        Llama(str(path), moe_ram_cache="100%", moe_cache="50%", **_kw())


def test_auto_budget_fits_the_machine(tiny_model):
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), moe_ram_cache="auto", moe_cost_model="rtx4090-desktop", **_kw(7))
    try:
        ram = llm.moe_stats()["engine"]["ram"]
        assert ram["moe_ram_cache"].startswith("auto: ") and "bytes available" in ram["moe_ram_cache"]
        greedy_with_logits(llm, prompt_tokens(llm, 9), 2)
    finally:
        llm.close()
    # a tiny model fits whole: every expert has a slot
    from hybrimoe.runtime.engine_facts import engine_facts

    f = engine_facts(path)
    assert ram["n_slots"] == len(f.moe_layers) * f.n_expert


def test_auto_budget_leaves_room_for_the_staging_buffers(tiny_model):
    """"auto" subtracts the I/O workers' O_DIRECT staging buffers (one largest matrix plus 8 KiB each, in whole 2 MiB
    huge pages): with the memory for exactly 5 slots beyond the margin, the other weights and the staging, 5 slots;
    one byte less, 4."""
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.ram_tier import AUTO_MARGIN_MIN_BYTES, IO_THREADS, auto_ram_slots, staging_bytes

    f = engine_facts(tiny_model("qwen3moe", "Q8_0"))
    staging = staging_bytes(f)
    huge = 2 << 20
    assert staging == IO_THREADS * -(-(max(max(eb) for eb in f.expert_bytes) + 8192) // huge) * huge
    other = 12345
    avail = AUTO_MARGIN_MIN_BYTES + staging + other + 5 * f.ram_slot_bytes  # the margin is its minimum here
    mem = dict(total=2 * avail, source="test")
    got, why = auto_ram_slots(f, 1, other, memory=dict(mem, available=avail))
    assert got == 5 and f"{staging} for the I/O workers" in why
    assert auto_ram_slots(f, 1, other, memory=dict(mem, available=avail - 1))[0] == 4


def test_close_returns_with_reads_queued(big_model):
    """close() right after a decode that queued read-ahead: returns (the queue is dropped, reads in flight end)."""
    from hybrimoe import Llama

    llm = Llama(str(big_model), moe_ram_cache=_min_budget(big_model, 7), moe_cost_model="rtx4090-desktop",
                moe_prefetch_layers=3, **_kw(7))
    drop_from_page_cache(big_model)
    llm.eval(prompt_tokens(llm, 7))
    t = threading.Thread(target=llm.close)
    t.start()
    t.join(60)
    assert not t.is_alive(), "close() hung with reads queued"


def test_ctrl_c_while_the_tier_reads_exits_promptly(big_model, tmp_path):
    """A real SIGINT to `hybrimoe run --moe-ram-cache` while it generates (every token reads experts from the file,
    reads ahead are queued): exit 130 within seconds, no traceback. Python takes the signal between two decodes
    (llama_decode is not interrupted), so what is measured is that the interrupt's close() drops the queued reads
    and joins the I/O workers instead of waiting on them."""
    import select
    import signal
    import subprocess
    import sys
    import time

    from hybrimoe.testing.processes import default_signals

    budget = str(_min_budget(big_model, 7))
    drop_from_page_cache(big_model)
    proc = subprocess.Popen([sys.executable, "-m", "hybrimoe", "run", "-m", str(big_model), "--moe-ram-cache", budget,
                             "--moe-cost-model", "rtx4090-desktop", "-ub", "7", "-c", "4096", "-n", "4000", "--temp",
                             "0", "-p", "Once upon a time"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=tmp_path, preexec_fn=default_signals)
    got = b""
    deadline = time.monotonic() + 300
    try:
        while len(got) < 16 and time.monotonic() < deadline:  # generation is under way
            if select.select([proc.stdout], [], [], 5)[0]:
                chunk = os.read(proc.stdout.fileno(), 64)
                if not chunk:
                    break
                got += chunk
        assert len(got) >= 16, proc.stderr.read().decode(errors="replace")[-2000:]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode(errors="replace")
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert took < 30, f"exit took {took:.1f} s after SIGINT"


def test_run_command_takes_the_flag(tiny_model, tmp_path):
    """``hybrimoe run --moe-ram-cache``: the tokens of ``--no-repack`` upstream, and the tier's line in the stats."""
    import json
    import subprocess
    import sys

    path = tiny_model("qwen3moe", "Q8_0")

    def run(*extra):
        r = subprocess.run([sys.executable, "-m", "hybrimoe", "run", "-m", str(path), "-p", "Once upon a time", "-n",
                            "8", "--temp", "0", "-ub", "7", "--output-format", "json", *extra], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["tokens"], r.stderr

    want, _ = run("--no-repack")
    have, err = run("--moe-ram-cache", str(_min_budget(path, 7)), "--moe-stats", "--moe-cost-model",
                    "rtx4090-desktop")
    assert have == want
    assert "RAM tier hit rate" in err, err
    # no GPU cache: the engine line says so instead of a GPU hit rate of 0 and a GPU preset
    assert "no GPU cache, every expert on the CPU" in err and "hit rate 0.000" not in err, err
    # the second pass's count: some experts were read during the decode at this budget, and computed after
    assert re.search(r"; [1-9]\d* of \d+ CPU experts computed in the second pass", err), err


@pytest.mark.parametrize("arch, quant", [("qwen3moe", "Q8_0"), ("deepseek2", "Q4_0")])
def test_direct_reads_land_in_the_slots(arch, quant, tiny_model):
    """Experts whose matrices are whole multiples of 4 KiB (as in real models) are read by O_DIRECT straight into
    their RAM slots, each matrix at its tensor's file offset modulo 4 KiB (the tensors start on 32-byte boundaries),
    with no staging buffer and no copy: at the smallest budget, upstream's tokens and logits bit for bit, and every
    direct read in place. Control: the default tiny shapes (not multiples of 4 KiB) go through staging."""
    from hybrimoe.runtime.engine_facts import engine_facts

    path = tiny_model(arch, quant, n_embd=256, n_ff_exp=256)
    f = engine_facts(path)
    assert all(b % 4096 == 0 for eb in f.expert_bytes for b in eb if b), f.expert_bytes
    tokens = _tokens(path, 9)
    want, want_lg = _reference(path, tokens, 7)
    have, have_lg, st = _ram_run(path, tokens, 7)
    assert have == want
    assert np.array_equal(have_lg, want_lg)
    ram = st["ram"]
    assert ram["direct_matrices"] > 0 and ram["in_place_matrices"] == ram["direct_matrices"], ram
    small = tiny_model(arch, quant)
    assert any(b % 4096 for eb in engine_facts(small).expert_bytes for b in eb)
    _, _, st = _ram_run(small, _tokens(small, 9), 7)
    assert st["ram"]["direct_matrices"] > 0 and st["ram"]["in_place_matrices"] == 0, st["ram"]


def test_repacked_slots_of_page_sized_experts_match_upstream(tiny_model, monkeypatch):
    """With HYBRIMOE_RAM_REPACK=1, experts whose matrices are whole 4 KiB pages are read through staging and repacked
    into their slots from the slot's start (no file-offset phase): upstream's default numbers bit for bit."""
    from hybrimoe.runtime.engine_facts import cpu_repacked_types, engine_facts

    monkeypatch.setenv("HYBRIMOE_RAM_REPACK", "1")
    path = tiny_model("deepseek2", "Q4_0", n_embd=256, n_ff_exp=256)
    assert all(b % 4096 == 0 for eb in engine_facts(path).expert_bytes for b in eb if b)
    tokens = _tokens(path, 9)
    want, want_lg = _reference(path, tokens, 7, repacked_experts=True)
    have, have_lg, st = _ram_run(path, tokens, 7)
    assert have == want
    assert np.array_equal(have_lg, want_lg)
    repacks = "Q4_0" in cpu_repacked_types()
    assert any(any(r) for r in st["repacked"]) == repacks, st["repacked"]
    assert (st["ram"]["in_place_matrices"] < st["ram"]["direct_matrices"]) == repacks, st["ram"]


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_buffered_reads_match_upstream(arch, tiny_model, monkeypatch):
    """With HYBRIMOE_RAM_DIRECT_IO=0 (buffered reads, the fallback where a file system refuses O_DIRECT), at the
    smallest budget: upstream's tokens and logits bit for bit, and no matrix read directly."""
    monkeypatch.setenv("HYBRIMOE_RAM_DIRECT_IO", "0")
    path = tiny_model(arch, "Q8_0")
    tokens = _tokens(path, 9)
    want, want_lg = _reference(path, tokens, 7)
    have, have_lg, st = _ram_run(path, tokens, 7)
    assert have == want
    assert np.array_equal(have_lg, want_lg)
    assert st["ram"]["bytes_read"] > 0 and st["ram"]["direct_matrices"] == 0


def test_prefill_reads_the_next_layers_whole(tiny_model):
    """A 64-token ubatch routes to nearly every expert of a layer (an expert stays unused with probability
    (1 - k/E)^64 under uniform routing), so the look-ahead reads the next layers' experts whole while a layer
    computes: only the first MoE layer's experts are demand reads, and the tokens stay upstream's."""
    from hybrimoe.runtime.engine_facts import engine_facts

    path = tiny_model("qwen3moe", "Q8_0", n_expert=32)
    f = engine_facts(path)
    assert len(f.moe_layers) >= 2
    tokens = _tokens(path, 64)
    want, _ = _reference(path, tokens, 64)
    have, _, st = _ram_run(path, tokens, 64, budget="100%")
    assert have == want
    ram = st["ram"]
    assert ram["prefetch_reads"] > 0 and ram["demand_reads"] <= f.n_expert, ram
    _, _, off = _ram_run(path, tokens, 64, budget="100%", moe_prefetch_layers=0)
    assert off["ram"]["prefetch_reads"] == 0 and off["ram"]["demand_reads"] > f.n_expert


def test_prefill_reads_ahead_past_a_full_tier(tiny_model):
    """Once the slots are full, a prefill's reads ahead still go through: every expert of the next layer is used
    there, so the cache's frequency admission (which keeps a read ahead from evicting an expert used at least as
    often: in a first prefill every resident was used once, every newcomer not yet) must not refuse them; a refusal
    only moves the read to the layer's start, where the CPU waits for it. Only the first MoE layer's experts are
    demand reads, at a budget of three layers' experts, and the tokens and logits stay upstream's."""
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts

    path = tiny_model("qwen3moe", "Q8_0", n_expert=32, n_layer=6)
    f = engine_facts(path)
    assert len(f.moe_layers) >= 5  # more layers than the slots hold, so the prefill must evict
    tokens = _tokens(path, 64)
    want, want_lg = _reference(path, tokens, 64)
    llm = Llama(str(path), moe_ram_cache=3 * _min_budget(path, 64), moe_cost_model="rtx4090-desktop", **_kw(64))
    try:
        llm.eval(tokens)
        ram = llm.moe_stats()["engine"]["ram"]
        llm.reset()
        have, have_lg = greedy_with_logits(llm, tokens, N_GEN)
    finally:
        llm.close()
    assert ram["evictions"] > 0, ram
    assert ram["demand_reads"] <= f.n_expert and ram["prefetch_reads"] >= (len(f.moe_layers) - 2) * f.n_expert, ram
    assert have == want
    assert np.array_equal(have_lg, want_lg)


def test_decode_read_ahead_stops_when_its_predictions_miss(tiny_model):
    """Routing replayed at random, so the router look-ahead's predictions miss: as reads ahead are judged at their
    layer, the share used (about top_k / n_expert here) outweighs the assumed confidence (a prior of
    RamTier::kPriorOutcomes = 8 outcomes), and only the probes (one expert of one prediction in
    RamTier::kProbeEvery = 16) are still read ahead: at most a tenth as many reads ahead as demand reads."""
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts

    path = tiny_model("qwen3moe", "Q8_0", n_expert=32)
    f = engine_facts(path)
    rng = np.random.default_rng(5)
    n_rows, k = 400, f.model.top_k
    table = np.stack([np.stack([rng.permutation(f.n_expert)[:k] for _ in range(max(f.moe_layers) + 1)])
                      for _ in range(n_rows)]).astype(np.int32)
    llm = Llama(str(path), moe_ram_cache="25%", moe_cost_model="rtx4090-desktop", moe_replay=table,
                **_kw(1, n_ctx=512))
    try:
        for t in range(300):
            llm.eval([5 + t % 100])
        early = llm.moe_stats()["engine"]["ram"]
        llm.moe_engine.reset_stats()
        for t in range(60):
            llm.eval([5 + t % 100])
        late = llm.moe_stats()["engine"]["ram"]
    finally:
        llm.close()
    assert early["prefetch_reads"] >= 8 and early["prefetch_accuracy"] < 0.5, early
    assert late["demand_reads"] > 0 and late["prefetch_reads"] <= late["demand_reads"] / 10, late


def test_several_sequence_ubatches_read_ahead_only_predictions(tiny_model):
    """A ubatch of 12 tokens routing top-2 of 32 experts leaves an expert unused with probability (30/32)^12 = 0.46
    under uniform routing: the size of a decode of several sequences. RamTier::prefetch then reads ahead only the
    router look-ahead's predicted experts, each judged at its layer in a "several" share cell (distance x predicted
    tokens), not every expert of the next layers at that uniform prior (a prefill's rule; the look-ahead scores every
    token of a ubatch of 12 but 4, whose prior 0.23 reads nothing else ahead). A prompt run in such ubatches: every
    read ahead is judged, in the several cells for the prompt's 12-token ubatches, in the "one" cells for the
    one-token decode after it, and the tokens and logits stay upstream's."""
    path = tiny_model("qwen3moe", "Q8_0", n_expert=32, n_layer=6)
    tokens = _tokens(path, 48)
    want, want_lg = _reference(path, tokens, 12)
    have, have_lg, st = _ram_run(path, tokens, 12, budget=3 * _min_budget(path, 12))
    ram = st["ram"]
    ahead = ram["read_ahead"]
    several = sum(j for row in ahead["several"] for j, _ in row)
    one = sum(j for j, _ in ahead["one"])
    assert several > 0 and one > 0, ahead
    # the counts are halved at 256 (RamTier::kWindowOutcomes, to 128): below 128 none was, and the sum is every
    # read judged
    assert max(j for row in ahead["several"] for j, _ in row) < 128 and max(j for j, _ in ahead["one"]) < 128, ahead
    # 48 prompt tokens in 4 ubatches of 12, then N_GEN single tokens: every read ahead is judged by its ubatch's end
    assert several + one == ram["prefetch_reads"], (ram["prefetch_reads"], ahead)
    assert have == want
    assert np.array_equal(have_lg, want_lg)


def test_a_cpu_only_run_says_its_cost_model_decides_nothing(tiny_model):
    """With the RAM tier and no GPU slots every expert runs on the CPU: the stats say the default preset decides
    nothing there, and do not send the user to ``hybrimoe calibrate`` (which measures GPU copies and kernels)."""
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), moe_ram_cache=_min_budget(path, 7), **_kw(7))
    try:
        llm.eval(_tokens(path, 5))
        src = llm.moe_stats()["engine"]["cost_model"]
    finally:
        llm.close()
    assert "no GPU slots" in src and "calibrate" not in src, src
