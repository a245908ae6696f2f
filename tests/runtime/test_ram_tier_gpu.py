"""A GPU expert cache above the RAM tier (``Llama(moe_cache=..., moe_ram_cache=...)``): every GPU load copies from
a RAM slot, an expert on disk is read into RAM first.

Oracle: upstream llama.cpp with the same placement on the RPC stand-in (``n_gpu_layers=-1``, ``-ot exps=CPU``,
``no_repack``): the same greedy tokens and bit-identical logits (the stand-in computes the GPU share with the CPU's
kernels, and the combine sums in upstream's order), with the smallest RAM budget (experts are read from the file
every token) and a GPU share > 0 (a test cost model that splits the tiny models' layers, and ``gpu-on-demand`` where a
case needs every GPU expert loaded on demand)."""
from __future__ import annotations

import numpy as np
import pytest

from hybrimoe.testing.fixtures import ENGINE_ARCHS
from hybrimoe.testing.upstream import decode_together, greedy_reference, greedy_with_logits, prompt_tokens

N_GEN = 12
QUANTS = ("Q8_0", "Q4_K_M", "mix")
UBATCHES = (1, 7, 64)
GPU_CACHES = ("k", "half")
POLICIES = ("hybrimoe", "gpu-on-demand")


# both sides in the file's layout (no_repack): the stand-in computes the GPU share with the plain CPU kernels, and
# upstream's repacked ones may round differently (tests/runtime/test_engine_repack.py covers repacked weights)
def _common(rpc_server, ub, **kw):
    d = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=512, n_batch=64, n_ubatch=ub, seed=0,
             verbose=False,
             no_repack=True)
    d.update(kw)
    return d


def _budgets(path, ub, gpu_cache):
    """(RAM bytes, GPU bytes): the smallest RAM budget for ``ub``-token ubatches, and ``gpu_cache`` as slots."""
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.ram_tier import min_ram_slots

    f = engine_facts(path)
    slots = f.top_k if gpu_cache == "k" else len(f.moe_layers) * f.n_expert // 2
    return min_ram_slots(f, ub) * f.ram_slot_bytes, slots * f.slot_bytes


def _reference(path, rpc_server, ub, n_prompt, **kw):
    return greedy_reference(path, n_prompt, N_GEN, tensor_buft_overrides="exps=CPU", **_common(rpc_server, ub, **kw))


def _run(path, rpc_server, ub, tokens, gpu_cache, policy, cost, **kw):
    from hybrimoe import Llama

    ram, gpu = _budgets(path, ub, gpu_cache)
    llm = Llama(str(path), moe_cache=gpu, moe_ram_cache=ram, moe_policy=policy, moe_cost_model=cost,
                **_common(rpc_server, ub, **kw))
    try:
        out, lg = greedy_with_logits(llm, tokens, N_GEN)
        st = llm.moe_stats()["engine"]
        return out, lg, st, llm.moe_engine.pinned_count()
    finally:
        llm.close()


def _cases():
    from allpairspy import AllPairs

    dims = [list(ENGINE_ARCHS), list(QUANTS), list(UBATCHES), list(GPU_CACHES), list(POLICIES)]
    return [pytest.param(*c, id="-".join(map(str, c))) for c in AllPairs(dims)]


@pytest.mark.parametrize("arch, quant, ub, gpu_cache, policy", _cases())
def test_gpu_cache_over_the_ram_tier_matches_upstream(arch, quant, ub, gpu_cache, policy, tiny_model, rpc_server,
                                                      split_cost_model):
    """Every pair of architecture, quant mix, ubatch (1/7/64), GPU cache size and policy: upstream's tokens and
    logits bit for bit, with experts read from the file during the decode and experts computed on the GPU."""
    path = tiny_model(arch, quant)
    tokens, ref_out, ref_lg = _reference(path, rpc_server, ub, 2 * ub + 3)
    out, lg, st, pinned = _run(path, rpc_server, ub, tokens, gpu_cache, policy, split_cost_model)
    assert out == ref_out
    assert np.array_equal(lg, ref_lg)
    ram = st["ram"]
    assert st["gpu_experts"] > 0 and st["bytes_copied"] > 0, st
    assert ram["misses"] > 0 and ram["evictions"] > 0, ram
    if gpu_cache == "k":  # a GPU cache of top-k experts leaves most of each token's experts to the file
        assert ram["demand_reads"] + ram["prefetch_reads"] >= N_GEN, ram
    assert ram["reads_in_flight"] == 0
    # between decodes no GPU or RAM slot stays pinned (the GPU copies' holds on RAM slots end with the ubatch)
    assert pinned == 0 and ram["pinned"] == 0, (pinned, ram)


@pytest.mark.parametrize("quant", ["Q8_0", "MXFP4"])
def test_gpt_oss_over_both_tiers_matches_upstream(quant, tiny_model, tmp_path_factory, rpc_server, split_cost_model):
    """gpt-oss (expert biases, SwiGLU-OAI; Q8_0 or MXFP4 matrices): the GPU copies the biases with the RAM slot's
    matrices."""
    from hybrimoe.tiny import make_tiny_model

    if quant == "Q8_0":
        path = tiny_model("gpt-oss", "Q8_0")
    else:
        path = make_tiny_model(tmp_path_factory.mktemp("mxfp4") / "gpt-oss-mxfp4.gguf", "gpt-oss",
                               quant={"base": "Q8_0", r"ffn_(gate|up|down)_exps": "MXFP4"})
    tokens, ref_out, ref_lg = _reference(path, rpc_server, 7, 17)
    out, lg, st, _ = _run(path, rpc_server, 7, tokens, "k", "gpu-on-demand", split_cost_model)
    assert out == ref_out and np.array_equal(lg, ref_lg)
    assert st["gpu_experts"] > 0 and st["ram"]["misses"] > 0, st


def test_gpu_loads_come_from_ram_not_from_the_mapping(tiny_model, rpc_server, split_cost_model):
    """Each expert the GPU loads was read by the RAM tier: the RAM tier was asked for at least as many experts as
    the GPU got on demand from disk, and the bytes the GPU copied are whole experts of the file."""
    from hybrimoe.runtime.engine_facts import engine_facts

    path = tiny_model("qwen3moe", "Q8_0")
    tokens, ref_out, ref_lg = _reference(path, rpc_server, 1, 9)
    out, lg, st, _ = _run(path, rpc_server, 1, tokens, "k", "gpu-on-demand", split_cost_model)
    assert out == ref_out and np.array_equal(lg, ref_lg)
    ram = st["ram"]
    # gpu-on-demand puts every activated expert on the GPU: the RAM tier's accesses are the GPU's loads
    demand = sum(layer["demand_copies"] for layer in st["layers"])
    assert ram["accesses"] >= demand > 0, (ram, st)
    f = engine_facts(path)
    per_expert = sum(f.expert_bytes[0])
    assert st["bytes_copied"] >= demand * per_expert


def test_two_sequences_over_both_tiers_match_upstream(tiny_model, rpc_server, split_cost_model):
    """n_seq = 2 decoded together in one batch, a GPU cache above the RAM tier: each step's logits of both sequences
    bit-identical to upstream's."""
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q4_K_M")
    ref = Llama(str(path), tensor_buft_overrides="exps=CPU", n_seq_max=2,
                **_common(rpc_server, 7))
    try:
        prompts = [prompt_tokens(ref, 9), prompt_tokens(ref, 13)[2:]]
        want = decode_together(ref, prompts, 6)
    finally:
        ref.close()
    ram, gpu = _budgets(path, 7, "half")
    llm = Llama(str(path), moe_cache=gpu, moe_ram_cache=ram, moe_cost_model=split_cost_model, n_seq_max=2,
                **_common(rpc_server, 7))
    try:
        have = decode_together(llm, prompts, 6)
        st = llm.moe_stats()["engine"]
    finally:
        llm.close()
    assert st["gpu_experts"] > 0 and st["ram"]["misses"] > 0, st
    for a, b in zip(want, have):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_gpu_loads_leave_no_expert_page_in_the_page_cache(tiny_model, rpc_server, split_cost_model):
    """With a GPU cache above the RAM tier the decode adds no expert page to the page cache (mincore on llama.cpp's
    mapping of the file): the GPU copies from RAM slots, never from the mapping. The load's upload of the weights
    next to the experts to the device (``n_gpu_layers``) reads around them (this machine's disk has an 8 MiB
    ``read_ahead_kb``, three of these tiny expert tensors); the tier drops those pages at open and at the first
    ubatch, but some stay (19 pages in most runs, up to a quarter of these tiny tensors' pages in a few): that is
    the loader's (llama.cpp's mapping, before the engine exists), so what is asserted is that the decode, GPU
    loads included, adds none."""
    from hybrimoe import Llama
    from hybrimoe.testing.residency import cold_expert_pages, resident_pages

    big = tiny_model("qwen3moe", "F16", n_embd=256, n_ff_exp=1024, n_expert=16)
    pages, by_check, total = cold_expert_pages(big)
    ram, gpu = _budgets(big, 7, "k")
    llm = Llama(str(big), moe_cache=gpu, moe_ram_cache=ram, moe_policy="gpu-on-demand",
                moe_cost_model=split_cost_model, **_common(rpc_server, 7))
    try:
        toks = prompt_tokens(llm, 15)
        llm.eval(toks[:1])  # the first ubatch: the tier drops what the load's read-ahead left
        after_load, _ = resident_pages(big, pages)
        llm.reset()
        greedy_with_logits(llm, toks, 8)
        resident, _ = resident_pages(big, pages)
        st = llm.moe_stats()["engine"]
    finally:
        llm.close()
    assert st["gpu_experts"] > 0 and st["ram"]["bytes_read"] > 0, st
    if len(by_check) > total // 4:
        pytest.skip("this file system keeps dropped pages (tmpfs?): residency cannot be told")
    assert resident <= after_load | by_check, (f"{len(resident - after_load - by_check)} expert pages read in by "
                                               f"the decode (the load left {len(after_load - by_check)} of {total})")


def test_the_split_is_planned_with_the_reads(tiny_model, rpc_server, split_cost_model):
    """The planner sees which experts are not in RAM and the tier's measured read time (LayerInput.on_disk,
    read_s): the decision records carry them, and each record's makespan re-timed from them is the one the engine
    planned, bit for bit (the timeline with the reads, docs/design.md §18)."""
    from hybrimoe import Llama, _core

    path = tiny_model("qwen3moe", "Q8_0")
    ram, gpu = _budgets(path, 7, "k")
    llm = Llama(str(path), moe_cache=gpu, moe_ram_cache=ram, moe_cost_model=split_cost_model,
                **_common(rpc_server, 7))
    try:
        llm.moe_log()
        greedy_with_logits(llm, prompt_tokens(llm, 17), N_GEN)
        log = llm.moe_take_log()
        cost = llm.moe_setup.cost
    finally:
        llm.close()
    timed = [r for r in log if r["read_s"] > 0 and any(r["on_disk"])]
    assert timed, "no split was planned with reads"
    assert all(len(r["on_disk"]) == len(r["experts"]) for r in timed)
    again = _core.record_makespans(log, cost)
    assert again == [r["makespan_s"] for r in log]


def test_a_read_error_for_a_gpu_load_names_the_file_and_offset(tiny_model, rpc_server, split_cost_model):
    """EIO on a read the GPU share waits for (every expert on the GPU, none in RAM): the decode raises an error
    naming the file and the offset, without hanging, and the next decode reads again and gives upstream's tokens."""
    import errno
    import os

    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    tokens, ref_out, _ = _reference(path, rpc_server, 7, 9)
    ram, gpu = _budgets(path, 7, "k")
    llm = Llama(str(path), moe_cache=gpu, moe_ram_cache=ram, moe_policy="gpu-on-demand",
                moe_cost_model=split_cost_model, **_common(rpc_server, 7))
    try:
        llm.moe_engine.ram_inject_read_error(errno.EIO, 1)
        with pytest.raises(RuntimeError, match=r"offset \d+ of .*" + os.path.basename(path) + ".*Input/output error"):
            llm.eval(tokens)
        llm.moe_engine.ram_inject_read_error(0)
        llm.reset()
        out, _ = greedy_with_logits(llm, tokens, N_GEN)
        st = llm.moe_stats()["engine"]
    finally:
        llm.close()
    assert out == ref_out and st["gpu_experts"] > 0


def test_close_with_reads_and_copies_queued_returns(tiny_model, rpc_server, split_cost_model):
    """close() right after a prefill that queued read-ahead and GPU copies from RAM slots: returns promptly."""
    import threading

    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "F16", n_embd=256, n_ff_exp=1024, n_expert=16)
    ram, gpu = _budgets(path, 7, "half")
    llm = Llama(str(path), moe_cache=gpu, moe_ram_cache=ram, moe_cost_model=split_cost_model,
                **_common(rpc_server, 7))
    llm.eval(prompt_tokens(llm, 21))
    t = threading.Thread(target=llm.close)
    t.start()
    t.join(60)
    assert not t.is_alive(), "close() hung with reads or copies queued"


def test_run_command_takes_both_tiers(tiny_model, rpc_server, split_cost_model, tmp_path):
    """``hybrimoe run --rpc ... -ngl 99 --moe-cache X --moe-ram-cache Y``: upstream's tokens with the same placement
    (``-ot exps=CPU --no-repack``), and both tiers' lines in the stats; with ``--moe-ram-exclusive`` the same tokens
    and a line for the exclusive tiers."""
    import json
    import subprocess
    import sys

    path = tiny_model("qwen3moe", "Q8_0")
    ram, gpu = _budgets(path, 7, "k")

    def run(*extra):
        r = subprocess.run([sys.executable, "-m", "hybrimoe", "run", "-m", str(path), "-p", "Once upon a time", "-n",
                            "8", "--temp", "0", "-ub", "7", "--rpc", rpc_server.endpoint, "-ngl", "99",
                            "--output-format", "json", *extra], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["tokens"], r.stderr

    want, _ = run("-ot", "exps=CPU", "--no-repack")
    have, err = run("--moe-cache", str(gpu), "--moe-ram-cache", str(ram), "--moe-stats", "--moe-cost-model",
                    split_cost_model)
    assert have == want
    assert "RAM tier hit rate" in err and "hit rate" in err.replace("RAM tier hit rate", ""), err
    assert "exclusive tiers" not in err
    have, err = run("--moe-cache", str(gpu), "--moe-ram-cache", str(4 * ram), "--moe-stats", "--moe-cost-model",
                    split_cost_model, "--moe-ram-exclusive")
    assert have == want
    assert "exclusive tiers:" in err and "RAM slots given up" in err, err


@pytest.mark.parametrize("gpu_cache, parts", [(None, 3), ("k", 3), (None, 2)],
                         ids=["cpu-only", "gpu-cache-above", "two-buffers-two-passes"])
def test_ram_slots_over_several_buffers_match_upstream(gpu_cache, parts, tiny_model, rpc_server, split_cost_model,
                                                       monkeypatch):
    """A host buffer type that caps one buffer (Vulkan's pinned memory; here $HYBRIMOE_MAX_BUFFER_BYTES): the RAM
    slots lie in several buffers and the CPU share runs once per buffer, each pair in the share of its expert's
    buffer; up to three buffers in two passes (a second share per buffer), with more in one (no expert in a second
    pass). Upstream's tokens and logits bit for bit, with or without a GPU cache above."""
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.ram_tier import min_ram_slots

    path = tiny_model("qwen3moe", "Q4_K_M")
    f = engine_facts(path)
    n = min_ram_slots(f, 7)
    monkeypatch.setenv("HYBRIMOE_MAX_BUFFER_BYTES", str((n // parts + 2) * f.ram_slot_bytes))
    tokens, ref_out, ref_lg = _reference(path, rpc_server, 7, 17)
    extra = dict(moe_cache=f.top_k * f.slot_bytes, moe_policy="gpu-on-demand") if gpu_cache else {}
    llm = Llama(str(path), moe_ram_cache=n * f.ram_slot_bytes, moe_cost_model=split_cost_model, **extra,
                **_common(rpc_server, 7))
    try:
        out, lg = greedy_with_logits(llm, tokens, N_GEN)
        stats = llm.moe_stats()
    finally:
        llm.close()
    st = stats["engine"]
    assert out == ref_out and np.array_equal(lg, ref_lg)
    assert 2 <= st["ram"]["buffers"] <= 6 and st["ram"]["misses"] > 0, st["ram"]
    assert st["cpu_experts"] > 0 and not stats["unsupported"] and not stats["engine_skipped"], stats
    # past three buffers one pass only; up to three a second pass runs when a read is still in flight at the plan,
    # which on these tiny experts depends on timing (test_run_command_takes_the_flag counts one)
    if st["ram"]["buffers"] > 3:
        assert st["cpu_late_experts"] == 0, (st["ram"]["buffers"], st["cpu_late_experts"])
    if gpu_cache:
        assert st["gpu_experts"] > 0


def test_too_many_ram_buffers_are_refused_with_the_numbers(tiny_model, monkeypatch):
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts

    path = tiny_model("qwen3moe", "Q8_0")
    f = engine_facts(path)
    monkeypatch.setenv("HYBRIMOE_MAX_BUFFER_BYTES", str(2 * f.ram_slot_bytes))
    with pytest.raises(Exception, match=r"would need \d+ buffers of at most \d+ bytes; at most 6"):
        Llama(str(path), moe_ram_cache="100%", moe_cost_model="rtx4090-desktop", n_ctx=256, n_ubatch=7, verbose=False)


def _mrs_alpha(policy, facts) -> float:
    """An MRS policy's alpha, from its update (HybriMoE §IV.D: S <- alpha * s + (1 - alpha) * S; without router
    scores s = 1 / top_k for a routed expert): expert 0 of MoE layer 0 set to 0, then routed once."""
    from hybrimoe import _core

    policy.set_score(0, 0, 0.0)
    o = _core.LayerObservation()
    o.step, o.layer, o.n_tokens, o.top_k, o.n_experts = 0, 0, 1, facts.top_k, facts.n_expert
    o.experts, o.loads, o.scores = [0], [1], []
    policy.observe(o)
    return policy.score(0, 0) * facts.top_k


@pytest.mark.parametrize("arch, quant", [("qwen3moe", "Q8_0"), ("deepseek2", "mix"), ("gpt-oss", "Q8_0")])
def test_exclusive_tiers_match_upstream_and_hold_each_expert_once(arch, quant, tiny_model, rpc_server,
                                                                    split_cost_model):
    """``moe_ram_exclusive=True``: upstream's tokens and logits bit for bit (a demoted expert's RAM slot gets the
    GPU slot's bytes, the file's); experts on the GPU gave up their RAM slots and GPU evictions came back into RAM;
    between decodes no expert is in both tiers, where the inclusive run (the control) has some."""
    path = tiny_model(arch, quant)
    tokens, ref_out, ref_lg = _reference(path, rpc_server, 1, 9)
    ram, gpu = _budgets(path, 1, "k")
    got, alpha, ram_alpha = {}, {}, {}
    for exclusive in (True, False):
        from hybrimoe import Llama

        llm = Llama(str(path), moe_cache=gpu, moe_ram_cache=4 * ram, moe_cost_model=split_cost_model,
                    moe_ram_exclusive=exclusive, **_common(rpc_server, 1))
        try:
            out, lg = greedy_with_logits(llm, tokens, N_GEN)
            got[exclusive] = (out, lg, llm.moe_stats()["engine"], llm.moe_engine.in_both_tiers())
            alpha[exclusive] = _mrs_alpha(llm.moe_setup.policies.cache.policy, llm.moe_setup.facts)
            ram_alpha[exclusive] = _mrs_alpha(llm.moe_setup.ram_policy, llm.moe_setup.facts)
        finally:
            llm.close()
    # the GPU cache above an exclusive RAM tier ranks as the simulator's three-tier runs do (presets.gpu_mrs_alpha)
    assert alpha == {True: pytest.approx(0.01), False: pytest.approx(0.5)}
    # and the RAM tier's MRS as the simulator's RAM presets (hybrimoe-exclusive's mrs_alpha, hybrimoe's)
    assert ram_alpha == {True: pytest.approx(0.05), False: pytest.approx(0.1)}
    for exclusive, (out, lg, st, both) in got.items():
        assert out == ref_out and np.array_equal(lg, ref_lg), exclusive
        assert st["gpu_experts"] > 0, st
    _, _, st, both = got[True]
    assert both == 0 and st["ram"]["given_up"] > 0 and st["ram"]["demotions"] > 0, (both, st["ram"])
    _, _, st_inc, both_inc = got[False]
    assert both_inc > 0 and st_inc["ram"]["given_up"] == 0 and st_inc["ram"]["demotions"] == 0, st_inc["ram"]


def test_exclusive_tiers_read_each_expert_about_once_when_both_tiers_hold_all(tiny_model, rpc_server,
                                                                             split_cost_model):
    """GPU and RAM budgets of half the routed experts each: with exclusive tiers both together hold every expert, so
    the decode reads each expert from the file about once (at most 1.25x all the experts' bytes), and no more than
    the inclusive tiers read (here about 5x as much); the router look-ahead does not read back into RAM what the GPU
    holds."""
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts

    path = tiny_model("qwen3moe", "Q8_0")
    f = engine_facts(path)
    half = len(f.moe_layers) * f.n_expert // 2
    read = {}
    for exclusive in (True, False):
        llm = Llama(str(path), moe_cache=half * f.slot_bytes, moe_ram_cache=half * f.ram_slot_bytes,
                    moe_cost_model=split_cost_model,
                    moe_ram_exclusive=exclusive, **_common(rpc_server, 1))
        try:
            greedy_with_logits(llm, prompt_tokens(llm, 9), 48)
            read[exclusive] = llm.moe_stats()["engine"]["ram"]["bytes_read"]
        finally:
            llm.close()
    every = len(f.moe_layers) * f.n_expert * sum(f.expert_bytes[0])
    assert read[True] <= 1.25 * every and read[True] <= read[False], (read, every)


@pytest.mark.parametrize("kw, match", [
    (dict(moe_cache="25%"), "needs a RAM tier"),
    (dict(moe_ram_cache="50%"), "needs a GPU cache above the RAM tier"),
    (dict(moe_cache=0, moe_ram_cache="50%"), "at least one expert slot"),
    (dict(moe_cache="25%", moe_ram_cache="50%", moe_ram_exclusive="no"), "must be True or False"),
])
def test_exclusive_tiers_need_both_tiers(kw, match, tiny_model):
    """``moe_ram_exclusive`` without a RAM tier, or without a GPU cache above it (where it would do nothing), or not
    a bool, is refused with a message naming the options, before the model loads."""
    from hybrimoe import Llama

    kw = dict(dict(moe_ram_exclusive=True), **kw)
    with pytest.raises(ValueError, match=match):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), verbose=False, **kw)
