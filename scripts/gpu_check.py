#!/usr/bin/env python3
"""Helper of ``scripts/gpu-check.sh``: the parts of the GPU check that are easier in Python.

Subcommands (each prints what it did; run ``gpu_check.py SUBCOMMAND --help``):

``pack-lcp``      a trimmed llama-cpp-python source tarball (its Python package, CMake files and a trimmed
                  ``vendor/llama.cpp``) that ``pip wheel --no-build-isolation`` builds offline
``trace-subset``  the first prompts of a routing trace (all MoE layers), small enough to carry
``bench-model``   the DeepSeek-V2-Lite-shaped synthetic benchmark model (``hybrimoe.tiny.make_synthetic_model``)
                  and the trace cut to its MoE layers, for ``hybrimoe bench --replay-trace``
``correctness``   tiny models, hybrimoe's engine against upstream with the same placement (greedy tokens and
                  logits NMSE), on CUDA or on the RPC stand-in; one JSON file, rewritten after every case
``summary``       ``gpu-check.json`` from the steps' records, the correctness and bench results, and a short
                  summary on stdout
``requirements``  the runtime requirements the carry folder's wheels must cover: hybrimoe's (``pyproject.toml``)
                  and llama-cpp-python's (its source), one a line
``install-deps``  installs the requirements the running Python lacks from the carry folder's wheels (offline)

``correctness``, ``bench-model`` and ``summary`` import the installed hybrimoe (``PYTHONPATH`` set by the shell
script); the others need only numpy.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np

SCHEMA = "hybrimoe.gpu_check/1"
# the targets for hybrimoe over the best upstream mode at a 25% cache
TARGET_SPEEDUP = {"prefill": 1.5, "decode": 2.0}

def _log(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


def _write_json(path: Path, doc) -> None:
    """Write ``doc`` to ``path`` atomically (a reader never sees half a file, a crash leaves the last one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=_json_default))
    os.replace(tmp, path)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


# ---- pack-lcp ------------------------------------------------------------------------------------------------

# what llama-cpp-python's build reads besides vendor/llama.cpp (its pyproject: scikit-build-core, version from
# llama_cpp/__init__.py, readme README.md)
_LCP_KEEP_FILES = ("CMakeLists.txt", "pyproject.toml", "README.md", "LICENSE.md", "PKG-INFO")
_LCP_COMMON_ON = 'set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)'


def cmd_pack_lcp(args) -> int:
    """Trimmed llama-cpp-python source: ``<top>/{CMakeLists.txt, pyproject.toml, README.md, LICENSE.md,
    PKG-INFO, llama_cpp/}`` from the sdist plus ``<top>/vendor/llama.cpp/`` from the trimmed llama.cpp tarball of
    ``scripts/pack-llama-source.sh``. The top CMakeLists.txt stops forcing llama.cpp's ``common`` library on
    (llama-cpp-python ships none of it; it only costs build time)."""
    sdist, tree, out = Path(args.sdist), Path(args.llama_tgz), Path(args.out)
    for p in (sdist, tree):
        if not p.is_file():
            _log(f"error: {p} does not exist")
            return 2
    n_files = 0
    common_off = False
    with tarfile.open(sdist) as src, tarfile.open(tree) as trimmed, tarfile.open(out, "w:gz") as dst:
        members = src.getmembers()
        top = members[0].name.split("/")[0]
        for m in members:
            parts = m.name.split("/")
            if parts[0] != top or len(parts) < 2 or ".." in parts:
                continue
            rel = "/".join(parts[1:])
            if not (rel in _LCP_KEEP_FILES or rel == "llama_cpp" or rel.startswith("llama_cpp/")):
                continue
            if rel.startswith("llama_cpp/lib/"):  # prebuilt libraries never belong in a source tree
                continue
            if m.isfile():
                data = src.extractfile(m).read()
                if rel == "CMakeLists.txt":
                    text = data.decode()
                    if _LCP_COMMON_ON in text:
                        text = text.replace(_LCP_COMMON_ON, _LCP_COMMON_ON.replace(" ON ", " OFF "))
                        common_off = True
                    data = text.encode()
                info = tarfile.TarInfo(m.name)
                info.size, info.mode, info.mtime = len(data), m.mode, m.mtime
                dst.addfile(info, io.BytesIO(data))
                n_files += 1
            elif m.isdir():
                dst.addfile(m)
        for m in trimmed.getmembers():
            parts = m.name.split("/")
            if ".." in parts or not (m.isfile() or m.isdir()):
                continue
            # the trimmed tarball's top folder is llama.cpp/: it goes under <top>/vendor/
            name = f"{top}/vendor/" + m.name
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = m.mode, m.mtime
            if m.isdir():
                info.type = tarfile.DIRTYPE
                dst.addfile(info)
            else:
                data = trimmed.extractfile(m).read()
                info.size = len(data)
                dst.addfile(info, io.BytesIO(data))
                n_files += 1
    if not common_off:
        _log("warning: llama-cpp-python's CMakeLists.txt no longer forces LLAMA_BUILD_COMMON in the expected way; "
             "left as is (the build then also compiles llama.cpp's common library)")
    _log(f"wrote {out} ({n_files} files, {out.stat().st_size / 2**20:.1f} MiB; top folder {top})")
    return 0


# ---- trace-subset --------------------------------------------------------------------------------------------

def cmd_trace_subset(args) -> int:
    """The first whole prompts of a routing trace, at most ``--tokens`` tokens (at least one prompt), every MoE
    layer kept, in the trace's own (version 0/1) fields."""
    src, out = Path(args.src), Path(args.out)
    if not src.is_file():
        _log(f"error: trace {src} does not exist")
        return 2
    with np.load(src, allow_pickle=False) as z:
        doc = {k: z[k] for k in z.files}
    off = doc["prompt_offsets"].astype(np.int64)
    n_tok = int(args.tokens)
    if n_tok <= 0 or n_tok >= off[-1]:
        k = len(off) - 1
    else:
        k = max(1, int(np.searchsorted(off, n_tok, side="right")) - 1)
    end = int(off[k])
    doc["expert_ids"] = doc["expert_ids"][:end]
    doc["prompt_offsets"] = off[: k + 1]
    for key in ("prompt_id", "split"):  # per-prompt provenance fields
        if key in doc and len(doc[key]) == len(off) - 1:
            doc[key] = doc[key][:k]
    if "router_scores" in doc:
        doc["router_scores"] = doc["router_scores"][:end]
    np.savez_compressed(out, **doc)
    _log(f"wrote {out}: {k} prompts, {end} tokens, {doc['expert_ids'].shape[1]} MoE layers "
         f"({out.stat().st_size / 2**20:.2f} MiB) from {src}")
    return 0


# ---- bench-model ---------------------------------------------------------------------------------------------

def cmd_bench_model(args) -> int:
    """The synthetic DeepSeek-V2-Lite-shaped model and the routing trace cut to its MoE layers. Writes
    ``--info`` (JSON: paths, sizes, seconds, tensor types) and reuses a model written with the same knobs."""
    import gguf

    from hybrimoe.tiny import DSV2_LITE_SHAPE, make_synthetic_model
    from hybrimoe.traces.format import RoutingTrace, load_trace

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tr = load_trace(args.trace)
    kw = dict(DSV2_LITE_SHAPE)
    kw.update(n_layer=args.layers, n_embd=args.n_embd, n_ff_exp=args.n_ff_exp, n_ff_dense=args.n_ff_dense,
              n_head=args.n_head, n_expert=tr.num_experts, n_expert_used=tr.top_k, seed=args.seed)
    n_moe = kw["n_layer"] - kw["n_dense_lead"]
    if not 1 <= n_moe <= tr.n_layers:
        _log(f"error: {kw['n_layer']} blocks give {n_moe} MoE layers; the trace has {tr.n_layers} "
             f"(use 2..{tr.n_layers + kw['n_dense_lead']} layers)")
        return 2
    tag = f"L{kw['n_layer']}-D{kw['n_embd']}-F{kw['n_ff_exp']}-E{kw['n_expert']}-s{kw['seed']}"
    model = out_dir / f"dsv2lite-synth-{tag}.gguf"
    stamp = model.with_suffix(".json")
    t0 = time.monotonic()
    reused = model.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == kw
    if not reused:
        make_synthetic_model(model, progress=True, **kw)
        stamp.write_text(json.dumps(kw))
    t_model = time.monotonic() - t0
    # the trace's first n_moe MoE layers, in the model's layer numbering
    cut = RoutingTrace(expert_ids=tr.expert_ids[:, :n_moe].copy(), prompt_offsets=tr.prompt_offsets,
                       num_experts=tr.num_experts, top_k=tr.top_k, expert_bytes=tr.expert_bytes[:n_moe].copy(),
                       n_dense_layers=kw["n_dense_lead"],
                       moe_layer_ids=np.arange(kw["n_dense_lead"], kw["n_layer"]), model="")
    trace_out = out_dir / f"trace-{n_moe}moe.npz"
    cut.save(trace_out)
    types: dict = {}
    exp_bytes = 0
    for t in gguf.GGUFReader(os.fspath(model)).tensors:
        key = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        types.setdefault(key, set()).add(t.tensor_type.name)
        if "_exps." in t.name:
            exp_bytes += int(t.n_bytes)
    info = dict(model=str(model), model_bytes=model.stat().st_size, routed_expert_bytes=exp_bytes,
                seconds=round(t_model, 2), reused=reused, shape=kw, n_moe_layers=n_moe,
                tensor_types={k: sorted(v) for k, v in sorted(types.items())}, trace=str(trace_out),
                trace_source=str(args.trace), trace_tokens=tr.n_tokens,
                trace_note="router scores absent in the trace: score-based policies use 1/top_k per activated "
                           "expert")
    _write_json(Path(args.info), info)
    _log(f"bench model {model} ({info['model_bytes'] / 2**30:.2f} GiB, routed experts "
         f"{exp_bytes / 2**30:.2f} GiB, {'reused' if reused else f'written in {t_model:.1f} s'}); "
         f"trace {trace_out} ({n_moe} MoE layers)")
    return 0


# ---- correctness ---------------------------------------------------------------------------------------------

#: tiny models of the correctness step besides hybrimoe.tiny.fixture_set(): gpt-oss with MXFP4 expert matrices (as
#: gpt-oss files ship them; 17-byte blocks, so CUDA's MXFP4 mul_mat_id reads slots 272-byte aligned), F32 expert
#: biases (ggml_add_id by slot) and SwiGLU-OAI experts, Q8_0 elsewhere
EXTRA_RECIPES = {
    ("gpt-oss", "MXFP4"): dict(arch="gpt-oss", n_embd=64, n_ff_exp=32, n_expert=8, n_expert_used=2,
                               quant={"base": "Q8_0", r"ffn_(gate|up|down)_exps": "MXFP4"}),
}


def correctness_recipes() -> dict:
    """``{(arch, quant): make_tiny_model keywords}`` the correctness step knows: fixture_set() and EXTRA_RECIPES."""
    from hybrimoe.tiny import fixture_set

    return {**fixture_set(), **EXTRA_RECIPES}


def cmd_correctness(args) -> int:
    """Per tiny model (``--models arch:quant,...`` from ``correctness_recipes``): upstream with the same
    placement (``n_gpu_layers=-1, tensor_buft_overrides="exps=CPU", no_repack=True``) is the oracle; hybrimoe
    (``moe_cache`` each of ``--caches``, ``moe_policy`` ``--policy``) must give the same greedy tokens and a
    logits NMSE <= ``--tol``. A negative control (the engine drops its GPU share's outputs) must be detected.
    The device is the first CUDA GPU (``--mode cuda``) or an RPC stand-in server (``--mode cpu``)."""
    import hybrimoe  # noqa: F401  (before llama_cpp: hybrimoe's libllama)
    from hybrimoe import Llama, _ggml
    # planner costs under which CPU and GPU are comparable for the tiny models (mixed splits), as in the tests
    from hybrimoe.testing.upstream import SPLIT_COST, greedy_reference, greedy_with_logits
    from hybrimoe.testing.upstream import nmse as logits_nmse
    from hybrimoe.tiny import make_tiny_model

    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    site = os.environ.get("GPUCHECK_WORK")
    if site and not Path(hybrimoe.__file__).resolve().is_relative_to(Path(site).resolve()):
        _log(f"error: imported hybrimoe from {hybrimoe.__file__}, not from the check's build under {site} "
             "(PYTHONPATH)")
        return 2
    cost = work / "split-cost.json"
    cost.write_text(json.dumps(SPLIT_COST))
    doc = dict(mode=args.mode, tol_nmse=args.tol, policy=args.policy, n_prompt=args.n_prompt, n_gen=args.n_gen,
               n_ubatch=args.n_ubatch, cost_model="hybrimoe.testing.upstream.SPLIT_COST (mixed CPU/GPU splits)",
               hybrimoe=os.path.dirname(hybrimoe.__file__), cases=[], errors=[])
    server = None
    endpoint = None
    if args.mode == "cpu":
        from hybrimoe.runtime.rpc import RPCServer

        server = RPCServer(threads=args.threads).start()
        endpoint = server.endpoint
    try:
        devs = _ggml.devices()
        doc["devices"] = [{k: d.get(k) for k in ("name", "description", "type", "total", "free")} for d in devs]
        if args.mode == "cuda" and not _ggml.local_gpus():
            raise RuntimeError("no GPU device in ggml's device list (llama-cpp-python built without CUDA, or no "
                               f"driver): {[d.get('name') for d in devs]}")
        common = dict(n_gpu_layers=-1, n_ctx=256, n_batch=256, n_ubatch=args.n_ubatch, seed=0, verbose=False,
                      rpc_servers=endpoint)
        recipes = correctness_recipes()
        for spec in [s.strip() for s in args.models.split(",") if s.strip()]:
            arch, _, quant = spec.partition(":")
            if (arch, quant) not in recipes:
                doc["errors"].append(f"{spec}: not a correctness recipe; known: "
                                     + ", ".join(f"{a}:{q}" for a, q in recipes))
                continue
            path = make_tiny_model(work / f"tiny-{arch}-{quant}.gguf", **recipes[(arch, quant)])
            t0 = time.monotonic()
            tokens, ref_out, ref_lg = greedy_reference(path, args.n_prompt, args.n_gen,
                                                       tensor_buft_overrides="exps=CPU", no_repack=True, **common)
            controls = [("control", args.caches.split(",")[0].strip())] if args.control else []
            for kind, cache in [("case", c.strip()) for c in args.caches.split(",") if c.strip()] + controls:
                case = dict(model=f"{arch}:{quant}", moe_cache=cache, policy=args.policy, kind=kind)
                t1 = time.monotonic()
                try:
                    llm = Llama(str(path), moe_cache=cache, moe_policy=args.policy, moe_cost_model=str(cost),
                                **common)
                    try:
                        if kind == "control":
                            llm.moe_engine.set_drop_gpu_share(True)
                        out_t, lg = greedy_with_logits(llm, tokens, args.n_gen)
                        st = llm.moe_stats().get("engine", {})
                    finally:
                        llm.close()
                    nmse = logits_nmse(lg, ref_lg)
                    same = out_t == ref_out
                    case.update(same_tokens=same, n_tokens=len(out_t), nmse=nmse, finite=bool(np.isfinite(lg).all()),
                                bit_exact=bool(np.array_equal(lg, ref_lg)),
                                **{k: st.get(k) for k in ("hit_rate", "cpu_experts", "gpu_experts", "bytes_copied",
                                                          "n_slots", "failed")})
                    if kind == "case":
                        case["passed"] = bool(same and nmse <= args.tol and case["finite"] and not st.get("failed"))
                        case["mixed_split"] = bool((st.get("gpu_experts") or 0) > 0 and (st.get("cpu_experts") or 0) > 0)
                    else:  # the check must notice that the GPU share's outputs were dropped
                        case["passed"] = bool((st.get("gpu_experts") or 0) > 0 and (not same or nmse > args.tol))
                except Exception as e:  # one case failing must not stop the others
                    case.update(passed=False, error=f"{type(e).__name__}: {e}")
                case["seconds"] = round(time.monotonic() - t1, 2)
                doc["cases"].append(case)
                _write_json(out, doc)
                _log(f"correctness {case['model']} {kind} moe_cache={cache}: "
                     f"{'PASS' if case['passed'] else 'FAIL'} (nmse {case.get('nmse', float('nan')):.3g}, same tokens "
                     f"{case.get('same_tokens')}, gpu/cpu experts {case.get('gpu_experts')}/{case.get('cpu_experts')})")
            _log(f"  {arch}:{quant} done in {time.monotonic() - t0:.1f} s")
        if args.two_devices:
            doc["cases"].append(_two_device_case(args, work, str(cost), common))
            _write_json(out, doc)
    except Exception as e:
        doc["errors"].append(f"{type(e).__name__}: {e}")
        _log(f"correctness: error: {e}")
    finally:
        if server is not None:
            server.stop()
    doc["passed"] = bool(doc["cases"]) and not doc["errors"] and all(c["passed"] for c in doc["cases"])
    _write_json(out, doc)
    return 0 if doc["passed"] else 1


def _two_device_case(args, work: Path, cost: str, common: dict) -> dict:
    """Two devices, layer split 1:1 (``-ngl 99 -ts 1,1``): the first device (the GPU, or in cpu mode an RPC stand-in)
    and an RPC server on loopback serving the same GPU (``ggml-rpc-server --device CUDA0``; in cpu mode another
    stand-in). hybrimoe against upstream with the same placement (``-ot exps=CPU --no-repack``): the same greedy
    tokens, logits NMSE <= ``--tol``, and a GPU share on both devices."""
    from hybrimoe import Llama
    from hybrimoe.runtime.rpc import RPCServer
    from hybrimoe.testing.upstream import greedy_reference, greedy_with_logits
    from hybrimoe.testing.upstream import nmse as logits_nmse
    from hybrimoe.tiny import make_tiny_model

    case = dict(model="qwen3moe:Q8_0 (8 layers)", moe_cache="50%", policy=args.policy, kind="two-devices",
                tensor_split=[1, 1])
    t1 = time.monotonic()
    extra = RPCServer(threads=args.threads, device="CUDA0" if args.mode == "cuda" else "CPU").start()
    try:
        endpoints = ",".join(e for e in (common.get("rpc_servers"), extra.endpoint) if e)
        kw = dict(common, rpc_servers=endpoints, tensor_split=[1.0, 1.0])
        path = make_tiny_model(work / "tiny-qwen3moe-Q8_0-8l.gguf",
                               **dict(correctness_recipes()[("qwen3moe", "Q8_0")], n_layer=8))
        tokens, ref_out, ref_lg = greedy_reference(path, args.n_prompt, args.n_gen, tensor_buft_overrides="exps=CPU",
                                                   no_repack=True, **kw)
        llm = Llama(str(path), moe_cache="50%", moe_policy=args.policy, moe_cost_model=cost, **kw)
        try:
            out_t, lg = greedy_with_logits(llm, tokens, args.n_gen)
            devs = llm.moe_stats()["engine"]["devices"]
        finally:
            llm.close()
        nmse = logits_nmse(lg, ref_lg)
        case.update(same_tokens=out_t == ref_out, nmse=nmse, bit_exact=bool(np.array_equal(lg, ref_lg)),
                    devices=devs, passed=bool(out_t == ref_out and nmse <= args.tol and len(devs) == 2
                                              and all(d["gpu_experts"] > 0 for d in devs)))
    except Exception as e:
        case.update(passed=False, error=f"{type(e).__name__}: {e}")
    finally:
        extra.stop()
    case["seconds"] = round(time.monotonic() - t1, 2)
    _log(f"correctness two devices: {'PASS' if case['passed'] else 'FAIL'} (nmse {case.get('nmse', float('nan')):.3g},"
         f" devices {[(d['device'], d['gpu_experts']) for d in case.get('devices', [])]})")
    return case


# ---- summary -------------------------------------------------------------------------------------------------

def _device_info(mode: str) -> dict:
    info = dict(mode=mode, host=platform.node(), cpu=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), python=platform.python_version())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,"
                            "pcie.link.width.max", "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            info["gpus"] = [dict(zip(("name", "driver", "memory", "pcie_gen_max", "pcie_width_max"),
                                     [x.strip() for x in line.split(",")])) for line in r.stdout.strip().splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    info["device"] = info["gpus"][0]["name"] if info.get("gpus") else (
        "RPC stand-in (ggml-rpc-server --device CPU on this CPU: no speed claim)" if mode == "cpu" else "none found")
    return info


def _bench_table(doc: dict) -> dict:
    """One bench JSON -> rows, best upstream mode per phase, hybrimoe's speed-up over it."""
    rows = doc.get("rows", [])
    ok = [r for r in rows if "error" not in r]
    up = [r for r in ok if r["mode"].startswith("upstream")]
    hy = [r for r in ok if r["mode"].startswith("hybrimoe")]
    res = dict(moe_cache=doc.get("moe_cache"), budget_bytes=doc.get("budget_bytes"), device=doc.get("device"),
               stand_in=doc.get("stand_in"), replay_trace=doc.get("replay_trace"),
               rows=[{k: r.get(k) for k in ("mode", "pp_tps", "pp_tps_sd", "tg_tps", "tg_tps_sd", "hit_rate",
                                             "h2d_bytes_per_token", "gpu_expert_bytes", "gpu_expert_share",
                                             "decisions_agree", "predicted_moe_ms_per_token", "measured_moe_ms_per_token",
                                             "same_tokens_as_first", "repetitions", "n_prompt", "n_gen", "error")
                      if k in r} for r in rows])
    speed = {}
    for phase, key in (("prefill", "pp_tps"), ("decode", "tg_tps")):
        if up and hy:
            best = max(up, key=lambda r: r[key])
            h = max(hy, key=lambda r: r[key])
            speed[phase] = dict(hybrimoe_mode=h["mode"], hybrimoe_tps=h[key], best_upstream_mode=best["mode"],
                                best_upstream_tps=best[key],
                                speedup=(h[key] / best[key]) if best[key] > 0 else None,
                                target=TARGET_SPEEDUP[phase])
    res["speedup"] = speed
    return res


def cmd_summary(args) -> int:
    """``gpu-check.json`` in ``--out-dir``: device, steps with times (build ones included), correctness, bench
    tables and hybrimoe's speed-up over the best upstream mode at each cache size; ``bench.csv`` (both bench
    tables, one ``moe_cache`` column); a short summary on stdout."""
    work, out_dir = Path(args.work), Path(args.out_dir)
    steps = []
    steps_file = work / "steps.jsonl"
    if steps_file.is_file():
        for line in steps_file.read_text().splitlines():
            if line.strip():
                try:
                    steps.append(json.loads(line))
                except json.JSONDecodeError:
                    steps.append(dict(step="?", status="unreadable record", raw=line))
    doc = dict(schema=SCHEMA, mode=args.mode, device=_device_info(args.mode), started=args.started,
               finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), steps=steps)
    if args.t0:
        doc["total_s"] = round(time.time() - float(args.t0), 1)
    build = work / "build-info.json"
    if build.is_file():
        doc["build"] = json.loads(build.read_text())
    doc["build_seconds"] = {s["step"]: s.get("seconds") for s in steps if s.get("step", "").startswith("build")}
    corr = out_dir / "correctness.json"
    if corr.is_file():
        c = json.loads(corr.read_text())
        doc["correctness"] = dict(passed=c.get("passed"), tol_nmse=c.get("tol_nmse"), errors=c.get("errors"),
                                  cases=[{k: x.get(k) for k in ("model", "kind", "moe_cache", "passed", "same_tokens",
                                                                 "nmse", "bit_exact", "gpu_experts", "cpu_experts",
                                                                 "hit_rate", "error")} for x in c.get("cases", [])])
    bm = work / "bench-model.json"
    if bm.is_file():
        doc["bench_model"] = json.loads(bm.read_text())
    doc["bench"] = {}
    csv_rows = []
    for f in sorted(out_dir.glob("bench-*.json")):
        try:
            b = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            doc["bench"][f.stem] = dict(error=f"unreadable: {e}")
            continue
        doc["bench"][b.get("moe_cache", f.stem)] = _bench_table(b)
        for r in b.get("rows", []):
            csv_rows.append(dict(moe_cache=b.get("moe_cache"), **r))
    if csv_rows:
        keys = ["moe_cache", "mode"] + sorted({k for r in csv_rows for k in r} - {"moe_cache", "mode"})
        with open(out_dir / "bench.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=keys)
            w.writeheader()
            w.writerows(csv_rows)
    b25 = doc["bench"].get("25%")
    doc["speedup_25"] = b25["speedup"] if b25 else None
    cal = work / "calibration.json"
    doc["cost_model"] = ("hybrimoe calibrate on this machine, given to bench: " + str(cal)) if cal.is_file() \
        else "engine default: a stored calibration, else a short one measured on first use (first bench)"
    failed = [s["step"] for s in steps if s.get("status") in ("failed", "timeout", "no-time")]
    doc["failed_steps"] = failed
    doc["ok"] = not failed and bool(doc.get("correctness", {}).get("passed"))
    _write_json(out_dir / "gpu-check.json", doc)

    # ---- the short summary
    p = print
    p("")
    p(f"== GPU check summary ({args.mode}; device: {doc['device']['device']}) ==")
    for s in steps:
        extra = f" ({s['note']})" if s.get("note") else ""
        p(f"  {s.get('step', '?'):<22} {s.get('status', '?'):<8} {s.get('seconds', 0):>7.1f} s{extra}")
    if "correctness" in doc:
        cs = doc["correctness"]["cases"]
        n_ok = sum(1 for c in cs if c["passed"])
        p(f"  correctness: {n_ok}/{len(cs)} cases passed (same greedy tokens, NMSE <= {doc['correctness']['tol_nmse']})"
          + (f"; errors: {doc['correctness']['errors']}" if doc["correctness"]["errors"] else ""))
    for cache, t in doc["bench"].items():
        if "rows" not in t:
            p(f"  bench {cache}: {t.get('error')}")
            continue
        p(f"  bench moe_cache={cache}:")
        for r in t["rows"]:
            if r.get("error"):
                p(f"    {r['mode']:<30} error: {r['error']}")
            else:
                p(f"    {r['mode']:<30} pp {r['pp_tps']:9.1f} t/s   tg {r['tg_tps']:8.2f} t/s"
                  + (f"   hit {r['hit_rate']:.3f}" if r.get("hit_rate") is not None else "")
                  + (f"   MoE ms/token predicted {r['predicted_moe_ms_per_token']:.2f} / measured "
                     f"{r['measured_moe_ms_per_token']:.2f}" if r.get("predicted_moe_ms_per_token") is not None else ""))
        for phase, s in t["speedup"].items():
            if s.get("speedup") is not None:
                p(f"    speed-up {phase}: {s['speedup']:.2f}x over {s['best_upstream_mode']} (target {s['target']}x)")
    p(f"  cost model: {doc['cost_model']}")
    p(f"  wrote {out_dir / 'gpu-check.json'}" + (f"; failed steps: {', '.join(failed)}" if failed else ""))
    return 0


# ---- requirements, install-deps ------------------------------------------------------------------------------

#: what the run builds itself (not a wheel in the carry), and what it takes as given on the machine: numpy, which
#: this helper imports for every other verb (and, as a wheel, would be a third of the carry folder)
BUILT_HERE = ("llama-cpp-python",)
PRECONDITIONS = ("numpy",)


def _dist_name(requirement: str) -> str:
    """The normalised distribution name of a requirement string (PEP 503: lower case, runs of -_. as one -)."""
    name = re.split(r"[\s\[<>=!~;@(]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _toml_dependencies(text: str, where: str) -> list[str]:
    """``[project].dependencies`` of a pyproject.toml's text; ValueError naming ``where`` when it has none."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip's own copy of tomli
        from pip._vendor import tomli as tomllib
    deps = tomllib.loads(text).get("project", {}).get("dependencies")
    if not isinstance(deps, list):
        raise ValueError(f"{where} has no [project].dependencies list")
    return [str(d) for d in deps]


def runtime_requirements(pyproject: Path, lcp_source: Path | None = None) -> list[str]:
    """The requirements a built hybrimoe needs at run time, as the carry folder must cover them: ``pyproject``'s
    dependencies and, with ``lcp_source`` (llama-cpp-python's sdist or the carry's trimmed tarball of it, each with
    ``<top>/pyproject.toml``), llama-cpp-python's; without the ones in :data:`BUILT_HERE` and
    :data:`PRECONDITIONS`, each distribution once (the first time it is named)."""
    reqs = _toml_dependencies(pyproject.read_text(), str(pyproject))
    if lcp_source is not None:
        with tarfile.open(lcp_source) as tf:
            member = next((m for m in tf.getmembers() if m.name.count("/") == 1
                           and m.name.endswith("/pyproject.toml")), None)
            if member is None:
                raise ValueError(f"{lcp_source} has no <top>/pyproject.toml")
            reqs += _toml_dependencies(tf.extractfile(member).read().decode(), f"{lcp_source}:{member.name}")
    out, seen = [], set(BUILT_HERE) | set(PRECONDITIONS)
    for r in reqs:
        name = _dist_name(r)
        if name not in seen:
            seen.add(name)
            out.append(r.strip())
    return out


def cmd_requirements(args) -> int:
    """Prints the runtime requirements (pyproject.toml's dependencies and llama-cpp-python's, without
    llama-cpp-python itself and numpy), one a line: what ``prepare`` downloads wheels for."""
    try:
        reqs = runtime_requirements(Path(args.pyproject), Path(args.lcp_source) if args.lcp_source else None)
    except (OSError, ValueError, tarfile.TarError) as e:
        _log(f"error: {e}")
        return 2
    print("\n".join(reqs))
    return 0


def cmd_install_deps(args) -> int:
    """Installs into ``--target`` what the running Python lacks of ``--requirements`` (and of their own
    requirements), from the wheels in ``--wheels`` only (no index): pip resolves them against the machine's
    installed packages first (a dry run), so that only the missing ones are installed. Exits 1, naming what is
    missing, when the wheels lack something the machine has not got either."""
    reqs = [line.strip() for line in Path(args.requirements).read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    target = Path(args.target)
    if not reqs:
        _log("install-deps: no requirements")
        return 0
    report = target.parent / f"{target.name}.deps-report.json"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "--no-index", "--find-links",
           str(args.wheels)]
    r = subprocess.run(pip + ["--dry-run", "--quiet", "--report", str(report), *reqs], capture_output=True,
                       text=True)
    if r.returncode != 0:
        _log(f"install-deps: error: the machine lacks requirements that {args.wheels} does not carry either "
             f"(run 'scripts/gpu-check.sh prepare' again, or install them):")
        sys.stderr.write(r.stderr)
        return 1
    wanted = json.loads(report.read_text()).get("install", [])
    report.unlink()
    if not wanted:
        _log(f"install-deps: the machine has every requirement ({', '.join(_dist_name(q) for q in reqs)})")
        return 0
    files = [unquote(urlparse(w["download_info"]["url"]).path) for w in wanted]
    names = [f"{w['metadata']['name']} {w['metadata']['version']}" for w in wanted]
    r = subprocess.run(pip + ["--no-deps", "--no-compile", "--quiet", "--target", str(target), *files],
                       capture_output=True, text=True)
    if r.returncode != 0:
        _log(f"install-deps: error: installing {', '.join(names)} into {target} failed:")
        sys.stderr.write(r.stderr)
        return 1
    _log(f"install-deps: installed {', '.join(names)} into {target} from {args.wheels}")
    return 0


# ---- CLI -----------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("pack-lcp", help=cmd_pack_lcp.__doc__.splitlines()[0])
    p.add_argument("--sdist", required=True, help="llama_cpp_python-X.tar.gz")
    p.add_argument("--llama-tgz", required=True, help="trimmed llama.cpp tarball (scripts/pack-llama-source.sh)")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_pack_lcp)

    p = sub.add_parser("trace-subset", help=cmd_trace_subset.__doc__.splitlines()[0])
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=16384, help="at most this many tokens (0: all)")
    p.set_defaults(fn=cmd_trace_subset)

    p = sub.add_parser("bench-model", help=cmd_bench_model.__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--trace", required=True, help="routing trace with at least layers-1 MoE layers")
    p.add_argument("--info", required=True, help="JSON file to write")
    p.add_argument("--layers", type=int, default=8, help="blocks: 1 dense + layers-1 MoE (default 8)")
    p.add_argument("--n-embd", type=int, default=2048)
    p.add_argument("--n-ff-exp", type=int, default=1408)
    p.add_argument("--n-ff-dense", type=int, default=10944)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_bench_model)

    p = sub.add_parser("correctness", help=cmd_correctness.__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("cuda", "cpu"), required=True)
    p.add_argument("--out", required=True, help="JSON file (rewritten after every case)")
    p.add_argument("--work", required=True, help="folder for the tiny models")
    p.add_argument("--models", default="qwen3moe:Q8_0,deepseek2:Q4_K_M,gpt-oss:MXFP4")
    p.add_argument("--caches", default="25%,50%,100%")
    p.add_argument("--policy", default="hybrimoe")
    p.add_argument("--n-prompt", type=int, default=40)
    p.add_argument("--n-gen", type=int, default=16)
    p.add_argument("--n-ubatch", type=int, default=32)
    p.add_argument("--tol", type=float, default=1e-3, help="largest logits NMSE (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="RPC stand-in server threads (cpu mode)")
    p.add_argument("--no-control", dest="control", action="store_false", help="skip the negative control")
    p.add_argument("--no-two-devices", dest="two_devices", action="store_false",
                   help="skip the two-device case (the GPU plus an RPC server on loopback serving it)")
    p.set_defaults(fn=cmd_correctness)

    p = sub.add_parser("summary", help=cmd_summary.__doc__.splitlines()[0])
    p.add_argument("--work", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--mode", required=True)
    p.add_argument("--started", default="")
    p.add_argument("--t0", default="", help="start time, seconds since the epoch")
    p.set_defaults(fn=cmd_summary)

    p = sub.add_parser("requirements", help=cmd_requirements.__doc__.splitlines()[0])
    p.add_argument("--pyproject", required=True, help="hybrimoe's pyproject.toml")
    p.add_argument("--lcp-source", default=None,
                   help="llama-cpp-python's sdist or trimmed tarball (its dependencies are added)")
    p.set_defaults(fn=cmd_requirements)

    p = sub.add_parser("install-deps", help=cmd_install_deps.__doc__.splitlines()[0])
    p.add_argument("--requirements", required=True, help="file of requirements, one a line")
    p.add_argument("--wheels", required=True, help="folder of wheels (the carry folder's)")
    p.add_argument("--target", required=True, help="folder to install into (PYTHONPATH of the run)")
    p.set_defaults(fn=cmd_install_deps)

    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
