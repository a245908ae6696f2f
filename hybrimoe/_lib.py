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


def llama_cpp_lib_dir() -> Path:
    """The folder of llama-cpp-python's native libraries (its ggml), wherever it is installed.

    Raises:
        HybrimoeImportError: llama-cpp-python is not installed.
    """
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise HybrimoeImportError("llama-cpp-python is not installed: pip install llama-cpp-python==0.3.36")
    return Path(spec.origin).resolve().parent / "lib"


def server_env(env: dict) -> dict:
    """``env`` for a child process running one of hybrimoe's native programs (``ggml-rpc-server``): its library
    search path starts with hybrimoe's lib folder (our ggml-cpu) and then llama-cpp-python's (the ggml it
    installed), wherever each is installed (the programs' RUNPATH finds llama-cpp-python only beside hybrimoe)."""
    out = dict(env)
    dirs = [str(LIB_DIR), str(llama_cpp_lib_dir())]
    if out.get("LD_LIBRARY_PATH"):
        dirs.append(out["LD_LIBRARY_PATH"])
    out["LD_LIBRARY_PATH"] = os.pathsep.join(dirs)
    return out


_loaded = None


def _first(folder: Path, name: str):
    """``folder/name`` or, failing that, the first ``name*`` file there (None if none)."""
    cands = sorted(folder.glob(name + "*"))
    return cands[0] if cands else None


_preloaded = False


def preload_ggml() -> None:
    """Loads ggml's shared libraries in the order hybrimoe needs, before anything (llama_cpp, our libllama,
    ``hybrimoe._engine``) asks for them by soname.

    libggml-base.so.0 and libggml.so.0 resolve to llama-cpp-python's copies (its RUNPATH covers the standard layout;
    this covers user-site / split installs) and libggml-cpu.so.0 to hybrimoe's: the dynamic loader satisfies a
    NEEDED entry from an object already loaded with that soname, so llama-cpp-python's libggml.so then runs on our
    ggml-cpu (patch 0005: it skips the expert pairs the GPU computes; the engine checks it,
    ``hybrimoe._engine.cpu_backend_skips_negative_ids``). ggml-base is loaded by the very file later dlopen calls
    name (libggml-base.so): dlopen dedupes by file, not by soname, and two ggml-base copies would mean two backend
    registries.

    Raises:
        HybrimoeImportError: llama-cpp-python is not installed, or hybrimoe's ggml-cpu is missing (not built).
    """
    global _preloaded
    if _preloaded:
        return
    ggml_dir = llama_cpp_lib_dir()
    ours_cpu = LIB_DIR / "libggml-cpu.so.0"
    if not ours_cpu.exists():
        raise HybrimoeImportError(f"{ours_cpu} is missing: hybrimoe's native part was not built (pip install .)")
    for path in (_first(ggml_dir, "libggml-base.so"), ours_cpu, _first(ggml_dir, "libggml.so")):
        if path is not None:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    _preloaded = True


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
    preload_ggml()
    os.environ["LLAMA_CPP_LIB_PATH"] = str(LIB_DIR)
    import llama_cpp  # (must come after LLAMA_CPP_LIB_PATH)

    _fix_log_levels()
    _loaded = llama_cpp
    return llama_cpp


def _fix_log_levels() -> None:
    """llama-cpp-python 0.3.36's log callback maps ggml's levels by an older enum (INFO 1, WARN 2, ERROR 3): with the
    pinned ggml's (ggml.h: DEBUG 1, INFO 2, WARN 3, ERROR 4) it printed llama.cpp's warnings with ``verbose=False``
    and hid its errors. The table it reads at every call is set to the pinned enum."""
    import logging

    from llama_cpp import _logger

    _logger.GGML_LOG_LEVEL_TO_LOGGING_LEVEL.update({0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO,
                                                   3: logging.WARNING, 4: logging.ERROR, 5: logging.DEBUG})
