#!/usr/bin/env python3
"""Obtain, verify, patch and cache the upstream llama.cpp tree that hybrimoe builds on.

Source, in order of preference:
  1. ``HYBRIMOE_LLAMA_SRC`` = a llama.cpp directory (used as given: no sha check, no patching; the log says so),
     or a tarball (.tar.gz/.tgz): either the llama-cpp-python sdist (checked against pin.json's sha256) or a
     trimmed llama.cpp tree packed by ``scripts/pack-llama-source.sh`` (patched like the sdist);
  2. the pinned llama-cpp-python sdist from the package registry (``pip download``), checked against pin.json.

The patched tree is cached outside the build directory, under
``$HYBRIMOE_CACHE_DIR`` or ``$XDG_CACHE_HOME/hybrimoe`` or ``~/.cache/hybrimoe``, keyed by the source checksum
and the patch series, so rebuilds and reinstalls reuse it. Prints the path of the tree on the last line.
Exits non-zero with a message naming the patch that does not apply.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIN = json.loads((HERE / "pin.json").read_text())
PATCHES = sorted((HERE / "patches").glob("*.patch"))


def log(msg: str) -> None:
    print(f"[hybrimoe] {msg}", file=sys.stderr, flush=True)


def die(msg: str) -> "None":
    print(f"[hybrimoe] error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def cache_dir() -> Path:
    root = os.environ.get("HYBRIMOE_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "hybrimoe")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_sdist(dest: Path) -> Path:
    target = dest / PIN["sdist"]
    if target.exists() and sha256(target) == PIN["sha256"]:
        return target
    log(f"fetching {PIN['package']}=={PIN['version']} source distribution with pip")
    import importlib.util

    if importlib.util.find_spec("pip") is None:
        die(f"pip is not importable by {sys.executable}; install pip, or set HYBRIMOE_LLAMA_SRC to the "
            f"{PIN['sdist']} file or a llama.cpp directory")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PIN["package"],
           "--no-build-isolation", "-d", str(dest), f"{PIN['package']}=={PIN['version']}"]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0 or not target.exists():
        die("could not download the llama-cpp-python sdist (no network?). Set HYBRIMOE_LLAMA_SRC to a local "
            f"llama.cpp directory or tarball.\n{r.stdout[-2000:]}")
    return target


def check_sdist(path: Path) -> None:
    got = sha256(path)
    if got != PIN["sha256"]:
        die(f"{path}: sha256 {got} does not match the pinned {PIN['sha256']} ({PIN['sdist']})")


def extract_llama(tarball: Path, dest: Path) -> None:
    """Extract the llama.cpp tree of an sdist (under <top>/vendor/llama.cpp) or of a trimmed tarball into dest."""
    with tarfile.open(tarball) as tf:
        members = tf.getmembers()
        names = [m.name for m in members]
        prefix = None
        for n in names:
            parts = n.split("/")
            if len(parts) >= 4 and parts[1:3] == ["vendor", "llama.cpp"]:
                prefix = "/".join(parts[:3]) + "/"
                break
        if prefix is None:  # trimmed tree: <top>/CMakeLists.txt
            tops = {n.split("/")[0] for n in names}
            if len(tops) != 1 or f"{next(iter(tops))}/CMakeLists.txt" not in names:
                die(f"{tarball}: neither a llama-cpp-python sdist nor a llama.cpp tarball")
            prefix = next(iter(tops)) + "/"
        sel = []
        for m in members:
            if not m.name.startswith(prefix) or m.name == prefix.rstrip("/"):
                continue
            m.name = m.name[len(prefix):]
            if m.name.startswith("/") or ".." in Path(m.name).parts:
                die(f"{tarball}: unsafe path {m.name}")
            sel.append(m)
        tf.extractall(dest, members=sel)
    gitfile = dest / ".git"
    if gitfile.is_file():  # submodule pointer from the sdist: meaningless here
        gitfile.unlink()


def apply_patches(tree: Path) -> None:
    for p in PATCHES:
        check = subprocess.run(["patch", "-p1", "--dry-run", "--forward", "-s", "-i", str(p)], cwd=tree,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if check.returncode != 0:
            die(f"patch {p.name} does not apply to {tree}:\n{check.stdout[-3000:]}")
        subprocess.run(["patch", "-p1", "--forward", "-s", "-i", str(p)], cwd=tree, check=True)
        log(f"applied {p.name}")


def main() -> None:
    if shutil.which("patch") is None:
        die("the 'patch' program is required (apt-get install patch)")
    series = hashlib.sha256()
    for p in PATCHES:
        series.update(p.name.encode())
        series.update(p.read_bytes())
    src = os.environ.get("HYBRIMOE_LLAMA_SRC")
    cache = cache_dir()
    if src:
        srcp = Path(src).expanduser().resolve()
        if srcp.is_dir():
            if not (srcp / "CMakeLists.txt").exists() or not (srcp / "include" / "llama.h").exists():
                die(f"HYBRIMOE_LLAMA_SRC={srcp} is not a llama.cpp tree (no include/llama.h)")
            log(f"using the local llama.cpp tree {srcp} as given (HYBRIMOE_LLAMA_SRC; not verified, not patched)")
            if "llama_set_moe_hook" not in (srcp / "include" / "llama.h").read_text(errors="replace"):
                die(f"{srcp}: include/llama.h lacks llama_set_moe_hook: apply vendor/llama.cpp/patches first")
            print(srcp)
            return
        if not srcp.is_file():
            die(f"HYBRIMOE_LLAMA_SRC={src}: no such file or directory")
        tarball = srcp
        if tarball.name == PIN["sdist"]:
            check_sdist(tarball)
        key = sha256(tarball)[:16]
        log(f"using the local tarball {tarball} (HYBRIMOE_LLAMA_SRC)")
    else:
        tarball = download_sdist(cache)
        check_sdist(tarball)
        key = PIN["sha256"][:16]
    tree = cache / f"llama.cpp-{key}-{series.hexdigest()[:12]}"
    stamp = tree / ".hybrimoe-prepared"
    if stamp.exists():
        log(f"reusing the patched tree {tree}")
        print(tree)
        return
    tmp = Path(tempfile.mkdtemp(prefix="llama.cpp-", dir=cache))
    try:
        extract_llama(tarball, tmp)
        apply_patches(tmp)
        stamp_tmp = tmp / ".hybrimoe-prepared"
        stamp_tmp.write_text(json.dumps({"source": str(tarball), "patches": [p.name for p in PATCHES]}))
        if tree.exists():
            shutil.rmtree(tree)
        tmp.rename(tree)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"prepared the patched tree {tree}")
    print(tree)


if __name__ == "__main__":
    main()
