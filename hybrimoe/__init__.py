"""hybrimoe: HybriMoE (Zhong et al., arXiv:2504.05897) hybrid CPU-GPU MoE inference on a patched llama.cpp.

``from hybrimoe import Llama`` gives llama-cpp-python's ``Llama`` running on hybrimoe's patched libllama.
Import hybrimoe before ``llama_cpp``: a process can load only one libllama.
"""
from __future__ import annotations

import os
import sys

from ._lib import LIB_DIR, HybrimoeImportError

__version__ = "0.1.0"

# Point llama-cpp-python at our libllama now, so that a later plain `import llama_cpp` gets it too, and load ggml
# with hybrimoe's ggml-cpu (hybrimoe._lib.preload_ggml) before any module asks for it by soname.
if "llama_cpp" not in sys.modules and (LIB_DIR / "libllama.so").exists():
    os.environ["LLAMA_CPP_LIB_PATH"] = str(LIB_DIR)
    try:
        from ._lib import preload_ggml

        preload_ggml()
    except (HybrimoeImportError, OSError):
        pass  # reported when the Llama API is used (hybrimoe._lib.llama_cpp_module)

__all__ = ["Llama", "HybrimoeImportError", "make_tiny_model", "CachePolicy", "SchedulePolicy", "PrefetchPolicy",
           "__version__"]


def __getattr__(name: str):
    # load llama_cpp (and our libllama) only when the Llama API is used: the simulator needs neither
    if name == "Llama":
        from .llama import Llama

        return Llama
    if name in ("CachePolicy", "SchedulePolicy", "PrefetchPolicy"):
        from . import policy

        return getattr(policy, name)
    if name == "make_tiny_model":
        from .tiny import make_tiny_model

        return make_tiny_model
    raise AttributeError(f"module 'hybrimoe' has no attribute {name!r}")
