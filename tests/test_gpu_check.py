"""The GPU check's pieces that run without a GPU (scripts/gpu-check.sh): the synthetic DeepSeek-V2-Lite-shaped model
whose quantized blocks are written directly (hybrimoe.tiny.make_synthetic_model), and scripts/gpu_check.py's
packing, trace, bench-model and summary steps. The script itself is rehearsed end to end by hand
(``OUT=/tmp/gpucheck-out scripts/gpu-check.sh run``: it builds everything, too slow for the suite)."""
from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent

# a small deepseek2 with DeepSeek-V2-Lite's peculiarities: expert rows (160) that are not a multiple of 256, so
# ffn_down_exps takes upstream's fallback types; 16 experts (8 has an upstream special case)
SMALL = dict(n_layer=4, n_embd=256, n_ff_exp=160, n_ff_dense=320, n_expert=16, n_expert_used=4, n_shared=2,
             n_head=2, kv_lora_rank=256, qk_rope=32, qk_nope=32, v_head=32, n_dense_lead=1)


def _helper():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _types(path) -> dict:
    import gguf

    return {t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in gguf.GGUFReader(str(path)).tensors}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from hybrimoe.tiny import make_synthetic_model

    return make_synthetic_model(tmp_path_factory.mktemp("synth") / "small.gguf", **SMALL)


def test_synthetic_model_types_and_shapes(small_model):
    """Tensor types follow upstream's Q4_K_M for deepseek2 (gate/up experts Q4_K; down experts Q5_0, or Q8_0 in
    the layers that get Q6_K, because rows of 160 fit no 256-wide block) with ggml shapes {ne0, ne1, ne2}."""
    import gguf

    from hybrimoe.tiny import synthetic_tensor_plan

    got = _types(small_model)
    plan = synthetic_tensor_plan(**{k: v for k, v in SMALL.items() if k != "n_expert_used"})
    assert [n for n, *_ in plan] == list(got)
    for name, shape, t, _ in plan:
        assert got[name] == (t, list(shape)), name
    D, F, E = SMALL["n_embd"], SMALL["n_ff_exp"], SMALL["n_expert"]
    # use_more_bits(il, 4): layers 2 and 3 get Q6_K for ffn_down, Q8_0 after the fallback
    assert got["blk.1.ffn_gate_exps.weight"] == ("Q4_K", [D, F, E])
    assert got["blk.1.ffn_up_exps.weight"] == ("Q4_K", [D, F, E])
    assert got["blk.1.ffn_down_exps.weight"] == ("Q5_0", [F, D, E])
    assert got["blk.2.ffn_down_exps.weight"] == ("Q8_0", [F, D, E])
    assert got["blk.3.ffn_down_exps.weight"] == ("Q8_0", [F, D, E])
    assert got["blk.1.ffn_gate_inp.weight"] == ("F32", [D, E])
    assert got["output.weight"][0] == "Q6_K"
    assert "blk.0.ffn_down.weight" in got and "blk.0.ffn_gate_exps.weight" not in got  # one leading dense layer
    r = gguf.GGUFReader(str(small_model))
    kv = {f.name: f for f in r.fields.values()}

    def val(key):
        f = kv[key]
        return f.parts[f.data[0]][0]

    assert val("deepseek2.expert_count") == E and val("deepseek2.expert_used_count") == 4
    assert val("deepseek2.attention.q_lora_rank") == 0 and val("deepseek2.expert_shared_count") == 2


def test_synthetic_model_loads_and_runs_in_llama_cpp(small_model, logits):
    """llama.cpp loads the file and computes finite logits from it."""
    from hybrimoe import Llama

    llm = Llama(str(small_model), n_ctx=64, n_batch=64, verbose=False)
    try:
        assert llm.n_vocab() == 512
        llm.eval(llm.tokenize(b"once upon a time the cat", add_bos=True))
        lg = logits(llm)
    finally:
        llm.close()
    assert np.isfinite(lg).all() and lg.std() > 0


def test_q4_k_m_plan_matches_upstream_quantizer(tmp_path):
    """The type plan equals what llama.cpp's own quantizer (llama_model_quantize, Q4_K_M) makes of the same
    model written as F32, fallbacks and Q6_K layers included, for 5 and 8 blocks."""
    from hybrimoe.tiny import make_synthetic_model, quantize_gguf

    for n_layer in (5, 8):
        kw = dict(SMALL, n_layer=n_layer)
        direct = make_synthetic_model(tmp_path / f"direct-{n_layer}.gguf", **kw)
        f32 = make_synthetic_model(tmp_path / f"f32-{n_layer}.gguf", quant="F32", **kw)
        quantize_gguf(f32, tmp_path / f"q-{n_layer}.gguf", "Q4_K_M")
        assert _types(direct) == _types(tmp_path / f"q-{n_layer}.gguf")


@pytest.mark.parametrize("type_name,row_len", [("Q4_K", 512), ("Q6_K", 256), ("Q5_0", 160), ("Q8_0", 96)])
def test_random_quant_rows_dequantize_to_small_zero_mean_weights(type_name, row_len):
    """Random blocks are valid: finite when dequantized, mean ~0, standard deviation ~ the asked one."""
    import gguf
    from gguf.quants import dequantize

    from hybrimoe.tiny import random_quant_rows

    blocks = random_quant_rows(np.random.default_rng(1), type_name, 256, row_len, 0.02)
    blk, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    assert blocks.dtype == np.uint8 and blocks.shape == (256, row_len // blk * size)
    w = dequantize(blocks, gguf.GGMLQuantizationType[type_name])
    assert w.shape == (256, row_len) and np.isfinite(w).all()
    assert abs(float(w.mean())) < 0.002 and 0.018 < float(w.std()) < 0.022


def test_synthetic_model_bad_input(tmp_path):
    from hybrimoe.tiny import make_synthetic_model, random_quant_rows

    with pytest.raises(ValueError, match="8-expert"):
        make_synthetic_model(tmp_path / "a.gguf", **dict(SMALL, n_expert=8))
    with pytest.raises(ValueError, match="n_dense_lead"):
        make_synthetic_model(tmp_path / "b.gguf", **dict(SMALL, n_dense_lead=4))
    with pytest.raises(ValueError, match="multiple of 32"):
        make_synthetic_model(tmp_path / "c.gguf", **dict(SMALL, n_ff_exp=100))
    with pytest.raises(ValueError, match="quant"):
        make_synthetic_model(tmp_path / "d.gguf", quant="Q8_0", **SMALL)
    with pytest.raises(ValueError, match="no writer"):
        random_quant_rows(np.random.default_rng(0), "IQ2_XS", 1, 256, 0.1)
    assert not list(tmp_path.iterdir())  # nothing half-written left behind


# ---- scripts/gpu_check.py --------------------------------------------------------------------------------------

def _tar(path: Path, files: dict) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_pack_lcp_keeps_the_python_package_and_the_trimmed_tree(tmp_path):
    """pack-lcp: the sdist's package and build files, the trimmed llama.cpp tree under vendor/, not the sdist's own
    (untrimmed) vendor tree; llama.cpp's common library no longer forced on."""
    h = _helper()
    top = "llama_cpp_python-9.9.9"
    sdist = _tar(tmp_path / "sdist.tar.gz", {
        f"{top}/CMakeLists.txt": "project(x)\n    " + h._LCP_COMMON_ON + "\n",
        f"{top}/pyproject.toml": "[project]\n", f"{top}/README.md": "r", f"{top}/PKG-INFO": "p",
        f"{top}/llama_cpp/__init__.py": "__version__ = '9.9.9'\n", f"{top}/docs/big.md": "x",
        f"{top}/vendor/llama.cpp/models/huge.gguf": "x" * 1000})
    trimmed = _tar(tmp_path / "llama.tar.gz", {"llama.cpp/CMakeLists.txt": "c", "llama.cpp/src/llama.cpp": "s"})
    out = tmp_path / "out.tar.gz"
    assert h.main(["pack-lcp", "--sdist", str(sdist), "--llama-tgz", str(trimmed), "--out", str(out)]) == 0
    with tarfile.open(out) as tf:
        names = {m.name for m in tf.getmembers() if m.isfile()}
        cm = tf.extractfile(f"{top}/CMakeLists.txt").read().decode()
    assert names == {f"{top}/CMakeLists.txt", f"{top}/pyproject.toml", f"{top}/README.md", f"{top}/PKG-INFO",
                     f"{top}/llama_cpp/__init__.py", f"{top}/vendor/llama.cpp/CMakeLists.txt",
                     f"{top}/vendor/llama.cpp/src/llama.cpp"}
    assert "LLAMA_BUILD_COMMON OFF" in cm and "LLAMA_BUILD_COMMON ON" not in cm


def _fake_trace(path: Path, n_layers=5, n_tokens=300, E=16, k=4) -> Path:
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(E, size=k, replace=False) for _ in range(n_layers)])
                    for _ in range(n_tokens)]).astype(np.int8)
    np.savez_compressed(path, expert_ids=ids, prompt_offsets=np.array([0, 100, 180, 300]),
                        moe_layer_ids=np.arange(1, n_layers + 1), num_experts=np.array(E), top_k=np.array(k),
                        expert_bytes=np.full(n_layers, 1000.0))
    return path


def test_trace_subset_keeps_whole_prompts(tmp_path):
    h = _helper()
    src = _fake_trace(tmp_path / "t.npz")
    out = tmp_path / "sub.npz"
    assert h.main(["trace-subset", "--src", str(src), "--out", str(out), "--tokens", "200"]) == 0
    with np.load(out) as z:
        assert z["expert_ids"].shape == (180, 5, 4)
        assert z["prompt_offsets"].tolist() == [0, 100, 180]
    assert h.main(["trace-subset", "--src", str(src), "--out", str(out), "--tokens", "50"]) == 0
    with np.load(out) as z:  # at least one prompt
        assert z["prompt_offsets"].tolist() == [0, 100]


def test_bench_model_cuts_the_trace_to_the_model(tmp_path):
    """bench-model writes the model with the trace's experts and top-k and a trace of its MoE layers that
    --replay-trace accepts (replay_table)."""
    from hybrimoe.replay import replay_table

    h = _helper()
    trace = _fake_trace(tmp_path / "t.npz")
    info = tmp_path / "info.json"
    args = ["bench-model", "--out-dir", str(tmp_path / "m"), "--trace", str(trace), "--info", str(info),
            "--layers", "3", "--n-embd", "256", "--n-ff-exp", "160", "--n-ff-dense", "320", "--n-head", "2"]
    assert h.main(args) == 0
    doc = json.loads(info.read_text())
    assert doc["n_moe_layers"] == 2 and not doc["reused"]
    assert doc["tensor_types"]["ffn_down_exps.weight"] == ["Q5_0", "Q8_0"]
    table = replay_table(doc["trace"], doc["model"])
    assert table.shape == (300, 3, 4) and (table[:, 0] == 0).all()
    assert h.main(args) == 0 and json.loads(info.read_text())["reused"]  # same knobs: the model is reused
    assert h.main(args[:-8] + ["--layers", "9"]) == 2  # 8 MoE layers, the trace has 5


def test_summary_computes_the_speedup_over_the_best_upstream_mode(tmp_path, capsys):
    h = _helper()
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "steps.jsonl").write_text(
        '{"step": "build-llama-cpp-python", "status": "ok", "rc": 0, "seconds": 300.0, "budget_s": 0, "note": ""}\n'
        '{"step": "bench-50", "status": "timeout", "rc": 124, "seconds": 100.0, "budget_s": 100, "note": ""}\n')

    def row(mode, pp, tg, **kw):
        return dict(mode=mode, pp_tps=pp, pp_tps_sd=1.0, tg_tps=tg, tg_tps_sd=0.1, repetitions=2, n_prompt=512,
                    n_gen=128, gpu_expert_bytes=0, same_tokens_as_first=2, **kw)

    (out / "bench-25.json").write_text(json.dumps(dict(moe_cache="25%", rows=[
        row("upstream -ot exps=CPU", 100.0, 10.0), row("upstream --n-cpu-moe 5", 120.0, 8.0),
        row("hybrimoe hybrimoe", 240.0, 25.0, hit_rate=0.5), dict(mode="upstream -ngl 3", error="boom")])))
    (out / "correctness.json").write_text(json.dumps(dict(passed=True, tol_nmse=1e-3, errors=[], cases=[
        dict(model="qwen3moe:Q8_0", kind="case", moe_cache="25%", passed=True, nmse=0.0)])))
    assert h.main(["summary", "--work", str(work), "--out-dir", str(out), "--mode", "cpu"]) == 0
    doc = json.loads((out / "gpu-check.json").read_text())
    s = doc["speedup_25"]
    assert s["prefill"]["best_upstream_mode"] == "upstream --n-cpu-moe 5" and s["prefill"]["speedup"] == 2.0
    assert s["decode"]["best_upstream_mode"] == "upstream -ot exps=CPU" and s["decode"]["speedup"] == 2.5
    assert doc["build_seconds"] == {"build-llama-cpp-python": 300.0}
    assert doc["failed_steps"] == ["bench-50"] and doc["ok"] is False
    assert doc["correctness"]["passed"] is True
    csv_text = (out / "bench.csv").read_text().splitlines()
    assert csv_text[0].startswith("moe_cache,mode,") and len(csv_text) == 5
    assert "speed-up prefill: 2.00x" in capsys.readouterr().out


def test_gpu_check_script_usage_errors(tmp_path):
    sh = ROOT / "scripts" / "gpu-check.sh"
    assert subprocess.run(["bash", "-n", str(sh)]).returncode == 0
    r = subprocess.run([str(sh), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "scripts/gpu-check.sh run" in r.stdout
    env = {k: v for k, v in __import__("os").environ.items() if k != "OUT"}
    r = subprocess.run([str(sh), "run"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "no output folder" in r.stderr
    r = subprocess.run([str(sh), "frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown verb" in r.stderr


def test_correctness_step_has_a_gpt_oss_mxfp4_case(tmp_path):
    """The CUDA correctness step's gpt-oss case (tiny, MXFP4 experts with biases, SwiGLU-OAI) is in its default
    model list and passes on the RPC stand-in (--mode cpu: the same code path, another device), with its negative
    control (the GPU share's outputs dropped) detected."""
    h = _helper()
    assert ("gpt-oss", "MXFP4") in h.correctness_recipes()
    assert "gpt-oss:MXFP4" in (ROOT / "scripts" / "gpu-check.sh").read_text()
    out = tmp_path / "correctness.json"
    # in a process of its own, as on the GPU machine: the step registers its RPC device in ggml's registry, where
    # it stays after the step stops the server, and a plain llama_cpp.Llama made later in this process would then
    # fail to create its context on the gone device
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "correctness", "--mode", "cpu",
                        "--out", str(out), "--work", str(tmp_path / "tiny"), "--models", "gpt-oss:MXFP4",
                        "--caches", "50%", "--n-prompt", "20", "--n-gen", "8", "--n-ubatch", "8"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600)
    doc = json.loads(out.read_text())
    assert r.returncode == 0 and doc["passed"], (doc, r.stderr[-2000:])
    kinds = {c["kind"]: c for c in doc["cases"]}
    assert kinds["case"]["mixed_split"] and kinds["case"]["same_tokens"]
    assert kinds["control"]["passed"]
    import gguf

    types = _types(tmp_path / "tiny" / "tiny-gpt-oss-MXFP4.gguf")
    assert types["blk.0.ffn_down_exps.weight"][0] == gguf.GGMLQuantizationType.MXFP4.name
