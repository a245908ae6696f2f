"""The lazy expert load (patch 0007, ``Llama(lazy_experts=True)``): the loader leaves the routed experts' file pages
unread, and the model computes what the default load computes.

Residency oracle: mincore(2) on the model's mapping (from /proc/self/maps), after the file was dropped from the page
cache (fsync, then POSIX_FADV_DONTNEED: clean pages of a file no one maps leave the cache). A page counts only when
it lies wholly inside an expert tensor, so a neighbour's pages (pre-read with WILLNEED) do not blur the figure."""
from __future__ import annotations

import numpy as np
import pytest

from hybrimoe.runtime.disk_calibration import drop_from_page_cache as _drop_from_page_cache
from hybrimoe.testing.residency import expert_pages, resident_pages
from hybrimoe.testing.upstream import greedy_with_logits, prompt_tokens


class _Model:
    def __init__(self, path):
        self.path = path
        self.experts = expert_pages(path)  # read before any measurement: gguf's reader reads ahead


@pytest.fixture(scope="module")
def model(tiny_model):
    # 16 experts of 256 x 1024 F16 (512 KiB per matrix, 8 MiB per tensor, 48 MiB in all): most expert pages lie
    # beyond what the header's parse reads ahead
    return _Model(tiny_model("qwen3moe", "F16", n_embd=256, n_ff_exp=1024, n_expert=16))


def _resident_after_check(model) -> set:
    """The expert pages that hybrimoe's own file check (``open_gguf``, run by ``Llama`` before the loader) brings in
    from a dropped cache: gguf's reader parses the header through a mapping, and the kernel reads around it."""
    from hybrimoe.model.reader import open_gguf

    _drop_from_page_cache(model.path)
    g = open_gguf(model.path)  # its reader's mapping of the file is what mincore looks through
    resident, _ = resident_pages(model.path, model.experts)
    del g
    return resident


def _llama(path, **kw):
    from hybrimoe import Llama

    return Llama(str(path), n_ctx=256, n_batch=64, n_ubatch=64, seed=0, verbose=False, **kw)


def test_the_default_load_reads_every_expert_page(model):
    """The control: upstream's load (MAP_POPULATE) brings the experts' pages in, so the oracle can see them."""
    _drop_from_page_cache(model.path)
    llm = _llama(model.path)
    try:
        resident, total = resident_pages(model.path, model.experts)
    finally:
        llm.close()
    assert total >= 1000
    assert len(resident) == total


def test_a_lazy_load_leaves_the_expert_pages_unread(model):
    """Nothing but hybrimoe's header check (the same pages as that check alone reads, a small part) is resident."""
    by_check = _resident_after_check(model)
    _drop_from_page_cache(model.path)
    llm = _llama(model.path, lazy_experts=True)
    try:
        resident, total = resident_pages(model.path, model.experts)
    finally:
        llm.close()
    assert len(by_check) <= total // 4
    assert resident <= by_check, f"{len(resident - by_check)} of {total} expert pages read by the loader"


@pytest.mark.parametrize("use_mmap", [True, False])
def test_a_lazy_load_computes_the_default_loads_tokens_and_logits(model, use_mmap):
    """Same greedy tokens and bit-identical logits: the lazy experts are the same bytes, read on first use."""
    ref = _llama(model.path, no_repack=True)
    try:
        tokens = prompt_tokens(ref, 24)
        ref_out, ref_lg = greedy_with_logits(ref, tokens, 12)
    finally:
        ref.close()
    by_check = _resident_after_check(model)
    _drop_from_page_cache(model.path)
    llm = _llama(model.path, lazy_experts=True, use_mmap=use_mmap, no_repack=True)
    try:
        out, lg = greedy_with_logits(llm, tokens, 12)
        resident, _ = resident_pages(model.path, model.experts)
    finally:
        llm.close()
    assert out == ref_out
    assert np.array_equal(lg, ref_lg)
    assert resident - by_check  # the decode read experts it used


def test_lazy_experts_with_the_engine_matches_upstream(model, rpc_server, split_cost_model):
    """The hybrid engine over lazily mapped experts (its GPU copies and CPU share read the mapping) gives the
    same-placement reference's tokens and logits."""
    from hybrimoe.runtime.engine_facts import slot_bytes

    common = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1)
    ref = _llama(model.path, tensor_buft_overrides="exps=CPU", no_repack=True, **common)
    try:
        tokens = prompt_tokens(ref, 24)
        ref_out, ref_lg = greedy_with_logits(ref, tokens, 12)
    finally:
        ref.close()
    llm = _llama(model.path, lazy_experts=True, moe_cache=3 * slot_bytes(model.path), moe_cost_model=split_cost_model,
                 **common)
    try:
        out, lg = greedy_with_logits(llm, tokens, 12)
        st = llm.moe_stats()["engine"]
    finally:
        llm.close()
    assert out == ref_out
    assert np.array_equal(lg, ref_lg)
    assert st["gpu_experts"] > 0 and st["cpu_experts"] > 0, st


def test_lazy_experts_refuses_mlock(model):
    with pytest.raises(ValueError, match="use_mlock"):
        _llama(model.path, lazy_experts=True, use_mlock=True)


def test_lazy_experts_must_be_a_bool(model):
    with pytest.raises(ValueError, match="lazy_experts"):
        _llama(model.path, lazy_experts="yes")
