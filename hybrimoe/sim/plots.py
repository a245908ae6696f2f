"""Plots for ``hybrimoe simulate --plot DIR`` (matplotlib, Agg backend): hit rate against cache size per cache
policy (cache-only replay, same initial fill), simulated tokens/s against cache size per system preset, and a Gantt
timeline of CPU / GPU / PCIe for the first MoE layers
of the first simulated step of the ``hybrimoe`` preset."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hybrimoe import _core
from hybrimoe.outputs import savefig

#: the files ``write_plots`` writes into its folder
PLOT_FILES = ("tokens_per_s_vs_cache.png", "hit_rate_vs_cache.png", "timeline.png")


def _against_cache(plt, path: Path, values: dict, ylabel: str, title: str) -> Path:
    """One line per name of ``values`` ({cache fraction: {name: y}}) against the cache size in percent; writes
    ``path``."""
    fig, ax = plt.subplots(figsize=(6, 4))
    fractions = sorted(values)
    for name in values[fractions[0]]:
        ax.plot([100 * f for f in fractions], [values[f][name] for f in fractions], marker="o", label=name)
    ax.set_xlabel("GPU expert cache, % of routed-expert bytes")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    savefig(fig, path, dpi=120)
    plt.close(fig)
    return path


def write_plots(setup, records: Sequence[dict], out_dir: Path, hit_rates: dict,
                speeds: dict | None = None) -> list[Path]:
    """Writes ``hit_rate_vs_cache.png``, ``tokens_per_s_vs_cache.png`` (with ``speeds``) and ``timeline.png`` into
    out_dir; returns their paths.

    ``setup``: the simulation's :class:`hybrimoe.sim.simulator.Setup`; ``hit_rates``: ``{cache fraction (0..1): {policy:
    {"hit_rate": ...}}}``, the cache-only replays to plot (:func:`hybrimoe.sim.simulator.cache_hit_rates` per budget);
    ``speeds``: ``{cache fraction: {system preset: tokens/s}}`` from whole simulations at each size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    model = setup.trace.model or "trace"
    if speeds:
        paths.append(_against_cache(plt, out_dir / "tokens_per_s_vs_cache.png",
                                    {f: dict(v) for f, v in speeds.items()}, f"{setup.stage} tokens/s (simulated)",
                                    f"{setup.hw.name}, {setup.stage} ({model})"))
    paths.append(_against_cache(plt, out_dir / "hit_rate_vs_cache.png",
                                {f: {n: v["hit_rate"] for n, v in r.items()} for f, r in hit_rates.items()},
                                "hit rate", f"cache-only replay, {setup.stage} ({model})"))

    cache, sched, pre, cfg = setup.build("hybrimoe")
    cfg.timeline_step, cfg.timeline_layers = 0, 4
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
    savefig(fig, p, dpi=120)
    plt.close(fig)
    paths.append(p)
    return paths
