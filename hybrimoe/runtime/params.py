"""llama.cpp parameter handling for :class:`hybrimoe.Llama`: upstream's offload options that llama-cpp-python lacks
(``-ot``, ``--cpu-moe``, ``--n-cpu-moe``, ``--rpc``), the keyword check, and the one patch of llama-cpp-python's
default-parameter functions (:class:`NativeParams`), a context manager.

Why a patch: llama-cpp-python's ``Llama.__init__`` builds its ``llama_model_params`` and ``llama_context_params``
from ``llama_model_default_params()`` and ``llama_context_default_params()`` and has no argument for tensor
overrides, devices, a load-progress callback, ``use_extra_bufts``, ``n_seq_max`` or an eval callback. While its
constructor runs, :meth:`NativeParams.patched` makes those two functions return upstream's defaults with these
fields set, and restores them after (one constructor at a time: a lock).
"""
from __future__ import annotations

import ctypes
import difflib
import inspect
import re
import threading
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from hybrimoe import _ggml
from hybrimoe._lib import llama_cpp_module
from hybrimoe.model.tables import EXPS_REGEX

_lc = llama_cpp_module().llama_cpp  # the ctypes layer, where Llama looks up the default-parameter functions
_params_lock = threading.Lock()


class _BuftOverride(ctypes.Structure):
    # struct llama_model_tensor_buft_override (include/llama.h)
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def parse_tensor_overrides(spec: str | Sequence[str] | None) -> list[tuple[str, str]]:
    """Parse upstream's ``-ot`` syntax: ``"<regex>=<buffer type>,..."`` or a list of such items.

    Returns:
        ``[(pattern, buffer_type_name), ...]`` in order (the first matching pattern wins in llama.cpp).
    Raises:
        ValueError: not a string or a list of strings; an item lacks ``=``, or its pattern is empty or not a valid
            regular expression.
    """
    if spec is None:
        return []
    if not isinstance(spec, str) and not (isinstance(spec, (list, tuple))
                                          and all(isinstance(p, str) for p in spec)):
        raise ValueError(f"tensor_buft_overrides must be a string \"<regex>=<buffer type>,...\" or a list of such "
                         f"strings, got {spec!r}")
    items: list[str] = []
    for part in ([spec] if isinstance(spec, str) else list(spec)):
        items.extend(p for p in part.split(",") if p.strip())
    out = []
    for item in items:
        pattern, sep, buft = item.strip().partition("=")  # upstream splits at the first '='
        if not sep or not pattern or not buft:
            raise ValueError(f"tensor override {item!r} must be <tensor regex>=<buffer type>, e.g. exps=CPU")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"tensor override {item!r}: bad regular expression: {e}") from None
        out.append((pattern, buft))
    return out


def moe_overrides(cpu_moe: bool = False, n_cpu_moe: int | None = None) -> list[tuple[str, str]]:
    """Upstream's ``--cpu-moe`` / ``--n-cpu-moe N`` as tensor overrides (common ``llm_ffn_exps_cpu_override``).

    Both given: ``cpu_moe`` already covers every layer, so ``n_cpu_moe`` adds nothing (as upstream, where both
    overrides apply); a UserWarning says so.

    Raises:
        ValueError: ``n_cpu_moe`` is not an integer or is negative.
    """
    if n_cpu_moe is not None and (isinstance(n_cpu_moe, bool) or not isinstance(n_cpu_moe, (int, np.integer))):
        raise ValueError(f"n_cpu_moe must be an integer number of layers, got {n_cpu_moe!r}")
    if n_cpu_moe is not None and n_cpu_moe < 0:
        raise ValueError(f"n_cpu_moe must be >= 0, got {n_cpu_moe}")
    if cpu_moe:
        if n_cpu_moe:
            warnings.warn(f"cpu_moe (--cpu-moe) keeps the routed experts of every layer in host memory; "
                          f"n_cpu_moe={n_cpu_moe} (--n-cpu-moe) adds nothing", UserWarning, stacklevel=3)
        return [(EXPS_REGEX, "CPU")]
    if n_cpu_moe is None or n_cpu_moe == 0:
        return []
    return [(rf"blk\.{i}{EXPS_REGEX}", "CPU") for i in range(n_cpu_moe)]


def rpc_endpoints(rpc_servers: str | Sequence[str] | None) -> list[str]:
    """``rpc_servers`` (upstream ``--rpc``: ``"HOST:PORT[,HOST:PORT...]"`` or a list of such strings) as a list of
    endpoints, in order."""
    if not rpc_servers:
        return []
    parts = [rpc_servers] if isinstance(rpc_servers, str) else list(rpc_servers)
    return [e.strip() for p in parts for e in p.split(",") if e.strip()]


def register_rpc_servers(endpoints: Sequence[str], verbose: bool) -> list[int]:
    """Registers the RPC servers (:func:`hybrimoe._ggml.add_rpc_server`) and returns their device pointers, in
    order. ggml logs the RPC module's load and device registration through llama-cpp-python's log callback, which
    shows them unless told the caller's verbosity first (its Llama.__init__ does so only later).

    Raises:
        ValueError, RuntimeError: as :func:`hybrimoe._ggml.add_rpc_server`.
    """
    if not endpoints:
        return []
    from llama_cpp._logger import set_verbose

    set_verbose(bool(verbose))
    return [ptr for ep in endpoints for ptr in _ggml.add_rpc_server(ep)]


#: llama_lazy_mode value of patch 0007: as LLAMA_LAZY_MODE_ON, plus every routed-expert weight (``ffn_*_exps``)
LAZY_MODE_EXPERTS = 3

#: hybrimoe.Llama's own keywords (besides llama-cpp-python's)
OWN_KEYWORDS = ("rpc_servers", "tensor_buft_overrides", "cpu_moe", "n_cpu_moe", "no_repack", "no_host",
                "lazy_experts", "n_seq_max", "kv_unified", "moe_hook", "moe_replay", "moe_cache", "moe_policy",
                "moe_prefetch_layers", "moe_cost_model", "moe_profile", "moe_ram_cache", "moe_ram_policy",
                "moe_cpu_fused", "moe_ram_exclusive", "moe_replay_scores", "load_progress", "record_routing")


def upstream_keywords() -> tuple[str, ...]:
    """The keyword arguments of llama-cpp-python's ``Llama.__init__`` (its ``**kwargs`` left out)."""
    sig = inspect.signature(llama_cpp_module().Llama.__init__)
    return tuple(n for n, p in sig.parameters.items()
                 if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def check_keywords(kwargs: dict) -> None:
    """Refuses keywords that neither llama-cpp-python's ``Llama`` nor hybrimoe's know (llama-cpp-python's own
    ``**kwargs`` swallows them: a misspelt ``moe_cahce`` would run upstream's path without a word), as Python's own
    functions do.

    Raises:
        TypeError: naming the first unknown keyword and the closest known one.
    """
    known = upstream_keywords()
    for name in kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, known + OWN_KEYWORDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"Llama() got an unexpected keyword argument {name!r}{hint}")


#: llama.cpp's words for -fa (common/arg.cpp, is_truthy / is_falsey / is_autoy) and their llama_flash_attn_type
FLASH_ATTN_NAMES = {"on": 1, "enabled": 1, "true": 1, "1": 1, "off": 0, "disabled": 0, "false": 0, "0": 0,
                    "auto": -1, "-1": -1}


def flash_attn_type(value) -> int:
    """llama.cpp's ``llama_flash_attn_type`` for a ``flash_attn`` keyword: llama-cpp-python's ``True``/``False``
    (None and the integers 0 and 1 as it reads them), or llama.cpp's words for ``-fa``: ``"on"``, ``"off"``,
    ``"auto"`` (and ``enabled``/``true``/``1``, ``disabled``/``false``/``0``, ``-1``). ``"auto"``, llama.cpp's
    default, turns flash attention on where every layer's device supports it (``llama_context``'s fused-op probe).

    Returns:
        1 (enabled), 0 (disabled) or -1 (auto).
    Raises:
        ValueError: anything else.
    """
    if value is None or isinstance(value, (bool, np.bool_)):
        return int(bool(value))
    if isinstance(value, (int, np.integer)) and int(value) in (0, 1, -1):
        return int(value)
    if isinstance(value, str) and value.strip().lower() in FLASH_ATTN_NAMES:
        return FLASH_ATTN_NAMES[value.strip().lower()]
    raise ValueError(f"flash_attn must be True, False, 'on', 'off' or 'auto', got {value!r}")


def speculative_keywords(kwargs: dict) -> dict:
    """``kwargs`` with what llama-cpp-python's speculative decoding needs: with ``draft_model``, every token's logits
    (``logits_all=True``). llama-cpp-python turns ``logits_all`` on by itself for a draft model, but sizes its score
    array by the keyword as given (its ``Llama.__init__``), so without it the first verification batch fails with a
    numpy broadcast error."""
    if kwargs.get("draft_model") is not None and not kwargs.get("logits_all"):
        return dict(kwargs, logits_all=True)
    return kwargs


class NativeParams:
    """The model and context parameters llama-cpp-python's constructor has no argument for, and the native objects
    they point to (kept alive here, as long as the Llama that holds this object).

    Args:
        overrides: ``(pattern, buffer type name)`` tensor overrides (upstream ``-ot``), in order.
        devices: device pointers the model may use (None: llama.cpp's default, every device).
        load_progress: called with the load's fraction done (0..1), or None.
        no_repack: no repacked CPU weight layouts (``use_extra_bufts = False``, upstream ``--no-repack``).
        no_host: CPU weights skip the device's host (pinned) buffer type, so that they may be repacked
            (``no_host = True``, upstream ``--no-host``).
        lazy_experts: the routed experts' weights stay unread at load (``lazy_mode = LLAMA_LAZY_MODE_EXPERTS``,
            patch 0007).
        n_seq_max: sequences the context holds (None: llama-cpp-python's default).
        kv_unified: one KV buffer for all the sequences (upstream ``-kvu``) instead of one stream of
            ``n_ctx / n_seq_max`` cells each.
        eval_callback: ``(function address, user data address)`` of llama.cpp's eval callback, or None.
        flash_attn: :func:`flash_attn_type`'s value, or None to leave llama-cpp-python's (which knows on and off
            only: ``auto`` is set on the parameters the context is created from, ``llama_init_from_model``).

    Raises:
        ValueError: an override names an unknown buffer type (:func:`hybrimoe._ggml.buffer_type`).
    """

    def __init__(self, overrides: Sequence[tuple[str, str]] = (), devices: Optional[Sequence[int]] = None,
                 load_progress: Optional[Callable[[float], None]] = None, no_repack: bool = False,
                 no_host: bool = False, lazy_experts: bool = False,
                 n_seq_max: Optional[int] = None, kv_unified: bool = False,
                 eval_callback: Optional[tuple[int, int]] = None,
                 flash_attn: Optional[int] = None):
        self.model: dict = {}
        self.context: dict = {}
        self.flash_attn = flash_attn
        self._keep: list = []
        if overrides:
            arr = (_BuftOverride * (len(overrides) + 1))()
            for i, (pattern, buft_name) in enumerate(overrides):
                pat = pattern.encode()
                self._keep.append(pat)
                arr[i].pattern = pat
                arr[i].buft = _ggml.buffer_type(buft_name)
            arr[len(overrides)].pattern = None
            arr[len(overrides)].buft = None
            self._keep.append(arr)
            self.model["tensor_buft_overrides"] = ctypes.cast(arr, ctypes.c_void_p)
        if devices is not None:
            dev_array = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            self._keep.append(dev_array)
            self.model["devices"] = ctypes.cast(dev_array, ctypes.c_void_p)
        if load_progress is not None:
            def _progress(fraction, _ud):
                load_progress(float(fraction))
                return True
            cb = _lc.llama_progress_callback(_progress)
            self._keep.append(cb)
            self.model["progress_callback"] = cb
        if no_repack:
            self.model["use_extra_bufts"] = False  # no repacked CPU layouts
        if no_host:
            self.model["no_host"] = True  # llama.cpp's make_cpu_buft_list then offers the repacked layouts first
        if lazy_experts:
            self.model["lazy_mode"] = LAZY_MODE_EXPERTS
        if n_seq_max is not None:
            self.context["n_seq_max"] = int(n_seq_max)
        if kv_unified:
            self.context["kv_unified"] = True
        if eval_callback is not None:
            fn, user_data = eval_callback
            cb = _lc.ggml_backend_sched_eval_callback(fn)
            self._keep.append(cb)
            self.context["cb_eval"] = cb
            self.context["cb_eval_user_data"] = ctypes.c_void_p(user_data)

    @contextmanager
    def patched(self) -> Iterator[None]:
        """Within the block, ``llama_model_default_params()`` and ``llama_context_default_params()`` (as
        llama-cpp-python's ctypes layer exposes them) return upstream's defaults with :attr:`model` and
        :attr:`context` set, and ``llama_init_from_model`` creates contexts with :attr:`flash_attn` (llama-cpp-python
        overwrites that field from its boolean after taking the defaults); one block at a time in the process."""
        with _params_lock:
            original_model, original_ctx = _lc.llama_model_default_params, _lc.llama_context_default_params
            original_init = _lc.llama_init_from_model

            def model_params():
                p = original_model()
                for k, v in self.model.items():
                    setattr(p, k, v)
                return p

            def context_params():
                c = original_ctx()
                for k, v in self.context.items():
                    setattr(c, k, v)
                return c

            def init_from_model(model, params):
                if self.flash_attn is not None:
                    params.flash_attn_type = self.flash_attn
                return original_init(model, params)

            _lc.llama_model_default_params = model_params
            _lc.llama_context_default_params = context_params
            _lc.llama_init_from_model = init_from_model
            try:
                yield
            finally:
                _lc.llama_model_default_params = original_model
                _lc.llama_context_default_params = original_ctx
                _lc.llama_init_from_model = original_init
