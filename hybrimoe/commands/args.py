"""Checked argument types for every command's flags, so that a flag shared by several commands validates the same way
in each, and the help formatter that shows the defaults.

Every numeric flag of every command takes one of these types (a test walks the parsers): argparse then refuses a
value out of range, NaN or infinity with one line naming the flag (``hybrimoe run: error: argument -t/--threads: must
be >= 1, got 0``) and exit status 2, before anything is loaded.
"""
from __future__ import annotations

import argparse
import difflib
import math
import os
from typing import Callable, Optional

#: the largest seed llama.cpp's samplers take (uint32_t)
SEED_MAX = 2 ** 32 - 1


def int_in(lo: Optional[int] = None, hi: Optional[int] = None, *, also: tuple = ()) -> Callable[[str], int]:
    """An argparse type: an integer within ``lo..hi`` (either end None: open), or one of ``also`` (e.g. -1 meaning
    "random" or "all")."""

    def parse(text: str) -> int:
        try:
            v = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if v in also:
            return v
        if lo is not None and v < lo or hi is not None and v > hi:
            rng = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in {lo}..{hi}"
            extra = f" (or {', '.join(map(str, also))})" if also else ""
            raise argparse.ArgumentTypeError(f"must be {rng}{extra}, got {v}")
        return v

    parse.__name__ = "integer"  # argparse names the type in its own messages
    parse.checked_range = (lo, hi, also)
    return parse


def float_in(lo: Optional[float] = None, hi: Optional[float] = None, *, lo_open: bool = False,
             hi_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number within ``lo..hi`` (``lo_open`` / ``hi_open``: that end excluded; None: no
    bound). NaN and infinity are refused."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        low_bad = lo is not None and (v <= lo if lo_open else v < lo)
        high_bad = hi is not None and (v >= hi if hi_open else v > hi)
        if low_bad or high_bad:
            left = "" if lo is None else ("(" if lo_open else "[") + f"{lo:g}"
            right = "" if hi is None else f"{hi:g}" + (")" if hi_open else "]")
            rng = (f"in {left}, {right}" if lo is not None and hi is not None else
                   f"{'>' if lo_open else '>='} {lo:g}" if lo is not None else f"{'<' if hi_open else '<='} {hi:g}")
            raise argparse.ArgumentTypeError(f"must be {rng}, got {text}")
        return v

    parse.__name__ = "number"
    parse.checked_range = (lo, hi, ())
    return parse


#: the types of the flags several commands share
POSITIVE = int_in(1)
COUNT = int_in(0)
THREADS = int_in(1)
SEED = int_in(0, SEED_MAX)
SAMPLING_SEED = int_in(0, SEED_MAX, also=(-1,))
PORT = int_in(0, 65535)
TEMPERATURE = float_in(0.0)
TOP_P = float_in(0.0, 1.0, lo_open=True)
FRACTION = float_in(0.0, 1.0, hi_open=True)
#: ``--moe-cpu-fused``'s values as ``hybrimoe.Llama``'s ``moe_cpu_fused``
FUSED_FLAG = {"off": False, "on": True, "fast": "fast"}


def llama_threads_default() -> str:
    """What ``-t`` left out means, in words: llama-cpp-python's thread counts (half the cores for generation, all of
    them for prompt processing), with this machine's numbers."""
    n = os.cpu_count() or 1
    return f"llama-cpp-python's: {max(n // 2, 1)} for generation, {n} for prompt processing, of {n} cores here"


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter that appends ``(default: X)`` to the help of every flag that takes a value, unless the
    help already says its default (in any case: "Default: ..." counts): ``(default: none)`` for a flag whose
    absence adds nothing (no value, an empty list). A switch (no value) and a required flag show none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text.lower() or not action.option_strings or action.nargs == 0 or action.required
                or action.default is argparse.SUPPRESS):
            return text
        if action.default is None or action.default == []:
            return f"{text} (default: none)".lstrip()
        return f"{text} (default: %(default)s)".lstrip()


def closest(word: str, known) -> Optional[str]:
    """The entry of ``known`` closest to ``word`` (difflib's ratio, at least 0.6: the rule ``hybrimoe.Llama`` uses for
    an unknown keyword), or None when none is close."""
    close = difflib.get_close_matches(word, list(known), n=1)
    return close[0] if close else None


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's "unrecognized arguments" message for ``extras`` (what ``parser`` did not take), with the closest
    flag of ``parser`` for each one that looks like a mistyped flag: ``unrecognized arguments: --moe-cahce 25% (did
    you mean --moe-cache?)``."""
    flags = [s for a in parser._actions for s in a.option_strings]
    hints = []
    for token in extras:
        if not token.startswith("-") or token == "-" or _is_number(token):
            continue
        name = token.split("=", 1)[0]
        match = closest(name, [f for f in flags if f.startswith("--") == name.startswith("--")])
        if match and (match, name) not in hints:
            hints.append((match, name))
    text = f"unrecognized arguments: {' '.join(extras)}"
    if len(hints) == 1:
        text += f" (did you mean {hints[0][0]}?)"
    elif hints:
        text += f" (did you mean {', '.join(f'{m} for {n}' for m, n in hints)}?)"
    return text


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def tensor_split(text: str) -> list[float]:
    """``-ts 3,1``: one non-negative proportion per device, as llama.cpp's ``--tensor-split`` (common/arg.cpp) reads
    it, also with ``/`` between them. Raises argparse.ArgumentTypeError on anything else."""
    parts = [x for x in text.replace("/", ",").split(",")]
    try:
        vals = [float(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give one number per device, e.g. 3,1") from None
    if not vals or any(v < 0 or v != v for v in vals) or sum(vals) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: proportions must be >= 0 and not all 0")
    return vals


def id_ranges(ids) -> str:
    """Sorted ids as ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``0-2, 5, 7-8``; "none" for none."""
    ids = sorted(ids)
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(out) if out else "none"
