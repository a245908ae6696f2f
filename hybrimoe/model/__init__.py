"""What a GGUF MoE model is: the one GGUF reader and validator (:mod:`~hybrimoe.model.reader`), the facts the cost
model and the simulator need (:mod:`~hybrimoe.model.facts`: :class:`~hybrimoe.model.facts.ModelFacts`, the built-in
shapes) and upstream's per-architecture tables (:mod:`~hybrimoe.model.tables`). A leaf package: it imports no other
part of hybrimoe.
"""
from hybrimoe._lazy import lazy_submodules

__getattr__ = lazy_submodules(__name__, ("facts", "reader", "tables"))
