"""The recommended tiny-model recipes of the test suite and the GPU check: :func:`fixture_set`."""
from __future__ import annotations


def fixture_set() -> dict:
    """Recommended knob sets: ``{(arch, quant): kwargs for make_tiny_model}`` for the five MoE archs with
    ``"Q8_0"`` (small: D=64, F=32) and ``"Q4_K_M"`` (K-quant rows: D=256, F=256). They cover non-power-of-two
    expert counts (6, 60), top-1 routing and shared experts. Use as ``make_tiny_model(p, **kw)``."""
    q8 = {
        "qwen3moe": dict(n_expert=8, n_expert_used=2),
        "qwen2moe": dict(n_expert=60, n_expert_used=4, n_shared=1),
        "olmoe": dict(n_expert=6, n_expert_used=2),
        "llama": dict(n_expert=8, n_expert_used=1),
        "deepseek2": dict(n_layer=3, n_expert=6, n_expert_used=2, n_shared=1, n_dense_lead=1),
    }
    q4 = {
        "qwen3moe": dict(n_expert=8, n_expert_used=2),
        "qwen2moe": dict(n_expert=6, n_expert_used=2, n_shared=1),
        "olmoe": dict(n_expert=6, n_expert_used=1),
        "llama": dict(n_expert=4, n_expert_used=2),
        "deepseek2": dict(n_layer=3, n_expert=6, n_expert_used=2, n_shared=1, n_dense_lead=1),
    }
    out = {}
    for arch, kw in q8.items():
        out[(arch, "Q8_0")] = dict(arch=arch, n_embd=64, n_ff_exp=32, quant="Q8_0", **kw)
    for arch, kw in q4.items():
        out[(arch, "Q4_K_M")] = dict(arch=arch, n_embd=256, n_ff_exp=256, quant="Q4_K_M", **kw)
    return out
