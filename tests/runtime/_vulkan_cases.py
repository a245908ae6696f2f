"""Worker of tests/runtime/test_vulkan.py: runs one tiny model's cases on ggml's Vulkan device in a process of its own.

A separate process because ggml's Vulkan backend reads ``GGML_VK_VISIBLE_DEVICES`` (which makes Mesa's lavapipe,
a CPU-type device that ggml skips by default, visible as ``Vulkan0``) once, when the backend registers: the test
process itself must keep the devices it started with. Each cold process compiles Vulkan pipelines (about 18 s
on lavapipe, a few with a warm ``MESA_SHADER_CACHE_DIR``), so one process serves all cases of one model.

Usage: ``python _vulkan_cases.py SPEC.json OUT.json``. SPEC: ``{"arch", "quant", "seed" (of the fixture), "work"
(a folder), "cost" (a cost model file), "cases": [{"id", "kind" ("case", "control", "repeat", "split" or "ram"), "cache", "policy", "ubatch",
"n_prompt", "max_buffer_bytes" (0: the device's cap), "ram" (true: the RAM tier below, smallest budget)}], "n_gen"}``. OUT: ``{"devices": [...], "accelerator",
"cases": [{"id", "same_tokens", "nmse", "gpu_experts", "cpu_experts", "slot_buffers", "failed", "error",
"tokens", "seconds"}], "error"}``. The oracle of a case is upstream llama.cpp with the same placement on the
same device (``n_gpu_layers=-1, tensor_buft_overrides="exps=CPU", no_repack=True``) at the case's ubatch.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    doc: dict = {"cases": [], "error": ""}
    out = Path(out_path)

    def save():
        out.write_text(json.dumps(doc))

    try:
        import numpy as np

        import hybrimoe  # noqa: F401  (before llama_cpp: hybrimoe's libllama and ggml-cpu)
        from hybrimoe import Llama, _ggml
        from hybrimoe.policy import PROFILE_PRESETS
        from hybrimoe.runtime.engine_facts import engine_facts
        from hybrimoe.testing.upstream import greedy_with_logits, nmse, prompt_tokens
        from hybrimoe.tiny import fixture_set, make_tiny_model

        devs = _ggml.devices()
        doc["devices"] = [{k: d[k] for k in ("name", "description", "type", "reg", "total")} for d in devs]
        acc = _ggml.accelerator([])
        doc["accelerator"] = _ggml.device_label(acc) if acc else None
        doc["accelerator_reg"] = next((d["reg"] for d in devs if d["ptr"] == acc), None)
        save()
        if doc["accelerator_reg"] != "Vulkan":
            doc["error"] = f"the accelerator is not a Vulkan device: {doc['accelerator']} ({doc['accelerator_reg']})"
            save()
            return 1
        arch, quant, work = spec["arch"], spec["quant"], Path(spec["work"])
        path = make_tiny_model(work / f"vk-{arch}-{quant}.gguf",
                               **dict(fixture_set()[(arch, quant)], seed=int(spec.get("seed", 0))))
        facts = engine_facts(path)
        n_gen = int(spec.get("n_gen", 32))
        refs: dict = {}
        for case in spec["cases"]:
            t0 = time.monotonic()
            res = {"id": case["id"], "kind": case["kind"]}
            try:
                ub, n_prompt = int(case["ubatch"]), int(case["n_prompt"])
                common = dict(n_gpu_layers=-1, n_ctx=n_prompt + n_gen + 16, n_batch=max(ub, n_prompt), n_ubatch=ub,
                              seed=0, verbose=False)
                key = (ub, n_prompt)
                if key not in refs:
                    ref = Llama(str(path), tensor_buft_overrides="exps=CPU", no_repack=True, **common)
                    try:
                        tokens = prompt_tokens(ref, n_prompt)
                        refs[key] = (tokens,) + greedy_with_logits(ref, tokens, n_gen)
                    finally:
                        ref.close()
                tokens, ref_out, ref_lg = refs[key]
                policy = case["policy"]
                profile = (np.random.default_rng(0).integers(0, 50, (len(facts.moe_layers), facts.n_expert))
                           if policy in PROFILE_PRESETS else None)
                if case.get("max_buffer_bytes"):
                    os.environ["HYBRIMOE_MAX_BUFFER_BYTES"] = str(int(case["max_buffer_bytes"]))
                else:
                    os.environ.pop("HYBRIMOE_MAX_BUFFER_BYTES", None)
                ram = {}
                if case.get("ram"):  # the RAM tier below the GPU cache, at its smallest budget
                    from hybrimoe.runtime.ram_tier import min_ram_slots

                    ram = dict(moe_ram_cache=min_ram_slots(facts, ub) * facts.ram_slot_bytes)
                llm = Llama(str(path), moe_cache=case["cache"], moe_policy=policy, moe_profile=profile,
                            moe_cost_model=spec["cost"], **ram, **common)
                try:
                    if case["kind"] == "control":
                        llm.moe_engine.set_drop_gpu_share(True)
                    res["slot_buffers"] = llm.moe_engine.slot_buffers
                    res["n_slots"] = llm.moe_engine.n_slots
                    res["n_expert"] = facts.n_expert
                    res["host_buffer_type"] = llm.moe_setup.host_buffer_type
                    res["device"] = llm.moe_setup.device_label
                    out_t, lg = greedy_with_logits(llm, tokens, n_gen)
                    e = llm.moe_stats()["engine"]
                    if ram:
                        res["ram"] = {k: e["ram"][k] for k in ("misses", "evictions", "buffers", "pinned",
                                                               "reads_in_flight", "bytes_read")}
                    res["error"] = llm.moe_engine.take_error()
                finally:
                    llm.close()
                res.update(same_tokens=out_t == ref_out, n_tokens=len(out_t), tokens=out_t,
                           nmse=nmse(lg, ref_lg), finite=bool(np.isfinite(lg).all()),
                           gpu_experts=e["gpu_experts"], cpu_experts=e["cpu_experts"],
                           bytes_copied=e["bytes_copied"], hit_rate=e["hit_rate"], failed=e["failed"])
            except Exception as ex:  # one case failing must not hide the others
                res["error"] = f"{type(ex).__name__}: {ex}\n{traceback.format_exc()}"
            res["seconds"] = round(time.monotonic() - t0, 2)
            doc["cases"].append(res)
            save()
    except Exception as ex:
        doc["error"] = f"{type(ex).__name__}: {ex}\n{traceback.format_exc()}"
        save()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
