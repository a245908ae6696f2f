"""Several accelerators: which device serves each MoE layer, and each device's share of the ``moe_cache`` budget.

llama.cpp's layer split (``-ngl`` with ``-sm layer``, the default, and ``-ts``) puts each repeating layer, its router
included, on one device (``llama_model::dev_layer``; hybrimoe's patch 0010 exposes it as ``llama_model_dev_layer``).
The engine keeps one expert slot pool per device and runs layer l's GPU share on the device that holds layer l, from
that device's slots; a layer left on the host (``-ngl`` below the layer count) has its GPU share on the main device
(``-mg``). Budgets are per device: ``"25%"`` is 25% of the routed experts of the layers each device serves; a list
(``"10GiB,6GiB"``, in the order of the devices as ``-ts`` lists them) sets each; one size (``"4GiB"``, a slot count
in bytes) is each device's; ``"auto"`` sizes each device from its own free memory.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Sequence

from hybrimoe.policy.budget import parse_budget
from hybrimoe.runtime.engine_facts import EngineFacts

#: llama.cpp's split modes (include/llama.h ``llama_split_mode``), by the names ``-sm`` takes
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2, "tensor": 3}


def check_split_mode(split_mode) -> None:
    """The engine needs each layer on one device: ``-sm none`` and ``-sm layer`` only.

    Raises:
        ValueError: ``row`` or ``tensor`` (each matrix split over the GPUs), or a value that is not a split mode.
    """
    names = {v: k for k, v in SPLIT_MODES.items()}
    if isinstance(split_mode, bool) or not isinstance(split_mode, int) or split_mode not in names:
        raise ValueError(f"split_mode must be one of {sorted(SPLIT_MODES.values())} "
                         f"({', '.join(f'{v}={k}' for k, v in SPLIT_MODES.items())}), got {split_mode!r}")
    if split_mode in (SPLIT_MODES["row"], SPLIT_MODES["tensor"]):
        raise ValueError(f"split_mode {names[split_mode]} (-sm {names[split_mode]}) splits each weight matrix over "
                         "the GPUs; the MoE engine (moe_cache) runs each layer's GPU share on the one device that "
                         "holds that layer: use -sm layer (the default) or -sm none")


def check_main_gpu(main_gpu, devices: Sequence[int]) -> None:
    """``main_gpu`` (``-mg``) is an index into the devices llama.cpp splits over (0 is always accepted: no device at
    all means the CPU).

    Raises:
        ValueError: not an integer, negative, or past the last device (the message lists them).
    """
    from hybrimoe import _ggml

    if isinstance(main_gpu, bool) or not isinstance(main_gpu, int) or main_gpu < 0:
        raise ValueError(f"main_gpu (-mg) must be an integer >= 0, got {main_gpu!r}")
    if main_gpu and main_gpu >= len(devices):
        names = ", ".join(f"{i}: {_ggml.device_label(d)}" for i, d in enumerate(devices)) or "none"
        raise ValueError(f"main_gpu={main_gpu} (-mg): there are {len(devices)} devices ({names})")


def budget_list(spec) -> Optional[list]:
    """The entries of a per-device ``moe_cache`` list (``"10GiB,6GiB"`` or a list/tuple), else None (one budget)."""
    if isinstance(spec, (list, tuple)):
        return list(spec)
    if isinstance(spec, str) and "," in spec:
        return [s.strip() for s in spec.split(",")]
    return None


def _lib():
    from hybrimoe._lib import llama_cpp_module

    lib = llama_cpp_module().llama_cpp._lib
    fn = lib.llama_model_dev_layer
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    fn.restype = ctypes.c_void_p
    return lib


def model_layer_devices(model, layers: Sequence[int]) -> list[Optional[int]]:
    """Per model layer in ``layers``: the ggml device pointer llama.cpp put it on, or None for the host (the CPU).

    ``model``: the loaded ``llama_model *`` (``Llama.model``)."""
    from hybrimoe import _ggml

    fn = _lib().llama_model_dev_layer
    cpu = {d["ptr"] for d in _ggml.devices(memory=False) if d["type"] not in (_ggml.DEV_GPU, _ggml.DEV_IGPU)}
    out = []
    for il in layers:
        p = fn(model, int(il))
        out.append(None if not p or int(p) in cpu else int(p))
    return out


def engine_devices(layer_devs: Sequence[Optional[int]], order: Sequence[int],
                   main: Optional[int]) -> tuple[list[int], list[int]]:
    """The devices that get a slot pool and each MoE layer's device among them.

    ``layer_devs``: per MoE layer, its device pointer or None (host); ``order``: the Llama's devices in order (as
    ``-ts`` lists them); ``main``: the device for layers on the host (``-mg``), or None. Returns ``(devices,
    layer_device)``: the pointers in ``order`` (unknown ones after), and per MoE layer an index into them. No device
    at all (CPU only): ``([], [])``."""
    used = {d for d in layer_devs if d}
    if any(d is None for d in layer_devs) and main:
        used.add(main)
    if not used:
        return [], []
    pos = {p: i for i, p in enumerate(order)}
    devs = sorted(used, key=lambda p: (pos.get(p, len(pos)), p))
    index = {p: i for i, p in enumerate(devs)}
    fallback = index[main] if main in index else 0
    return devs, [index[d] if d else fallback for d in layer_devs]


def device_slots(spec, facts: EngineFacts, layer_device: Sequence[int], n_devices: int,
                 labels: Sequence[str] = ()) -> list[Optional[int]]:
    """Expert slots per device for a ``moe_cache`` budget: None for ``"auto"`` (sized from each device's free memory
    once the model is loaded). A share (``"25%"``) is of the routed experts of the layers each device serves; a list
    gives each device its own (in device order); one size is each device's; every count is capped at a slot per
    expert of the device's layers. ``labels`` name the devices in messages.

    Raises:
        ValueError: a list whose length is not the number of devices (the message names them), or an entry
            ``parse_budget`` refuses (named with its device).
    """
    names = list(labels) or [f"device {i}" for i in range(n_devices)]
    entries = budget_list(spec)
    if entries is not None and len(entries) != n_devices:
        raise ValueError(f"moe_cache lists {len(entries)} budget(s) for {n_devices} device(s) that hold MoE layers "
                         f"({', '.join(names)}): give one per device, in that order, or one for all")
    if entries is None:
        entries = [spec] * n_devices
    sb = facts.slot_bytes
    out: list[Optional[int]] = []
    for i, e in enumerate(entries):
        n_all = sum(1 for d in layer_device if d == i) * facts.n_expert
        if isinstance(e, str) and e.strip().lower() == "auto":
            out.append(None)
            continue
        try:
            b = parse_budget(e, float(n_all * sb), sb) if n_all else 0.0
        except ValueError as err:
            raise ValueError(f"moe_cache for {names[i]}: {err}") from None
        out.append(min(n_all, int(b // sb + 1e-9)))
    return out
