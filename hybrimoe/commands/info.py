"""``hybrimoe info MODEL.gguf``: the MoE structure and expert bytes of a GGUF file
(:func:`hybrimoe.model.reader.describe`
prints as text, or as JSON with ``--json``)."""
from __future__ import annotations

import argparse
import json
import sys

from hybrimoe.commands.args import id_ranges
from hybrimoe.model.reader import describe, gguf_type_bytes
from hybrimoe.model.tables import EXPERT_KINDS

HELP = "MoE structure and expert bytes of a GGUF file"


def _mib(n):
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _expert_tensor_lines(d: dict) -> list[str]:
    """One line per (tensor kind, type, bytes per expert) of the routed experts' matrices (``ffn_*_exps``), bias rows
    (``.b``, carried per GPU slot with the matrices) and per-expert scales (``.s``), with the layers that have it."""
    lines = []
    for group, suffix in (("expert_tensors", ""), ("expert_biases", ".b"), ("expert_scales", ".s")):
        for kind in EXPERT_KINDS:
            k = d.get(group, {}).get(kind)
            if k is None:
                continue
            shape = "x".join(str(x) for x in k["shape"]) if "shape" in k else "1"
            groups: dict = {}
            for il, v in sorted(k["layers"].items()):
                bpe = v["bytes_per_expert"] if "bytes_per_expert" in v else gguf_type_bytes(v["type"])
                groups.setdefault((v["type"], bpe), []).append(il)
            for (tname, bpe), ils in groups.items():
                name = "ffn_" + kind + "_exps" + suffix
                lines.append(f"  {name:<18}{tname:<10}{bpe:>14}  {shape:<14}{id_ranges(ils)}")
    return lines


def format_info(d: dict) -> str:
    """Human-readable text for a ``describe`` dict."""
    lines = [
        f"file:          {d['path']} ({d['file_size']} bytes, {_mib(d['file_size'])}"
        + (f", in {d['n_shards']} shards)" if d.get("n_shards", 1) > 1 else ")"),
        f"architecture:  {d['architecture']}" + (f" (name: {d['name']})" if d.get("name") else ""),
        f"file type:     {d['file_type'] or 'unknown'}",
        f"layers:        {d['n_layer']}  (MoE: {id_ranges(d['moe_layers'])}; dense: {id_ranges(d['dense_layers'])})",
        f"n_embd:        {d['n_embd']}   n_vocab: {d['n_vocab']}",
    ]
    if not d["has_experts"]:
        lines.append("experts:       none (dense model, no routed-expert tensors)")
        lines.append(f"tensor bytes:  {d['tensor_bytes']} ({_mib(d['tensor_bytes'])}); types: "
                     + ", ".join(f"{k} x{v}" for k, v in sorted(d["tensor_types"].items())))
        return "\n".join(lines)
    sh = d["shared"]
    shs = "none" if sh is None else (f"{sh['count']} (width {sh['ff']}" + (", sigmoid-gated)" if sh["gated"] else ")"))
    lines.append(f"experts:       {d['n_expert']} routed per MoE layer, top-{d['n_expert_used']}, shared: {shs}")
    lines.append("expert tensors (bytes per expert, per layer):")
    lines.append(f"  {'tensor':<18}{'type':<10}{'bytes/expert':>14}  {'expert shape':<14}layers")
    lines += _expert_tensor_lines(d)
    variants: dict = {}
    for il, v in sorted(d.get("expert_variants", {}).items()):
        variants.setdefault((v["name"], v["engine"], v["why"]), []).append(il)
    for (name, ok, why), ils in variants.items():
        lines.append(f"expert variant:      {name} (layers {id_ranges(ils)}): "
                     + ("the engine runs it" if ok else f"upstream's path ({why})"))
    per_layer = {}
    for group in ("expert_tensors", "expert_biases"):
        for k in d.get(group, {}).values():
            for il, v in k["layers"].items():
                m, bias = per_layer.get(il, (0, 0))
                per_layer[il] = (m + v["bytes_per_expert"], bias) if group == "expert_tensors" else \
                    (m, bias + v["bytes_per_expert"])
    for k in d.get("expert_scales", {}).values():
        for il, v in k["layers"].items():
            m, bias = per_layer.get(il, (0, 0))
            per_layer[il] = (m, bias + gguf_type_bytes(v["type"]))
    if per_layer:
        # what one expert moves to a GPU slot: its matrices, (gpt-oss) its bias rows and its scales
        m, bias = max(per_layer.values(), key=lambda mb: mb[0] + mb[1])
        extra = "biases and scales" if d.get("expert_scales") else "biases"
        lines.append(f"bytes per expert:    {m + bias} (matrices {m} + {extra} {bias}; the largest MoE layer's)")
    tot = d["tensor_bytes"] or 1
    lines.append(f"routed-expert bytes: {d['routed_expert_bytes']} ({_mib(d['routed_expert_bytes'])}, "
                 f"{100.0 * d['routed_expert_bytes'] / tot:.1f}% of tensor bytes)")
    lines.append(f"other bytes:         {d['other_bytes']} ({_mib(d['other_bytes'])}, "
                 f"{100.0 * d['other_bytes'] / tot:.1f}%)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``info`` arguments."""
    parser.add_argument("model", metavar="MODEL.gguf", help="GGUF model file")
    parser.add_argument("--json", action="store_true", help="print the describe() dict as JSON")
    parser.add_argument("--moe-ram-cache", default=None, metavar="SIZE",
                        help="also estimate the disk traffic per token with this much RAM for routed experts ('40%%', "
                             "'12GiB', 'auto': what run's 'auto' would take on this machine now): simulated on "
                             "synthetic routing of the model's shape")
    parser.add_argument("--disk", default=None, metavar="NAME|FILE",
                        help="disk for --moe-ram-cache (a name or a calibrate --disk file; default pcie4-nvme)")
    parser.add_argument("--moe-cache", default="0", metavar="SIZE",
                        help="GPU expert cache for --moe-ram-cache (default 0: CPU only)")


def run(args: argparse.Namespace) -> int:
    """Prints the model's MoE facts; 0 on success, 1 with a one-line error on stderr for a bad file."""
    try:
        d = describe(args.model)
    except (OSError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"hybrimoe info: error: {msg}", file=sys.stderr)
        return 1
    traffic = None
    if args.moe_ram_cache is not None:
        try:
            traffic = _ram_traffic(args)
        except (OSError, ValueError) as e:
            print(f"hybrimoe info: error: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(d if traffic is None else dict(d, ram_traffic=traffic), indent=1, default=str))
    else:
        print(format_info(d))
        if traffic is not None:
            print(format_traffic(traffic))
    return 0


def _ram_traffic(args) -> list[dict]:
    from hybrimoe.model.facts import facts_from_gguf
    from hybrimoe.sim.simulator import ram_traffic

    budget = args.moe_ram_cache
    if str(budget).strip().lower() == "auto":
        # run's "auto" on this machine now (hybrimoe.runtime.ram_tier.auto_ram_slots, the default ubatch of 512):
        # the memory available less the weights outside the experts and the margin, in bytes
        from hybrimoe.model.reader import open_gguf
        from hybrimoe.runtime.engine_facts import engine_facts
        from hybrimoe.runtime.ram_tier import auto_ram_slots

        ef = engine_facts(args.model)
        other = max(0, int(open_gguf(args.model).size) - int(ef.total_expert_bytes))
        n, _ = auto_ram_slots(ef, 512, other)
        budget = n * ef.slot_bytes
    return ram_traffic(facts_from_gguf(args.model), budget, disk=args.disk, moe_cache=args.moe_cache)


def format_traffic(records: list[dict]) -> str:
    """The disk traffic lines of ``info --moe-ram-cache`` (records of :func:`hybrimoe.sim.simulator.ram_traffic`)."""
    r0 = records[0]
    lines = [f"RAM tier:      {r0['moe_ram_cache']} = {_mib(r0['ram_budget_bytes'])} for routed experts, disk "
             f"{r0['disk']}, GPU cache {r0['moe_cache']} (simulated; {r0['assumptions']['routing']})"]
    for r in records:
        lines.append(f"  {r['stage']:<8}{r['ram_policy']:<10}{r['bytes_disk_per_token'] / 2**20:10.2f} MiB/token from "
                     f"disk, RAM hit rate {r['ram_hit_rate']:.3f}, {r['page_faults_per_token']:.0f} page faults/token, "
                     f"{r['tokens_per_s']:.2f} tokens/s")
    return "\n".join(lines)
