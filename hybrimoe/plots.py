"""Plots for ``hybrimoe simulate --plot DIR`` (matplotlib, Agg backend): hit rate against cache size per cache
policy (cache-only replay, same initial fill), simulated tokens/s against cache size per system preset, and a Gantt
timeline of CPU / GPU / PCIe for the first MoE layers
of the first simulated step of the ``hybrimoe`` preset."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence


def write_plots(setup, records: Sequence[dict], out_dir: Path, hit_rates: dict,
                speeds: dict | None = None) -> list[Path]:
    """Writes ``hit_rate_vs_cache.png``, ``tokens_per_s_vs_cache.png`` (with ``speeds``) and ``timeline.png`` into
    out_dir; returns their paths.

    ``setup``: the simulation's ``hybrimoe.simulate.Setup``; ``hit_rates``: ``{cache fraction (0..1): {policy:
    {"hit_rate": ...}}}``, the cache-only replays to plot (``hybrimoe.simulate.cache_hit_rates`` per budget);
    ``speeds``: ``{cache fraction: {system preset: tokens/s}}`` from whole simulations at each size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    if speeds:
        fig, ax = plt.subplots(figsize=(6, 4))
        fr = sorted(speeds)
        for name in speeds[fr[0]]:
            ax.plot([100 * f for f in fr], [speeds[f][name] for f in fr], marker="o", label=name)
        ax.set_xlabel("GPU expert cache, % of routed-expert bytes")
        ax.set_ylabel(f"{setup.stage} tokens/s (simulated)")
        ax.set_title(f"{setup.hw.name}, {setup.stage} ({setup.trace.model or 'trace'})")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        p = out_dir / "tokens_per_s_vs_cache.png"
        fig.tight_layout()
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    fig, ax = plt.subplots(figsize=(6, 4))
    fractions = sorted(hit_rates)
    rates: dict = {}
    for f in fractions:
        for name, v in hit_rates[f].items():
            rates.setdefault(name, []).append(v["hit_rate"])
    for name, ys in rates.items():
        ax.plot([100 * f for f in fractions], ys, marker="o", label=name)
    ax.set_xlabel("GPU expert cache, % of routed-expert bytes")
    ax.set_ylabel("hit rate")
    ax.set_title(f"cache-only replay, {setup.stage} ({setup.trace.model or 'trace'})")
    ax.legend()
    ax.grid(alpha=0.3)
    p = out_dir / "hit_rate_vs_cache.png"
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    cache, sched, pre, cfg = setup.build("hybrimoe")
    cfg.timeline_step, cfg.timeline_layers = 0, 4
    from hybrimoe import _core

    res = _core.simulate(setup.core_trace, cache, sched, pre, setup.planner, setup.truth_cost, setup.truth, cfg,
                         setup.first, min(setup.end, setup.first + 1))
    fig, ax = plt.subplots(figsize=(9, 3))
    colors = {0: "tab:blue", 1: "tab:red", 2: "tab:green", 3: "tab:olive", 4: "tab:gray", 5: "tab:purple"}
    names = {0: "compute", 1: "demand copy", 2: "prefetch", 3: "fill", 4: "non-expert", 5: "activations"}
    seen = set()
    for e in res.timeline:
        label = names[e.kind] if e.kind not in seen else None
        seen.add(e.kind)
        ax.barh(e.resource, (e.end_s - e.start_s) * 1e3, left=e.start_s * 1e3, color=colors[e.kind],
                edgecolor="black", linewidth=0.3, label=label)
    ax.set_yticks([0, 1, 2], ["CPU", "GPU", "PCIe"])
    ax.set_xlabel("ms")
    ax.set_title("hybrimoe: first 4 MoE layers of the first step")
    ax.legend(fontsize=7, ncol=3)
    p = out_dir / "timeline.png"
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    return paths
