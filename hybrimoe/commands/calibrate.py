"""``hybrimoe calibrate``: measures the engine's cost model for one model on this machine's devices and stores it
where the engine finds it (:mod:`hybrimoe.runtime.calibration` says what is measured and how)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hybrimoe.commands.args import FUSED_FLAG, POSITIVE, THREADS, int_in, llama_threads_default
from hybrimoe.outputs import check_output
from hybrimoe.policy.cost_model import COST_FIELDS

HELP = "measure the engine's cost model for a model on this machine (stored for later runs)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``calibrate`` flags."""
    p.add_argument("-m", "--model", required=True, help="GGUF model")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT,...",
                   help="ggml RPC server to calibrate as the GPU; several: each is calibrated in turn and stored under "
                        "its own label (a run over several GPUs plans each with its own)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int_in(0, also=(-1,)), default=99,
                   help="layers on the GPU (default %(default)s)")
    p.add_argument("-t", "--threads", type=THREADS, default=None,
                   help=f"CPU threads (default: {llama_threads_default()})")
    p.add_argument("-nr", "--no-repack", action="store_true",
                   help="measure the CPU share on the file's layout, for runs with --no-repack (default: as llama.cpp "
                        "places CPU weights, repacked where ggml-cpu can)")
    p.add_argument("--no-host", action="store_true",
                   help="measure with CPU weights out of the GPU's pinned host buffer, for runs with --no-host")
    p.add_argument("--moe-cpu-fused", nargs="?", const="on", default="off", choices=("on", "fast", "off"),
                   help="measure the fused CPU share, for runs with --moe-cpu-fused (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="fewer ubatch sizes and repetitions")
    p.add_argument("-r", "--reps", type=POSITIVE, default=None,
                   help="measured runs per ubatch size (default 2, 1 with --quick); more: steadier figures")
    p.add_argument("-o", "--output", default=None,
                   help="write here instead of the calibration store (default: the store, calibration/ in "
                        "hybrimoe's cache directory: $HYBRIMOE_CACHE_DIR, else $XDG_CACHE_HOME/hybrimoe, else "
                        "~/.cache/hybrimoe)")
    p.add_argument("--disk", action="store_true",
                   help="measure the disk the model is read from instead (cold reads of its experts: bandwidth, "
                        "latency, useful reads in flight), written as a disk file for simulate --disk")
    p.add_argument("--memory-limit", default=None, metavar="BYTES",
                   help="with --disk: also time a decode's page faults through a mapping of the model under a memory "
                        "cgroup of this size (at least 256 MiB, e.g. 3GiB, below the model's experts; needs root), "
                        "faulted by -t threads (default: the cores, llama.cpp's) as upstream's mmap runs a model "
                        "larger than RAM: the simulator then predicts upstream's mmap at their throughput")
    p.add_argument("--force", action="store_true", help="replace an existing -o file")


def run(args: argparse.Namespace) -> int:
    """Runs ``hybrimoe calibrate``: 0 ok (the figures and the file written are printed), 1 on any failure."""
    from hybrimoe.runtime.calibrate_model import calibrate_model
    from hybrimoe.runtime.calibration import calibration_path, save
    from hybrimoe.runtime.setup import cpu_weights_option

    if args.disk:
        return _run_disk(args)
    if args.memory_limit is not None:
        print("hybrimoe calibrate: error: --memory-limit goes with --disk (it times the faults of upstream's mmap "
              "on the model's disk)", file=sys.stderr)
        return 1
    endpoints = [e.strip() for e in (args.rpc or "").split(",") if e.strip()] or [None]
    if args.output and len(endpoints) > 1:
        print("hybrimoe calibrate: error: -o names one file, and --rpc names several servers: leave -o out (each "
              "device's calibration goes to the store under its own label)", file=sys.stderr)
        return 1
    for endpoint in endpoints:
        try:
            if args.output:
                check_output(args.output, "-o", force=args.force, inputs=[("-m", args.model)])
            cm, sources, device = calibrate_model(args.model, rpc_servers=endpoint, n_gpu_layers=args.n_gpu_layers,
                                                  threads=args.threads, quick=args.quick, reps=args.reps,
                                                  no_repack=args.no_repack, no_host=args.no_host,
                                                  moe_cpu_fused=FUSED_FLAG[args.moe_cpu_fused])
            tag = cpu_weights_option(args.no_repack, args.no_host) + {"on": "-fused", "fast": "-fused-fast"}.get(
                args.moe_cpu_fused, "")
            out = save(cm, sources, Path(args.output) if args.output else calibration_path(args.model, device, tag))
        except (OSError, ValueError, RuntimeError) as e:
            where = f" ({endpoint})" if len(endpoints) > 1 else ""
            print(f"hybrimoe calibrate: error{where}: {e}", file=sys.stderr)
            return 1
        doc = json.loads(out.read_text())
        if len(endpoints) > 1:
            print(f"device {device} ({endpoint}):")
        for f in COST_FIELDS:
            print(f"{f:18s} {doc[f]:.6g}   ({sources.get(f, '')})")
        if "cpu_weights" in sources:
            print(sources["cpu_weights"])
        print(f"hybrimoe calibrate: wrote {out}")
    return 0


def _memory_limit(spec: str) -> int:
    """``--memory-limit``: bytes ("3GiB", "512MiB" or a number), at least 256 MiB (a smaller cgroup holds little
    more than the probe's own process). ValueError naming the flag otherwise."""
    from hybrimoe.policy.budget import parse_budget

    bad = ValueError(f"--memory-limit {spec!r}: give the memory cgroup's size in bytes, at least 256 MiB (e.g. 3GiB)")
    if str(spec).strip().endswith("%"):
        raise bad
    try:
        limit = int(parse_budget(spec, 1.0, 0.0))
    except ValueError:
        raise bad from None
    if limit < 256 << 20:
        raise bad
    return limit


def _run_disk(args: argparse.Namespace) -> int:
    """``hybrimoe calibrate --disk``: measures and writes the disk file, prints its figures."""
    from hybrimoe.runtime.disk_calibration import disk_file_path, measure_disk

    try:
        out = Path(args.output) if args.output else disk_file_path(args.model)
        if args.output:
            check_output(args.output, "-o", force=args.force, inputs=[("-m", args.model)])
        limit = None if args.memory_limit is None else _memory_limit(args.memory_limit)
        m = measure_disk(args.model, memory_limit=limit, fault_threads=args.threads)
        doc = m.to_disk_file(name=f"measured-{Path(args.model).stem}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, out)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"hybrimoe calibrate: error: {e}", file=sys.stderr)
        return 1
    for d, v in sorted(m.per_depth_Bps.items()):
        print(f"reads in flight {d:2d}: {v / 1e9:.3f} GB/s cold")
    print(f"read_bandwidth_Bps {m.read_bandwidth_Bps:.6g}\nread_latency_s     {m.read_latency_s:.6g}\n"
          f"queue_depth        {m.queue_depth}\nwarm (page cache)  {m.warm_Bps / 1e9:.3f} GB/s\n"
          f"read_cpu_s_per_byte {m.read_cpu_s_per_byte:.4g} ({m.read_cpu_s_per_byte * 1e9:.3f} CPU s per GB read)")
    if m.mmap_read_around >= 1:
        print(f"mmap_read_around   {m.mmap_read_around:.3g} (bytes read per byte faulted)\n"
              f"mmap_fault_bytes   {m.mmap_fault_bytes:.6g}")
    if m.mmap_fault_Bps > 0:
        print(f"mmap_fault_Bps     {m.mmap_fault_Bps:.6g} (a decode's faults under the memory limit)")
    if m.host_cache_suspected:
        print("hybrimoe calibrate: warning: cold reads ran at nearly page-cache speed: probably served from a cache "
              "below this machine (a virtual disk's host)", file=sys.stderr)
    print(f"hybrimoe calibrate: wrote {out} (hybrimoe simulate --disk {out})")
    return 0
