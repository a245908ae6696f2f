"""vendor/llama.cpp/prepare_source.py: local sources, checksum and patch failures give clear messages."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "vendor" / "llama.cpp" / "prepare_source.py"

pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="needs the source checkout")


def run(env_extra, tmp_path):
    env = dict(os.environ, HYBRIMOE_CACHE_DIR=str(tmp_path / "cache"), **env_extra)
    return subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def _tarball(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama.cpp/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_patch_that_does_not_apply_is_named(tmp_path):
    tb = _tarball(tmp_path / "fake.tar.gz", {"CMakeLists.txt": "", "include/llama.h": "// not upstream\n",
                                            "src/llama-graph.cpp": "\n", "src/llama-cparams.h": "\n"})
    r = run({"HYBRIMOE_LLAMA_SRC": str(tb)}, tmp_path)
    assert r.returncode != 0
    assert "patch 0001-moe-hook.patch does not apply" in r.stderr


def test_local_tree_without_patches_is_refused(tmp_path):
    tree = tmp_path / "tree"
    (tree / "include").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("")
    (tree / "include" / "llama.h").write_text("// no hook\n")
    r = run({"HYBRIMOE_LLAMA_SRC": str(tree)}, tmp_path)
    assert r.returncode != 0 and "llama_set_moe_hook" in r.stderr
    (tree / "include" / "llama.h").write_text("LLAMA_API void llama_set_moe_hook(void);\n")
    r = run({"HYBRIMOE_LLAMA_SRC": str(tree)}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "as given" in r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(tree)


def test_wrong_sdist_checksum(tmp_path):
    import json

    pin = json.loads((SCRIPT.parent / "pin.json").read_text())
    bad = tmp_path / pin["sdist"]
    bad.write_bytes(b"not the real sdist")
    r = run({"HYBRIMOE_LLAMA_SRC": str(bad)}, tmp_path)
    assert r.returncode != 0 and "does not match the pinned" in r.stderr


def test_missing_source_path(tmp_path):
    r = run({"HYBRIMOE_LLAMA_SRC": str(tmp_path / "nowhere")}, tmp_path)
    assert r.returncode != 0 and "no such file or directory" in r.stderr
