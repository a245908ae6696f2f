"""Documented names work as written: every ``hybrimoe.x.y`` dotted name in README.md, CHANGELOG.md and docs/*.md
resolves after a plain ``import hybrimoe`` (in a fresh process), but the old names of CHANGELOG.md's table of moves,
which are gone."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the checkout these tests belong to
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
#: a dotted name in the text; file format names (``hybrimoe.cost_model/3``, ``hybrimoe.trace`` version 2) are not
#: Python names and are followed by a slash or named as a format
DOTTED = re.compile(r"(?<![\w./-])(hybrimoe(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?![\w/])")


def moved_names(changelog: str) -> set:
    """The old names of CHANGELOG.md's tables of moves (the first column of each table under a "### Moved" heading):
    history, no longer importable."""
    old = set()
    for section in changelog.split("\n### Moved")[1:]:
        section = section.split("\n#", 1)[0]
        for line in section.splitlines():
            if line.startswith("| ") and not line.startswith("| old "):
                old |= set(DOTTED.findall(line.split("|")[1]))
    return old


def documented_names() -> list[str]:
    """The dotted names of the docs; of CHANGELOG.md's, those that are not, and are not under, an old name of its
    tables of moves."""
    names = set()
    for doc in DOCS:
        if not doc.is_file():
            continue
        text = doc.read_text()
        found = set(DOTTED.findall(text))
        if doc.name == "CHANGELOG.md":
            gone = moved_names(text)
            found = {n for n in found if not any(n == g or n.startswith(g + ".") for g in gone)}
        names.update(found)
    return sorted(names)


@pytest.mark.skipif(not (ROOT / "README.md").is_file(), reason="no checkout beside the package")
def test_every_documented_name_resolves_after_import_hybrimoe():
    names = documented_names()
    assert len(names) >= 20, names  # the scan finds the README's names
    code = """
import json, sys, warnings
warnings.simplefilter("ignore")
import hybrimoe
bad = []
for name in json.loads(sys.argv[1]):
    obj = hybrimoe
    try:
        for part in name.split(".")[1:]:
            obj = getattr(obj, part)
    except AttributeError as e:
        bad.append(f"{name}: {e}")
print(json.dumps(bad))
"""
    r = subprocess.run([sys.executable, "-c", code, json.dumps(names)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


@pytest.mark.skipif(not (ROOT / "CHANGELOG.md").is_file(), reason="no checkout beside the package")
def test_the_old_names_of_the_moves_are_gone():
    """The old module paths of CHANGELOG.md's table of moves import no more, as it says (the new ones are
    documented names: the test above resolves them)."""
    text = (ROOT / "CHANGELOG.md").read_text()
    old = moved_names(text)
    assert {"hybrimoe.engine", "hybrimoe.trace", "hybrimoe.simulate"} <= old  # the scan reads the table
    code = """
import importlib, json, sys
import hybrimoe
alive = []
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ImportError:
        continue
    alive.append(name)
print(json.dumps(alive))
"""
    modules = sorted({".".join(n.split(".")[:2]) for n in old} - {"hybrimoe.policy", "hybrimoe.tiny"})
    r = subprocess.run([sys.executable, "-c", code, json.dumps(modules)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


#: a reference to a README section from another file: README, its title in quotes (a comma or 's between)
README_SECTION_REF = re.compile(r"""README(?:'s|\.md)?,?\s+["']([^"']{1,60})["']""")
#: README's references to its own sections: a title in quotes, then below or above; as in, then a title in quotes
README_SELF_REF = re.compile(r'''"([^"]{1,60})"\s(?:below|above)|as\sin\s"([^"]{1,60})"''')
#: the files that may point at README's sections (vendor/ and build outputs are not ours)
REFERRING = ("hybrimoe", "tests", "scripts", "docs", "bench", ".ci")


def readme_sections(text: str) -> set:
    """The titles of README's headings (``#`` lines outside fenced code)."""
    titles, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            titles.add(line.lstrip("#").strip())
    return titles


@pytest.mark.skipif(not (ROOT / "README.md").is_file(), reason="no checkout beside the package")
def test_every_reference_to_a_readme_section_names_one():
    readme = (ROOT / "README.md").read_text()
    sections = readme_sections(readme)
    assert {"Quick start", "GPU back ends"} <= sections, sections  # the scan sees the headings
    refs = [("README.md", " ".join((a or b).split())) for a, b in README_SELF_REF.findall(readme)]
    files = [ROOT / "CHANGELOG.md"] + [p for top in REFERRING for p in sorted((ROOT / top).rglob("*"))
                                       if p.is_file() and p.suffix in ("", ".py", ".md", ".sh", ".cmake")]
    for path in files:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        refs += [(str(path.relative_to(ROOT)), " ".join(title.split())) for title in README_SECTION_REF.findall(text)]
    assert len(refs) >= 3, refs  # the scan finds the references
    assert [f"{where}: {title!r}" for where, title in refs if title not in sections] == []


#: a claim about README's numbered commands (the sh blocks of its "Quick start", in order): README's command N, then
#: the code it is said to run in backticks, in parentheses or after 's
README_COMMAND_CLAIM = re.compile(r"README(?:'s|,)\s+command\s+(\d+)(?:'s\s+`([^`]+)`|\s*\(([^)]*)\))")
#: a line of code that says it is one of README's commands: CODE  # README's command N
README_COMMAND_LINE = re.compile(r"^[ \t]*([^\s#][^\n#]*?)[ \t]+#[ \t]*README(?:'s|,)\s+command\s+(\d+)\b", re.M)


def readme_commands(text: str) -> list[str]:
    """README's numbered commands: the sh blocks of its "Quick start" section, in order, one line each."""
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [" ".join(block.split()) for block in re.findall(r"```sh\n(.*?)```", section, re.S)]


@pytest.mark.skipif(not (ROOT / "README.md").is_file(), reason="no checkout beside the package")
def test_what_is_said_to_be_a_readme_command_is_in_it():
    """Where the docs or CI say what README's command N runs, the code they quote is part of that command."""
    commands = readme_commands((ROOT / "README.md").read_text())
    assert len(commands) == 2 and commands[0].startswith("pip install . &&"), commands
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted(p for p in (ROOT / ".ci").rglob("*") if p.is_file() and p.suffix in ("", ".sh", ".md"))]
    claims = []
    for path in files:
        text = path.read_text()
        for n, after, paren in README_COMMAND_CLAIM.findall(text):
            quoted = [after] if after else re.findall(r"`([^`]+)`", paren)
            claims += [(path.name, int(n), code) for code in quoted]
        claims += [(path.name, int(n), code) for code, n in README_COMMAND_LINE.findall(text)]
    assert len(claims) >= 3, claims  # the scan finds docs/testing.md's and .ci/run's
    bad = [f"{where}: {code!r} is not in README's command {n}" for where, n, code in claims
           if not 1 <= n <= len(commands) or " ".join(code.split()) not in commands[n - 1]]
    assert bad == []
