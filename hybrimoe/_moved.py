"""Alias modules for names that moved in 0.2 (the package was split into layers: CHANGELOG.md lists every move).
Each old module (``hybrimoe.engine``, ``hybrimoe.simulate``, ...) is a few lines that call :func:`moved`; a name read
from it warns once (DeprecationWarning) where it lives now and returns it. The aliases go in 0.3."""
from __future__ import annotations

import importlib
import warnings


def moved(old: str, names: dict):
    """A module ``__getattr__`` for the alias module ``old``: ``names`` maps each old name to ``"new.module"`` (same
    name there) or ``"new.module:new_name"``. Unknown names raise AttributeError as a module would."""
    warned: set = set()

    def __getattr__(name: str):
        target = names.get(name)
        if target is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        module, _, new_name = target.partition(":")
        new_name = new_name or name
        if name not in warned:
            warned.add(name)
            warnings.warn(f"{old}.{name} moved to {module}.{new_name}; the alias {old} goes in hybrimoe 0.3",
                          DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), new_name)

    return __getattr__


def names_of(old: str, names: dict):
    """A module ``__dir__`` listing the alias module's names."""
    return lambda: sorted(names)
