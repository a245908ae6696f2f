"""Locate hybrimoe's native files and load llama-cpp-python on top of our patched libllama.

llama-cpp-python loads ``$LLAMA_CPP_LIB_PATH/libllama.so`` when that variable is set before ``import llama_cpp``
(llama_cpp/llama_cpp.py); we point it at ``hybrimoe/lib``, which holds our patched libllama. With no MoE hook
installed our libllama behaves exactly like upstream's, so the swap is harmless for any other user of
llama_cpp in the same process. ggml itself (``libggml*.so``) stays llama-cpp-python's.
"""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

PKG_DIR = Path(__file__).resolve().parent
LIB_DIR = PKG_DIR / "lib"


class HybrimoeImportError(ImportError):
    """Raised when llama_cpp was imported before hybrimoe, or our native files are missing."""


def _llama_cpp_lib_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise HybrimoeImportError("llama-cpp-python is not installed: pip install llama-cpp-python==0.3.36")
    return Path(spec.origin).resolve().parent / "lib"


_loaded = None


def llama_cpp_module():
    """Return the ``llama_cpp`` module, bound to hybrimoe's patched libllama.

    Raises:
        HybrimoeImportError: ``llama_cpp`` was imported before hybrimoe (it then holds upstream's libllama,
            and a process cannot swap it), or hybrimoe's libllama is missing (package not built).
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    ours = LIB_DIR / "libllama.so"
    if "llama_cpp" in sys.modules or "llama_cpp.llama_cpp" in sys.modules:
        mod = sys.modules.get("llama_cpp.llama_cpp")
        lib = getattr(mod, "_lib", None)
        if lib is None or Path(getattr(lib, "_name", "")).resolve() != ours.resolve():
            raise HybrimoeImportError(
                "llama_cpp was imported before hybrimoe, so it runs upstream's libllama. "
                "Import hybrimoe first (import hybrimoe; then llama_cpp), in a fresh process.")
    if not ours.exists():
        raise HybrimoeImportError(f"{ours} is missing: hybrimoe's native part was not built (pip install .)")
    # resolve libggml*.so.0 to llama-cpp-python's copies before libllama asks for them (RUNPATH covers the
    # standard layout; this covers user-site / split installs)
    ggml_dir = _llama_cpp_lib_dir()
    for name in ("libggml-base.so", "libggml.so"):
        for cand in sorted(ggml_dir.glob(name + "*")):
            ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
            break
    os.environ["LLAMA_CPP_LIB_PATH"] = str(LIB_DIR)
    import llama_cpp  # noqa: E402  (must come after LLAMA_CPP_LIB_PATH)

    _loaded = llama_cpp
    return llama_cpp
