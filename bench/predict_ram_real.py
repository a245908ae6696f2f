"""The simulator's prediction of bench/bench_ram_real.py's runs, beside what they measured: the first check of the
simulator (docs/design.md §17) against a real device.

Inputs: the measured rows (``bench_ram_real.py --json``) and a disk file of the model's own disk (``hybrimoe calibrate
--disk -m MODEL -o DISK.json --memory-limit LIMIT``: cold reads of its experts, and faults through a mapping of the file
at the ``read_ahead_kb`` in force, a decode's faults timed under a memory cgroup of the runs' ``--limit``), one per
read-ahead the runs used (``--disk 128=DISK128.json,8192=DISK8192.json``), so that upstream's mmap is predicted with the
faults of each, at their measured throughput. The CPU's figures are fitted here, on this machine, from two in-RAM models
of the benchmark model's shape (``--fit-layers``, written once like the benchmark model) run by upstream llama.cpp (CPU
only, the measured runs' threads; the least of 3 repetitions): the difference of their per-token times is the cost of
the MoE layers they differ by, with nothing read from the disk. Decode (one token) gives the effective memory bandwidth
(a decode-time layer reads its weights once: the other weights and top-k experts); prefill (one prompt-length ubatch)
then gives the effective compute throughput. They are written as a hardware file whose "GPU" facts are the CPU's too:
with no GPU cache every expert runs on the CPU, and the non-expert work the simulator places on the GPU runs on the same
CPU, one after the other, as it does here.

The runs simulated are the measured ones: the same synthetic trace (shape, locality, seed), the RAM budget the
engine had (its ``n_slots x slot_bytes``; upstream's page cache gets the same), the prefill as one ubatch of the
prompt, the decode as the measured decode tokens after the prompt (the prompt's tokens run first as one prefill
ubatch, ``SimConfig.prompt_tokens``, so the RAM holds what the prefill left, as in the runs: the difference of the
totals with and without the decode tokens). Modes: upstream-mmap is the simulator's ``mmap`` preset with
the faults the disk file measured (``mmap_read_around``, ``mmap_fault_bytes``; without them, faults of this disk's
``read_ahead_kb`` and no read-around waste), hybrimoe its ``hybrimoe`` preset (the reads' CPU time from the disk
file's ``read_cpu_s_per_byte``),
hybrimoe-no-prefetch the same without look-ahead, hybrimoe-lru with an LRU RAM cache. Prints a markdown table of
measured, predicted and error; ``--json`` writes it.

    python3 bench/predict_ram_real.py --measured ram_real.json --disk 128=disk128.json,8192=disk8192.json

``--disk from-run`` takes, per read-ahead, the median of the disk calibrations bench_ram_real.py ``--calibrate-disk``
took between the runs (the disk's throughput drifts over a day here: a calibration an hour away may not be the disk
the runs had).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

MODES = {  # measured mode -> (simulator RAM preset, overrides of its components)
    "upstream-mmap": ("mmap", {}),
    "hybrimoe": ("hybrimoe", {}),
    "hybrimoe-no-prefetch": ("hybrimoe", {"lookahead": 0}),
    "hybrimoe-lru": ("hybrimoe", {"cache": "lru"}),
    "hybrimoe-reuse": ("hybrimoe", {"cache": "reuse"}),
    "hybrimoe-no-repack": ("hybrimoe", {}),  # the simulator's CPU figures are the fitted upstream's (plain) kernels
}


def disk_files(spec: str) -> dict:
    """``--disk``: one disk file for every read-ahead (``FILE``), or one per read-ahead (``KB=FILE,KB=FILE``:
    ``calibrate --disk`` run at each ``read_ahead_kb``, whose mmap faults it measures). Returns {kb or None: FILE}.

    Raises:
        SystemExit: a part that is not KB=FILE among several, or a file that does not exist.
    """
    out = {}
    for part in spec.split(","):
        kb, _, f = part.rpartition("=")
        if (not kb and len(spec.split(",")) > 1) or (kb and not kb.isdigit()):
            raise SystemExit(f"--disk {spec!r}: give KB=FILE for each read-ahead (KB a read_ahead_kb value, e.g. "
                             "128=disk128.json), or one FILE")
        if not Path(f).is_file():
            raise SystemExit(f"--disk: {f} does not exist (hybrimoe calibrate --disk -m MODEL -o {f})")
        out[int(kb) if kb else None] = f
    return out


def median_disks(calibrations: list, out_stem: str, base: Path = Path(".")) -> dict:
    """``--disk from-run``: per read-ahead, one disk file whose every fact is the median of the calibrations
    bench_ram_real.py ``--calibrate-disk`` took at that read-ahead during the runs (its JSON's
    ``disk_calibrations``; a relative path there is taken from ``base``, the measured JSON's folder, else the
    working directory), written to ``OUT_STEM.diskKB.json``. A fact takes the median of the calibrations that have
    it; the per-run measurements (``measured``) are left out. Returns {kb: file}.

    Raises:
        SystemExit: the runs have no calibration that succeeded.
    """
    by_kb: dict = {}
    for c in calibrations:
        f = Path(c["file"]) if Path(c["file"]).is_absolute() or Path(c["file"]).is_file() else base / c["file"]
        if "error" not in c and f.is_file():
            by_kb.setdefault(int(c["read_ahead_kb"]), []).append(str(f))
    if not by_kb:
        raise SystemExit("--disk from-run: the measured runs have no disk calibration (bench_ram_real.py "
                         "--calibrate-disk DIR takes them)")
    out = {}
    for kb, files in sorted(by_kb.items()):
        docs = [json.loads(Path(f).read_text()) for f in files]
        doc = dict(docs[0], facts={})
        doc.pop("measured", None)
        for d in docs:
            for name, fact in d["facts"].items():
                doc["facts"].setdefault(name, dict(fact))
        for name, fact in doc["facts"].items():
            vals = [d["facts"][name]["value"] for d in docs if name in d["facts"]]
            med = statistics.median(vals)
            fact["value"] = type(fact["value"])(med) if isinstance(fact["value"], int) else float(med)
            fact["source"] = (f"median of {len(vals)} calibrations during the measured runs ({min(vals):.4g}.."
                              f"{max(vals):.4g}): " + fact["source"])
        doc["description"] = f"median of the disk calibrations at read_ahead_kb {kb} during the runs: {files}"
        path = Path(f"{out_stem}.disk{kb}.json")
        path.write_text(json.dumps(doc, indent=2))
        print(f"--disk from-run: wrote {path} (the median of {len(files)} calibrations at read_ahead_kb {kb})",
              file=sys.stderr)
        out[kb] = str(path)
    return out


def read_ahead_bytes(path: Path) -> int:
    """The block device's ``read_ahead_kb`` under ``path`` in bytes (128 KiB, Linux's default, where not found)."""
    dev = os.stat(path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for p in (sysfs / "queue/read_ahead_kb", sysfs / "../queue/read_ahead_kb"):
        try:
            return int(p.read_text()) * 1024
        except (OSError, ValueError):
            continue
    return 128 * 1024


def measure_in_ram(path: Path, pp: int, tg: int, threads: int, reps: int = 3,
                   flash_attn="off") -> tuple[float, float]:
    """(prefill seconds of one ``pp``-token ubatch, decode seconds per token) of upstream llama.cpp on ``path``,
    every weight in RAM (read once before timing): the least of ``reps`` repetitions (this machine's timings are
    noisy upwards: other load only slows a run down). ``flash_attn``: the measured runs' setting."""
    import numpy as np

    from hybrimoe import Llama

    llm = Llama(str(path), n_ctx=pp + tg + 16, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, n_gpu_layers=0, verbose=False, no_repack=True, flash_attn=flash_attn)
    toks = [int(t) for t in np.random.default_rng(0).integers(5, 500, size=pp)]
    llm.eval(toks[:8])  # warm-up: the pages in, the thread pool up
    best_pp, best_tg = float("inf"), float("inf")
    for _ in range(reps):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(toks)
        t1 = time.perf_counter()
        for _ in range(tg):
            llm.eval([7])
        t2 = time.perf_counter()
        best_pp, best_tg = min(best_pp, t1 - t0), min(best_tg, (t2 - t1) / tg)
    llm.close()
    return best_pp, best_tg


def fit_hardware(model: Path, layers: tuple[int, int], pp: int, tg: int, threads: int, flash_attn="off") -> dict:
    """This CPU's effective bandwidth and throughput from two in-RAM models of ``model``'s shape with ``layers``
    blocks (their time difference: the MoE layers between), as a ``hybrimoe.hardware/1`` document."""
    from hybrimoe.model.facts import facts_from_gguf
    from hybrimoe.tiny.synthetic import make_synthetic_model

    root = model.parent
    times, facts = [], None
    for n in layers:
        p = root / f"ram-bench-fit-{n}.gguf"
        if not p.exists():
            make_synthetic_model(p, n_layer=n)
        times.append(measure_in_ram(p, pp, tg, threads, flash_attn=flash_attn))
        facts = facts_from_gguf(p)
    dl = layers[1] - layers[0]
    t_pp = (times[1][0] - times[0][0]) / dl   # seconds per MoE layer, one pp-token ubatch
    t_tg = (times[1][1] - times[0][1]) / dl   # seconds per MoE layer, one token
    other = facts.moe_layer_other_bytes()
    eb = float(facts.expert_bytes)
    bw = (other + facts.top_k * eb) / t_tg
    # prefill: every expert's bytes once (a ubatch of pp tokens routes to all of them) and 2 FLOP per parameter and
    # token for the layer's other weights and each (token, expert) pair
    flop = 2.0 * pp * (facts.non_expert_params_per_moe_layer + facts.top_k * facts.expert_params)
    t_flop = max(1e-9, t_pp - (other + facts.n_experts * eb) / bw)
    flops = flop / t_flop
    src = (f"fitted on this machine by bench/predict_ram_real.py: upstream llama.cpp, {threads} threads, CPU only, "
           f"in-RAM synthetic models of {layers[0]} and {layers[1]} layers of the benchmark's shape: "
           f"{1e3 * t_tg:.2f} ms per MoE layer per decode token, {1e3 * t_pp:.1f} ms per MoE layer per {pp}-token "
           "ubatch")
    fact = lambda v, s=src: {"value": v, "source": s}  # noqa: E731
    return {
        "schema": "hybrimoe.hardware/1", "name": "this-machine-cpu",
        "description": "this machine, CPU only: the GPU facts are the CPU's (no expert runs on a GPU; the non-expert "
                       "work runs on the same CPU)",
        "facts": {
            "gpu_mem_bandwidth_Bps": fact(bw), "gpu_mem_efficiency": fact(1.0, "the fitted bandwidth is effective"),
            "gpu_effective_flops": fact(flops), "gpu_kernel_launch_s": fact(1e-9, "no launches: the CPU"),
            "gpu_kernels_per_expert": fact(3, "our MoE op"), "gpu_kernels_per_layer": fact(25, "as the presets"),
            "cpu_mem_bandwidth_Bps": fact(bw), "cpu_mem_efficiency": fact(1.0, "the fitted bandwidth is effective"),
            "cpu_effective_flops": fact(flops), "cpu_startup_s": fact(1e-6, "assumption: negligible at this scale"),
            "h2d_bandwidth_Bps": fact(1e12, "unused: no GPU cache"), "h2d_latency_s": fact(1e-9, "unused"),
            "gpu_memory_bytes": fact(1.0, "unused: no GPU cache"),
        },
    }, {"tpot_in_ram_s": times, "per_layer_decode_s": t_tg, "per_layer_prefill_s": t_pp}


def simulate(trace, hw, disk: str, stage: str, budget: float, preset: str, over: dict, fault_bytes: int,
             prompt_tokens: int = 0) -> dict:
    """One simulator record of a RAM preset with component overrides (``over``); ``prompt_tokens``: in decode, the
    prompt's tokens prefilled as one ubatch first (``SimConfig.prompt_tokens``)."""
    from hybrimoe.policy import presets
    from hybrimoe.sim.simulator import Setup

    name = preset
    if over or preset == "mmap":
        name = f"{preset}-bench"
        presets.RAM_PRESETS[name] = dict(presets.RAM_PRESETS[preset], **over, baseline=False)
    try:
        s = Setup(trace, hw, "0", stage, profile_fraction=0.0, seed=1, ram_cache=budget, disk=disk,
                  max_tokens=trace.n_tokens)
        s.cfg.prompt_tokens = prompt_tokens
        orig = s.build_ram

        def build_ram(ram):
            cache, cfg = orig(ram)
            if preset == "mmap" and fault_bytes:  # a disk file without the measured fault size
                cfg.fault_bytes = float(fault_bytes)
            return cache, cfg

        s.build_ram = build_ram
        return s.run("hybrimoe", ram=name)
    finally:
        if name != preset:
            del presets.RAM_PRESETS[name]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", required=True, help="bench_ram_real.py --json output")
    ap.add_argument("--disk", required=True,
                    help="disk file (hybrimoe calibrate --disk -o FILE), or KB=FILE,... one per read_ahead_kb, or "
                         "from-run: the median of the calibrations taken during the runs (bench_ram_real.py "
                         "--calibrate-disk)")
    ap.add_argument("--hardware", default=None, help="a hardware file instead of fitting this CPU")
    ap.add_argument("--fit-layers", default="4,12", help="layers of the two in-RAM fit models (default 4,12)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from hybrimoe.model.facts import facts_from_gguf
    from hybrimoe.policy.hardware import load_hardware
    from hybrimoe.traces.synthetic import synthetic_trace

    if not Path(args.measured).is_file():
        raise SystemExit(f"--measured: {args.measured} does not exist (bench/bench_ram_real.py --json FILE writes it)")
    meas = json.loads(Path(args.measured).read_text())
    # checked before the CPU fit, which writes and times two models
    disks = (median_disks(meas.get("disk_calibrations", []), str(Path(args.json or "predict").with_suffix("")),
                          Path(args.measured).parent)
             if args.disk == "from-run" else disk_files(args.disk))
    model = Path(meas["model"])
    threads = int(meas["threads"])
    # the measured runs' own settings (bench_ram_real.py writes them)
    args.pp, args.tg, args.locality = int(meas["pp"]), int(meas["tg"]), str(meas["locality"])
    fit = {}
    hw_path = args.hardware
    if hw_path is None:
        lo, hi = (int(x) for x in args.fit_layers.split(","))
        # runs written before bench_ram_real.py had --flash-attn ran without it
        doc, fit = fit_hardware(model, (lo, hi), args.pp, args.tg, threads, meas.get("flash_attn", "off"))
        hw_path = str(Path(args.json or "predict").with_suffix(".hardware.json"))
        Path(hw_path).write_text(json.dumps(doc, indent=2))
        print(f"fitted CPU: {doc['facts']['cpu_mem_bandwidth_Bps']['value'] / 1e9:.2f} GB/s, "
              f"{doc['facts']['cpu_effective_flops']['value'] / 1e9:.1f} GFLOP/s ({hw_path})", file=sys.stderr)
    hw = load_hardware(hw_path)
    facts = facts_from_gguf(model)
    # the runs' own routing: bench_ram_real.py's trace (its length, the follow-up prompt's tokens included, and the
    # router scores its replay gives hybrimoe's cache policies)
    full = synthetic_trace(facts, 2 * args.pp + args.tg + 8, locality=args.locality, seed=0, scores=True, n_prompts=1)
    n = full.n_tokens
    import numpy as np

    first = lambda k: full.select_tokens(np.arange(n) < k)  # noqa: E731
    from hybrimoe.policy.hardware import load_disk

    hyb = next((r for r in meas["rows"] if r.get("mode") == "hybrimoe" and "ram_decode" in r), None)
    if hyb is None:
        print(f"{args.measured}: no successful 'hybrimoe' row: its RAM budget is every mode's here", file=sys.stderr)
        return 1
    # the engine's RAM slots as many experts (a slot is a little larger than an expert: each matrix's region holds
    # the largest matrix and a page for the direct read's alignment; the simulator's experts are their own bytes)
    budget = float(hyb["ram_decode"]["n_slots"]) * float(np.max(full.expert_bytes))
    # the measured figures per (mode, read-ahead): the summary's medians and ranges (older files: each row alone)
    summary = meas.get("summary") or [
        {"mode": r["mode"], "asked_kb": r.get("read_ahead_kb"), "in_force_kb": [r.get("read_ahead_kb")],
         **{k: {"median": r[k], "min": r[k], "max": r[k]} for k in ("pp_tps", "tg_tps", "pp_read_per_token",
                                                                    "tg_read_per_token")}}
        for r in meas["rows"] if "error" not in r]
    out, done = [], {}
    print(f"model {model.name}; RAM for experts {budget / 2**30:.2f} GiB (hybrimoe's auto budget, every mode); "
          f"CPU {hw_path}; measured: median (min..max) of {meas.get('reps', 1)} runs")
    print(f"| mode | read_ahead_kb | pp{args.pp} t/s measured | predicted | error | tg{args.tg} t/s measured | "
          "predicted | error | MB read/token pp measured | predicted | MB read/token tg measured | predicted | disk |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in summary:
        if m["mode"] not in MODES or "pp_tps" not in m:
            continue
        kb = (m.get("in_force_kb") or [None])[0]
        disk = disks.get(kb, disks.get(None))
        if disk is None:
            print(f"| {m['mode']} | {kb} | no disk file for this read-ahead (--disk {kb}=FILE) |")
            continue
        dfacts = load_disk(disk).facts
        # upstream's faults: as calibrate --disk measured them at this read-ahead (read-around and bytes per
        # fault), else one fault reads read_ahead_kb with no read-around waste
        ra = 0 if "mmap_fault_bytes" in dfacts else (kb * 1024 if kb else read_ahead_bytes(model))
        preset, over = MODES[m["mode"]]
        key = (preset, json.dumps(over, sort_keys=True), disk, ra if preset == "mmap" else 0)
        if key not in done:
            pre = simulate(first(args.pp), hw, disk, "prefill", budget, preset, over, ra)
            # the decode after the prompt's prefill, as the runs did: the prefill (one ubatch) then the decode
            # tokens one per step, less the prefill alone
            d0 = simulate(first(args.pp), hw, disk, "decode", budget, preset, over, ra, prompt_tokens=args.pp)
            d1 = simulate(first(args.pp + args.tg), hw, disk, "decode", budget, preset, over, ra,
                          prompt_tokens=args.pp)
            done[key] = (args.pp / pre["total_s"], args.tg / (d1["total_s"] - d0["total_s"]),
                         pre["bytes_disk"] / args.pp, (d1["bytes_disk"] - d0["bytes_disk"]) / args.tg)
        pp_tps, tg_tps, pp_bytes, tg_bytes = done[key]
        med = {k: m[k]["median"] for k in ("pp_tps", "tg_tps", "pp_read_per_token", "tg_read_per_token")}
        faults = (f"faults {dfacts['mmap_read_around']:.2f} bytes read per byte, "
                  f"{dfacts['mmap_fault_bytes'] / 2**20:.2f} MiB each" if "mmap_fault_bytes" in dfacts else
                  f"faults of {ra // 1024} KiB (read_ahead_kb)")
        if "mmap_fault_Bps" in dfacts:
            faults += f", {dfacts['mmap_fault_Bps'] / 1e9:.2f} GB/s under the memory limit"
        row = dict(mode=m["mode"], read_ahead_kb=kb, disk=disk, pp_measured=med["pp_tps"], pp_predicted=pp_tps,
                   tg_measured=med["tg_tps"], tg_predicted=tg_tps, tg_bytes_measured=med["tg_read_per_token"],
                   tg_bytes_predicted=tg_bytes, pp_bytes_measured=med["pp_read_per_token"],
                   pp_bytes_predicted=pp_bytes, pp_error=pp_tps / med["pp_tps"] - 1,
                   tg_error=tg_tps / med["tg_tps"] - 1,
                   pp_range=[m["pp_tps"]["min"], m["pp_tps"]["max"]],
                   tg_range=[m["tg_tps"]["min"], m["tg_tps"]["max"]])
        out.append(row)
        rng = lambda k, f: (f"{f.format(m[k]['median'])} "  # noqa: E731
                            f"({f.format(m[k]['min'])}..{f.format(m[k]['max'])})")
        print(f"| {m['mode']} | {kb} | {rng('pp_tps', '{:.2f}')} | {pp_tps:.2f} | {100 * row['pp_error']:+.0f}% | "
              f"{rng('tg_tps', '{:.3f}')} | {tg_tps:.3f} | {100 * row['tg_error']:+.0f}% | "
              f"{med['pp_read_per_token'] / 1e6:.0f} | {pp_bytes / 1e6:.0f} | {med['tg_read_per_token'] / 1e6:.0f} | "
              f"{tg_bytes / 1e6:.0f} | {Path(disk).name}: {faults}; reads cost "
              f"{1e9 * dfacts.get('read_cpu_s_per_byte', 0.0):.2f} CPU s/GB |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"budget_bytes": budget, "disks": disks, "hardware": hw_path,
                                               "fit": fit, "rows": out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
