"""README's Python examples run as written: "From Python" on this machine (its GPU example, on a machine without an
accelerator, fails with the error the README promises; its CPU-only example runs), quietly (``verbose=False``, so
that llama.cpp's log stays off stderr), and every ``Llama(...)`` example says how verbose it is."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the checkout these tests belong to
README = ROOT / "README.md"
pytestmark = pytest.mark.skipif(not README.is_file(), reason="no checkout beside the package")


def python_blocks(section: str | None = None) -> list[str]:
    """The ```python blocks of README.md, of the section titled ``section`` only when given."""
    text = README.read_text()
    if section is not None:
        text = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _llama_calls(code: str) -> list[str]:
    """The text of each ``Llama(...)`` call in ``code``, parentheses balanced."""
    calls = []
    for m in re.finditer(r"\bLlama\(", code):
        depth, i = 0, m.end() - 1
        for i in range(m.end() - 1, len(code)):
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            if depth == 0:
                break
        calls.append(code[m.start():i + 1])
    return calls


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_every_llama_example_says_how_verbose_it_is():
    calls = [c for block in python_blocks() for c in _llama_calls(block)]
    assert len(calls) >= 4, calls  # the scan finds the examples
    assert [c for c in calls if "verbose=" not in c] == []


def test_the_from_python_examples_run_as_written(tiny_model, tmp_path):
    """The GPU example runs where there is an accelerator; without one it fails with a ValueError that names the
    back ends and the CPU-only options, which the next example shows; that one runs here. Neither writes more than
    a line or two to stderr."""
    from hybrimoe import _ggml

    model = repr(str(tiny_model("qwen3moe", "Q8_0")))
    gpu, cpu = python_blocks("From Python")[:2]
    r = _run(gpu.replace('"model.gguf"', model), tmp_path)
    if _ggml.local_gpus():
        assert r.returncode == 0 and "hit_rate" in r.stdout, r.stderr
    else:
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode != 0 and last.startswith("ValueError: moe_cache='25%'"), r.stderr
        for named in ("CUDA", "Vulkan", "rpc_servers", "moe_cache=0", "moe_ram_cache"):
            assert named in last, (named, last)
    code = ("from hybrimoe import Llama\n" + cpu.replace('"model.gguf"', model) +
            "print(llm('Once upon a time', max_tokens=4, temperature=0)['choices'][0]['text'])\n"
            "print(llm.moe_stats()['engine']['cpu_experts'])\n")
    r = _run(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) > 0  # the engine ran the experts on the CPU
    assert len(r.stderr.splitlines()) <= 2, r.stderr


def test_the_batch_example_runs_as_written(tiny_model, tmp_path):
    """README's ``create_completions`` example: four prompts over four sequences, one text each."""
    model = repr(str(tiny_model("qwen3moe", "Q8_0")))
    block = [b for b in python_blocks("From Python") if "create_completions" in b]
    assert len(block) == 1
    code = "from hybrimoe import Llama\n" + block[0].replace('"model.gguf"', model)
    r = _run(code, tmp_path)
    assert r.returncode == 0, r.stderr
    texts = ast.literal_eval(r.stdout.strip().splitlines()[-1])  # the printed list
    assert isinstance(texts, list) and len(texts) == 4
