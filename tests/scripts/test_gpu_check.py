"""The GPU check's carry folder (scripts/gpu-check.sh, scripts/gpu_check.py): it covers every runtime requirement
that pyproject.toml names, and the run installs from it, offline, what the machine's Python lacks."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's own copy of tomli
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]  # the checkout these tests belong to
HELPER = ROOT / "scripts" / "gpu_check.py"
pytestmark = pytest.mark.skipif(not HELPER.is_file(), reason="no checkout beside the package")


def _helper(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HELPER), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def _name(requirement: str) -> str:
    return requirement.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower().replace("_", "-")


def test_the_carry_covers_pyprojects_dependencies(tmp_path):
    """What prepare downloads wheels for is read from pyproject.toml: each of its dependencies but llama-cpp-python
    (built by the run) and numpy (the helper's own precondition), and a dependency added there is added here."""
    r = _helper("requirements", "--pyproject", str(ROOT / "pyproject.toml"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    carried = {_name(line) for line in r.stdout.split()}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {_name(d) for d in deps} - {"llama-cpp-python", "numpy"}
    assert {"tqdm", "matplotlib", "gguf"} <= wanted  # the dependencies this carry lacked once
    assert wanted <= carried, (wanted, carried)
    more = tmp_path / "pyproject.toml"
    more.write_text((ROOT / "pyproject.toml").read_text().replace('dependencies = [\n',
                                                                   'dependencies = [\n    "zstandard>=0.22",\n', 1))
    r = _helper("requirements", "--pyproject", str(more), cwd=tmp_path)
    assert r.returncode == 0 and "zstandard>=0.22" in r.stdout.split(), r.stdout + r.stderr


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A pure-Python wheel of one module ``name`` (``__init__`` defining VERSION) that requires ``requires``."""
    dist, info = name.replace("-", "_"), f"{name.replace('-', '_')}-{version}.dist-info"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    files = {f"{dist}/__init__.py": f"VERSION = {version!r}\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: " + name + "\nVersion: " + version + "\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hybrimoe-tests\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def test_install_deps_installs_only_what_the_machine_lacks(tmp_path):
    """A requirement the machine has (numpy) stays the machine's; one it lacks comes from the carry's wheels, with
    what that one requires; one neither has is named, with the failure."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "gpucheck-probe", "1.0", ["gpucheck-probe-dep>=2", "numpy"])
    _wheel(wheels, "gpucheck-probe-dep", "2.1", [])
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("gpucheck-probe>=1\nnumpy>=1.0\n")
    site = tmp_path / "site"
    r = _helper("install-deps", "--requirements", str(reqs), "--wheels", str(wheels), "--target", str(site),
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == [
        "gpucheck_probe", "gpucheck_probe_dep"], list(site.iterdir())
    assert "gpucheck-probe 1.0" in r.stderr and "gpucheck-probe-dep 2.1" in r.stderr, r.stderr
    probe = subprocess.run([sys.executable, "-c", "import gpucheck_probe_dep; print(gpucheck_probe_dep.VERSION)"],
                           env={"PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "2.1", probe.stderr
    reqs.write_text("gpucheck-probe>=1\ngpucheck-not-carried>=1\n")
    r = _helper("install-deps", "--requirements", str(reqs), "--wheels", str(wheels), "--target",
                str(tmp_path / "site2"), cwd=tmp_path)
    assert r.returncode == 1 and "gpucheck-not-carried" in r.stderr, r.stderr
    assert not (tmp_path / "site2").exists()


def test_the_run_installs_the_carry_in_both_modes():
    """The shell script installs the requirements in its build step, before either mode's build, and no longer
    installs a fixed list of wheels."""
    script = (ROOT / "scripts" / "gpu-check.sh").read_text()
    build = script.split("\nbuild() {", 1)[1].split("\n}\n", 1)[0]
    install = build.index('"$helper" install-deps --requirements "$carry/requirements.txt"')
    assert install < build.index('if [ "$GPUCHECK_MODE" = cuda ]'), "install-deps must run before the mode's build"
    assert '"$carry"/wheels/*.whl' not in build
    prepare = script.split("\nprepare() {", 1)[1].split("\n}\n", 1)[0]
    assert '"$helper" requirements --pyproject "$here/pyproject.toml"' in prepare
