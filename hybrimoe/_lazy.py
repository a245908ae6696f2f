"""Lazy submodule access for the package's ``__init__`` modules (PEP 562): ``hybrimoe.model.reader`` works after a
plain ``import hybrimoe``, as the documentation writes such names, without importing every submodule up front."""
from __future__ import annotations

import importlib


def lazy_submodules(package: str, names):
    """A module ``__getattr__`` for ``package`` that imports the submodule ``package.<name>`` on first access, for
    each name in ``names``; any other name raises AttributeError as a module would."""
    known = frozenset(names)

    def __getattr__(name: str):
        if name in known:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
