"""Yardsticks for tests and scripts: the comparison with upstream llama.cpp at the same placement
(:mod:`~hybrimoe.testing.upstream`), the test suite's pytest fixtures (:mod:`~hybrimoe.testing.fixtures`, needs
pytest), its subprocess helpers (:mod:`~hybrimoe.testing.processes`), the never-worse tables' process pool
(:mod:`~hybrimoe.testing.tables`) and the page-residency oracle (:mod:`~hybrimoe.testing.residency`)."""
from hybrimoe._lazy import lazy_submodules

__getattr__ = lazy_submodules(__name__, ("upstream", "fixtures", "processes", "tables", "residency"))
