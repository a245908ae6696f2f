"""Cache budgets: ``moe_cache`` / ``--moe-cache`` values as bytes (HybriMoE's "25% cache" is 25% of all routed-expert
bytes, §V)."""
from __future__ import annotations

import math
import re
from typing import Union

# SI (k, M, G, T: powers of 1000) and binary (KiB, MiB, GiB, TiB: powers of 1024) units: a model larger than RAM
# can need a TB-sized budget (Kimi-K2's routed experts are about 0.5 TB at 4 bits)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 1024.0, "mib": 1024.0 ** 2, "gib": 1024.0 ** 3, "tib": 1024.0 ** 4}


def parse_budget(spec: Union[str, float, int], total_expert_bytes: float, expert_bytes: float,
                 allow_zero: bool = True) -> float:
    """Budget in bytes from ``"25%"`` (of all routed-expert bytes), ``"3GiB"``, ``"512MB"`` or a number of bytes.

    0 is valid (nothing cached) unless ``allow_zero`` is False. Raises ValueError on an unparsable spec, a number
    between 0 and 1 (``0.5``: bytes, so a share written as a fraction; a share is ``"50%"``), a negative budget, a
    percentage above 100, a positive budget smaller than one expert (``expert_bytes``), or 0 where it is not
    allowed.
    """
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        b = float(spec)
        if 0 < b < 1:
            raise ValueError(f"cache budget {spec!r}: a number is bytes, and this is less than one byte; write a "
                             f"share as a percentage ('{100 * b:g}%')")
    else:
        s = str(spec).strip().lower()
        m = re.fullmatch(r"([-+]?[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(%|[a-z]*)", s)
        if not m or (m.group(2) not in _UNITS and m.group(2) != "%"):
            raise ValueError(f"cannot parse cache budget {spec!r}: use e.g. '25%', '3GiB', '512MB' or bytes")
        v = float(m.group(1))
        if m.group(2) == "%":
            if v < 0 or v > 100:
                raise ValueError(f"cache budget {spec!r}: a percentage must be within 0..100")
            b = v / 100.0 * total_expert_bytes
        else:
            b = v * _UNITS[m.group(2)]
            if m.group(2) == "" and 0 < b < 1:  # "0.5" on a command line: the same slip as the number 0.5
                raise ValueError(f"cache budget {spec!r}: a number is bytes, and this is less than one byte; write "
                                 f"a share as a percentage ('{100 * b:g}%')")
    if not math.isfinite(b) or b < 0:
        raise ValueError(f"cache budget {spec!r} is negative or not finite")
    if 0 < b < expert_bytes or (b == 0 and not allow_zero):
        raise ValueError(f"cache budget {spec!r} = {b:.0f} bytes is smaller than one expert ({expert_bytes:.0f} "
                         "bytes)" + ("; use 0 for no cache" if allow_zero else ""))
    return b
