"""``hybrimoe.Llama``: llama-cpp-python's ``Llama`` running on hybrimoe's patched libllama.

Same constructor and methods as ``llama_cpp.Llama`` (llama-cpp-python 0.3.36), plus upstream llama.cpp options
that llama-cpp-python lacks, under upstream's names (common/arg.cpp): ``rpc_servers`` (``--rpc``),
``tensor_buft_overrides`` (``-ot/--override-tensor``), ``cpu_moe`` (``--cpu-moe``) and ``n_cpu_moe``
(``--n-cpu-moe``), and hybrimoe's own ``moe_*`` options. The class only constructs and exposes: the parameters are
:mod:`hybrimoe.runtime.params`'s, the engine's set-up :mod:`hybrimoe.runtime.setup`'s, its statistics
:mod:`hybrimoe.runtime.stats`'.
"""
from __future__ import annotations

import functools
import inspect
import operator
import warnings
from typing import Sequence

import numpy as np

from hybrimoe import _ggml
from hybrimoe._lib import llama_cpp_module
from hybrimoe.envs import AUTO_CALIBRATE_ENV, DEFAULT_COST_HARDWARE, PREFETCH_LAYERS
from hybrimoe.model.reader import check_gguf
from hybrimoe.policy.presets import DEFAULT_PRESET, ENGINE_PRESETS
from hybrimoe.runtime import calibration
from hybrimoe.runtime.devices import check_main_gpu, check_split_mode, model_layer_devices
from hybrimoe.runtime.engine_facts import engine_module
from hybrimoe.runtime.errors import DeviceLostError
from hybrimoe.runtime.params import (
    NativeParams,
    check_keywords,
    flash_attn_type,
    moe_overrides,
    parse_tensor_overrides,
    register_rpc_servers,
    rpc_endpoints,
    speculative_keywords,
)
from hybrimoe.runtime.setup import EngineSetup
from hybrimoe.runtime.stats import engine_stats, hook_stats
from hybrimoe.traces.routing_replay import check_routing_replay_table, model_routing_shape

llama_cpp = llama_cpp_module()
_lc = llama_cpp.llama_cpp  # the ctypes layer
#: llama-cpp-python's create_completion parameters (their defaults: max_tokens 16, stream False)
_COMPLETION_SIGNATURE = inspect.signature(llama_cpp.Llama.create_completion)


class _Cut:
    """One completion's token limit (None: none) and whether :meth:`Llama.generate` ended it there."""

    def __init__(self, limit):
        self.limit, self.cut = limit, False


class _MoeParts:
    """hybrimoe's objects on one llama context: the MoE hook, the routing replay and the engine. Llama puts its
    ``close`` on llama-cpp-python's exit stack after the context, so they go first; it holds the context's wrapper,
    not the Llama (no reference cycle: a dropped Llama frees its model at once)."""

    def __init__(self):
        self.ctx = None  # llama-cpp-python's LlamaContext, once created
        self.hook = None
        self.routing_replay = None
        self.engine = None

    def close(self) -> None:
        """Releases the engine (device memory and backends go now, while the device is surely there), then detaches
        the hook (which holds the engine: dropping it frees the slot pool) and the replay from the context."""
        engine, self.engine = self.engine, None
        try:
            if engine is not None:
                engine.release()
        finally:
            for attr in ("hook", "routing_replay"):
                obj = getattr(self, attr)
                setattr(self, attr, None)
                if obj is not None and self.ctx is not None and self.ctx.ctx is not None:
                    obj.detach()


class Llama(llama_cpp.Llama):
    __doc__ = """llama-cpp-python's ``Llama`` on hybrimoe's patched libllama, with upstream's offload options.

    Args (besides llama-cpp-python's, which keep their meaning):
        flash_attn: llama-cpp-python's ``True``/``False`` (default ``False``, as llama-cpp-python), or llama.cpp's
            ``"on"``, ``"off"``, ``"auto"``: ``"auto"``, the default of upstream's ``llama-cli``, ``llama-server``
            and ``llama-bench`` and of hybrimoe's commands, turns flash attention on where every layer's device
            supports it (the CPU does: decode about 25% faster on a 12-layer DeepSeek-V2-Lite-shaped model here,
            docs/benchmarks.md).
        rpc_servers: ``"HOST:PORT[,HOST:PORT...]"`` or a list: ggml RPC servers whose devices join the
            model's devices (upstream ``--rpc``). Their memory is separate, like a GPU's.
        tensor_buft_overrides: upstream ``-ot`` syntax, ``"<regex>=<buffer type>,..."`` or a list; buffer types
            by device name (``CPU``, ``CUDA0``, ``RPC0[127.0.0.1:50052]``, as ``llama_cpp`` logs them).
        cpu_moe: keep every routed-expert tensor in host memory (upstream ``--cpu-moe``).
        n_cpu_moe: keep the routed experts of the first N layers in host memory (upstream ``--n-cpu-moe``).
        n_seq_max: sequences the context can hold at once (upstream ``-np/--parallel``; llama-cpp-python: 1).
        kv_unified: one KV cache shared by all ``n_seq_max`` sequences (upstream ``-kvu/--kv-unified``, which
            llama-server turns on for its automatic slot count). Default off, llama.cpp's default: each sequence its
            own stream of ``n_ctx / n_seq_max`` cells, and llama.cpp then splits a batch that mixes sequences into
            ubatches of equal tokens per sequence (``llama_batch_allocr::split_equal``): a prompt chunk beside other
            sequences' tokens costs extra passes over the weights, which :meth:`create_completions` avoids with it on
            (not for hybrid or recurrent models, whose memory splits per sequence either way). Unified, a sequence's
            context as llama.cpp sees it is the whole ``n_ctx``, which chooses a model's long RoPE factors
            (Phi-3.5-MoE) once ``n_ctx`` exceeds its training context.
        no_repack: do not put CPU weights into repacked (interleaved) buffers (upstream ``--no-repack``). The RAM
            tier's slots keep the file's layout either way (``HYBRIMOE_RAM_REPACK=1`` repacks them after each read).
        no_host: keep CPU weights out of the GPU's host (pinned) buffer type (upstream ``--no-host``): with a GPU
            that has one (CUDA, Vulkan), llama.cpp puts CPU weights there and never repacks them; with ``no_host``
            they may be repacked as on a machine without a GPU.
        lazy_experts: leave the routed experts' weights (``ffn_*_exps``) unread at load time: they stay mapped
            from the file (advised random access, never pre-read nor mlocked, on the CPU whatever the offload
            options) and their pages are read when first used, as upstream's mmap reads a page it has not
            pre-read; every other tensor loads as usual (patch 0007, ``LLAMA_LAZY_MODE_EXPERTS``). For a model
            larger than RAM: the load reads only the weights outside the experts. Needs mmap (the default
            ``use_mmap=True``; with ``use_mmap=False`` the experts are still mapped, the rest read into RAM);
            refused with ``use_mlock`` (llama.cpp locks the mapping from its start, expert pages included).
        moe_hook: install hybrimoe's MoE hook (``hybrimoe._engine.MoeHook``); its statistics are in
            ``moe_stats()``.
        moe_replay_scores: float array ``[n_rows, n_layer, n_expert]``, with ``moe_replay``: the replayed rows'
            router scores (a trace's, ``hybrimoe.traces.routing_replay.routing_replay_table(..., scores=True)``): the
            engine's cache policies rank by them instead of the model's own router's (MRS then sees what it would
            on the model's own routing); the routing weights stay the model's.
        moe_replay: int array ``[n_rows, n_layer, k]``: force every MoE layer's routed expert ids; the token at
            position p gets row ``p % n_rows`` (benchmarks replay real routing; outputs become meaningless); in
            sequence s, row ``(offsets[s] + p) % n_rows`` where ``moe_replay.sequence_offsets = offsets`` is set
            (each sequence of a batch its own routing, e.g. its own prompt of a trace).
        record_routing: record every MoE layer's routed ids and router scores as llama.cpp computes them, with
            any placement (llama.cpp's eval callback, ``hybrimoe._engine.RoutingRecorder``; ``moe_recorder``;
            ``hybrimoe trace`` writes traces with it). Off by default; costs a little per graph when on.
        moe_cache: turns on the hybrid CPU+GPU engine (HybriMoE) with a GPU expert cache of this size: ``"25%"``
            (of all routed-expert bytes), ``"3GiB"``, ``"512MB"`` or bytes; rounded down to whole expert slots
            (``hybrimoe.runtime.engine_facts.slot_bytes(model_path)``); 0 runs every expert on the CPU through the
            engine; ``"auto"``: as many slots as fit the device's memory left once the model is loaded
            (``hybrimoe.runtime.setup.auto_slots``; ``moe_stats()["engine"]["moe_cache"]`` says what it chose and why).
            Routed experts then stay in host memory where llama.cpp puts CPU weights: the device's pinned host
            buffer when it has one, else upstream's repacked layout where ggml-cpu has kernels for it (the CPU share
            runs upstream's repacked kernels; GPU copies read the file's bytes through a mapping). The GPU is the first
            RPC server of ``rpc_servers``, else the first GPU device. The set-up is ``moe_setup``.
        moe_policy: {presets} (default ``"{default_preset}"``), a ``hybrimoe.SchedulePolicy`` / ``CachePolicy`` /
            ``PrefetchPolicy`` object (replaces that part of ``"{default_preset}"``), or a dict (see
            ``hybrimoe.policy.presets.build_preset``). Presets: ``hybrimoe.policy.presets.SYSTEM_PRESETS`` (what each
            does and its source); ``"hot-set"`` needs ``moe_profile``.
        moe_profile: a profile of expert frequencies: a routing trace file (``.npz``, as ``hybrimoe trace``
            writes; its activation counts per (MoE layer, expert)) or an array of counts ``[MoE layers,
            experts]`` (``hybrimoe.runtime.setup.load_profile``). ``"hot-set"`` keeps the hottest experts that fit
            resident; the adaptive caches start filled with them (as the simulator's profile fills them). The
            trace's MoE layers and experts must be the model's.
        moe_prefetch_layers: MoE layers whose experts are predicted and prefetched ahead (0: none). Default
            {prefetch}.
        moe_cost_model: the planner's cost model: a hardware name (``hybrimoe/policy/hardware_files``), a
            hardware or cost-model JSON file, or a ``CostModel``. Default: this model's stored calibration on this
            device (``hybrimoe calibrate``); without one, a short calibration runs on the loaded model (seconds to a
            minute; a progress bar on a terminal) and is stored (``hybrimoe.runtime.calibration.on_first_use``); with
            ``{auto_env}=0`` the ``{cost_preset}`` hardware's instead. ``moe_stats()["engine"]["cost_model"]`` says
            which.
        moe_cpu_fused: compute each MoE layer's CPU share as one fused op (gate and up in one pass over activations
            quantized once, the SwiGLU and down; its threads synchronised between phases only) with upstream's own
            kernels, so with upstream's numbers; where it cannot (other activations, expert biases or scales, plain
            K-quant experts in ubatches of 8 tokens or more), upstream's ops. ``moe_stats()["engine"]["fused"]``
            gives per MoE layer the largest ubatch that runs fused (``"any"``: every size; None: none), and
            ``["fused_mode"]`` the mode ("off", "exact", "fast"). Off by default. ``"fast"``: also the
            repacked layouts' gemm kernels where they round differently from the gemv kernel upstream's mul_mat_id
            runs (Q4_K on x86 AVX2): faster prefill, logits no longer upstream's bit for bit.

        moe_ram_cache: the RAM expert tier, for a model larger than RAM: the routed experts stay unread at load
            (as ``lazy_experts``), the engine keeps this many of them in RAM (``"40%"`` of their bytes, ``"12GiB"``,
            bytes, or ``"auto"``: what the memory available after the load holds, less the other weights and a
            margin) and reads the others from the GGUF file (every shard of a split model) when their layer needs
            them or ahead of it by the router look-ahead (``moe_prefetch_layers``), dropping them from the page
            cache once read, so the process uses about the budget (``hybrimoe.runtime.ram_tier``); the weights outside
            the experts are read into RAM at load (``use_mmap`` defaults to False with it). The slots keep the
            file's layout (the CPU share's kernels for it: upstream's numbers with ``lazy_experts``, whose experts
            stay in the mapping unrepacked); ``HYBRIMOE_RAM_REPACK=1`` repacks each expert after its read (upstream's
            default layout and numbers; slower here: docs/benchmarks.md). Turns the engine
            on with ``moe_cache=0`` (a GPU cache above it: ``moe_cache`` too). The smallest budget holds every
            expert one ubatch can route to in a layer (``min(n_expert, n_ubatch * top_k)`` experts); a budget above
            the machine's memory is refused; ``use_mlock`` is refused with it. ``moe_stats()["engine"]["ram"]``
            reports the tier.
        moe_ram_policy: the RAM tier's cache policy: ``"mrs"`` (default; alpha 0.1,
            ``hybrimoe.policy.RAM_MRS_ALPHA``), ``"lru"``, ``"lfu"``, ``"reuse"`` (``hybrimoe.policy.ReusePolicy``:
            predicted reuse) or a ``hybrimoe.CachePolicy`` object
            (``hybrimoe.runtime.setup.ram_cache_policy``); with any of them reads ahead and demotions pass TinyLFU
            admission and a prefill's demand reads enter at the lowest rank (``hybrimoe.policy.build_ram_tier``).
        moe_ram_exclusive: with a GPU cache above the RAM tier, exclusive tiers: an expert on the GPU gives up its
            RAM slot, and one the GPU cache evicts is copied back into RAM (device to host) when it ranks at least
            as high as the RAM tier's victim, so that the two budgets hold different experts (docs/design.md §17).
            Off by default (inclusive tiers: every GPU expert keeps its RAM copy while the RAM cache ranks it high).

        draft_model: as llama-cpp-python's (speculative decoding); hybrimoe turns ``logits_all`` on for it (the
            verification batches need every token's logits).

    Raises:
        TypeError: a keyword neither llama-cpp-python's ``Llama`` nor hybrimoe knows (the message names the closest
            known one): a misspelt ``moe_*`` option would otherwise run without the engine.
        FileNotFoundError: ``model_path`` (or a ``moe_profile`` trace file) does not exist.
        ValueError: not a GGUF file, truncated, bad override, bad RPC endpoint, bad replay table, bad
            ``moe_*`` option (budget, policy, cost model, profile; a cache larger than the device's free memory), or
            llama.cpp could not load the model.
        RuntimeError: ``moe_cache`` in a process whose CPU backend is not hybrimoe's ggml-cpu (llama_cpp was
            loaded before hybrimoe). From ``eval`` and everything that decodes: the engine failed during a decode
            (a Python policy raised, the device failed); the message names the layer and the cause; an RPC server
            that disconnected is a ``hybrimoe.runtime.errors.DeviceLostError`` (a RuntimeError) naming it.
    """.format(presets=", ".join(f'``"{n}"``' for n in ENGINE_PRESETS), default_preset=DEFAULT_PRESET,
               prefetch=PREFETCH_LAYERS, auto_env=AUTO_CALIBRATE_ENV, cost_preset=DEFAULT_COST_HARDWARE)

    def __init__(self, model_path: str, *, rpc_servers: str | Sequence[str] | None = None,
                 tensor_buft_overrides: str | Sequence[str] | None = None, cpu_moe: bool = False,
                 n_cpu_moe: int | None = None, no_repack: bool = False, no_host: bool = False,
                 lazy_experts: bool = False,
                 n_seq_max: int | None = None, kv_unified: bool = False,
                 moe_hook: bool = False, moe_replay: np.ndarray | None = None,
                 moe_replay_scores: np.ndarray | None = None,
                 moe_cache=None, moe_policy=None, moe_prefetch_layers: int | None = None, moe_cost_model=None,
                 moe_profile=None, moe_ram_cache=None, moe_ram_policy=None, moe_cpu_fused: bool = False,
                 moe_ram_exclusive: bool = False, load_progress=None,
                 record_routing: bool = False, **kwargs):
        self._moe = _MoeParts()
        self._recorder = None
        self._moe_setup = None
        self._moe_warned = False
        check_keywords(kwargs)
        fa_type = flash_attn_type(kwargs.get("flash_attn", False))
        kwargs["flash_attn"] = fa_type == 1  # llama-cpp-python's boolean; "auto" reaches the context natively
        check_gguf(model_path)
        if n_seq_max is not None and (isinstance(n_seq_max, bool) or not isinstance(n_seq_max, int) or n_seq_max < 1):
            raise ValueError(f"n_seq_max must be an integer >= 1, got {n_seq_max!r}")
        if not isinstance(kv_unified, bool):
            raise ValueError(f"kv_unified must be True or False, got {kv_unified!r}")
        for name in ("n_threads", "n_threads_batch"):
            # llama-cpp-python takes None or 0 for its default count and hands any other value to llama.cpp's context
            v = kwargs.get(name)
            if v is None:
                continue
            try:
                ok = not isinstance(v, bool) and operator.index(v) >= 0
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"{name} must be an integer >= 1 (0 or None: llama-cpp-python's default), got {v!r}")
        if not isinstance(lazy_experts, bool):
            raise ValueError(f"lazy_experts must be True or False, got {lazy_experts!r}")
        if moe_ram_cache is not None and kwargs.get("use_mlock"):
            raise ValueError("moe_ram_cache cannot go with use_mlock=True: llama.cpp would lock every expert page of "
                             "the model's mapping, the RAM the tier is there to save; drop one of the two")
        if lazy_experts and kwargs.get("use_mlock"):
            raise ValueError("lazy_experts=True cannot go with use_mlock=True: llama.cpp locks the model's mapping "
                             "from its start, which would read and lock every expert page the lazy load leaves "
                             "unread; drop one of the two")
        kwargs = speculative_keywords(kwargs)
        self._rpc_endpoints = rpc_endpoints(rpc_servers)
        overrides = parse_tensor_overrides(tensor_buft_overrides) + moe_overrides(cpu_moe, n_cpu_moe)
        # RPC servers first (the engine's device is the first of them), then the engine's options, all checked
        # before the model loads (EngineSetup.create)
        rpc_devs = register_rpc_servers(self._rpc_endpoints, kwargs.get("verbose", True))
        setup = EngineSetup.create(model_path, moe_cache=moe_cache, moe_policy=moe_policy,
                                   moe_prefetch_layers=moe_prefetch_layers, moe_cost_model=moe_cost_model,
                                   moe_profile=moe_profile, kv_overrides=kwargs.get("kv_overrides"),
                                   rpc_devices=rpc_devs, tensor_overrides=overrides,
                                   moe_ram_cache=moe_ram_cache, moe_ram_policy=moe_ram_policy,
                                   n_ubatch=int(kwargs.get("n_ubatch") or 512), no_repack=no_repack,
                                   no_host=no_host, moe_cpu_fused=moe_cpu_fused,
                                   moe_ram_exclusive=moe_ram_exclusive)
        if setup is not None:
            check_split_mode(kwargs.get("split_mode", _lc.LLAMA_SPLIT_MODE_LAYER))
            if cpu_moe or n_cpu_moe:
                # upstream's placement flags: the engine keeps every routed expert in host memory already
                flag = "cpu_moe (--cpu-moe)" if cpu_moe else f"n_cpu_moe={n_cpu_moe} (--n-cpu-moe)"
                warnings.warn(f"{flag} has no effect with the MoE engine (moe_cache / moe_ram_cache): it keeps "
                              "every layer's routed experts in host memory and decides itself which run on the "
                              "GPU", stacklevel=2)
            setup = calibration.with_stored_cost(setup, model_path)
            if setup.ram_tier:
                lazy_experts = True  # the RAM tier reads the experts itself: the loader leaves them unread
                # the weights outside the experts read into RAM at load (anonymous memory), not left in the
                # mapping: under memory pressure the page cache would drop them and every ubatch would fault them
                # back in, page by page, while the RAM slots keep the room (the user may still ask for the mapping)
                kwargs.setdefault("use_mmap", False)
            # routed experts in host memory: with lazy experts the loader skips the override for the weights
            # (they stay in the mapping) and applies it to their biases and scales, which the engine copies too
            overrides.append(setup.expert_override())
        self._moe_setup = setup
        if record_routing:
            # kept on the Llama, which outlives its context (the context calls it on every graph)
            self._recorder = engine_module().RoutingRecorder()
        # devices: ours from rpc_servers, plus real accelerators; never another instance's RPC servers
        devices = rpc_devs + _ggml.local_gpus() if _ggml.rpc_device_ptrs() else None
        # the devices llama.cpp splits the layers over, in its order (-ts), and the main one (-mg), where the GPU
        # share of layers left on the host runs
        self._split_devices = list(devices) if devices is not None else _ggml.local_gpus()
        mg = kwargs.get("main_gpu", 0)
        check_main_gpu(mg, self._split_devices)
        self._main_device = self._split_devices[mg] if mg < len(self._split_devices) else None
        # the engine's CPU share runs on repacked experts where upstream repacks them (the RAM tier's slots keep
        # the file's layout unless HYBRIMOE_RAM_REPACK asks for them repacked after each read)
        self._native = NativeParams(
            overrides, devices=devices, load_progress=load_progress, no_repack=no_repack, no_host=no_host,
            lazy_experts=lazy_experts, n_seq_max=n_seq_max, kv_unified=kv_unified,
            eval_callback=None if self._recorder is None else
            (engine_module().RoutingRecorder.callback_address, self._recorder.address), flash_attn=fa_type)
        with self._native.patched():
            super().__init__(model_path, **kwargs)
        self.context_params.flash_attn_type = fa_type  # what the context was created with
        self._size_arrays_to_context()
        # hybrimoe's objects live on llama-cpp-python's exit stack, after the context: close() (and the stack's
        # own unwinding) releases the engine and detaches the hook and the replay before the context is freed
        self._moe.ctx = self._ctx
        self._stack.callback(self._moe.close)
        try:
            self._attach_moe(moe_replay, moe_hook, kwargs.get("n_threads"), moe_replay_scores)
        except BaseException:
            self.close()
            raise

    def _size_arrays_to_context(self) -> None:
        # llama.cpp pads the context (llama_n_ctx can exceed the n_ctx asked for: 256 for 64), and llama-cpp-python
        # checks prompts against the padded size but sized its token array (and, with logits_all, its logits) by
        # the request: a prompt between the two sizes overflowed them. They get the context's real size.
        n_real = int(self.n_ctx())
        if len(self.input_ids) < n_real:
            ids = np.zeros(n_real, dtype=self.input_ids.dtype)
            ids[:len(self.input_ids)] = self.input_ids
            self.input_ids = ids
            if getattr(self, "_logits_all", False) and self.scores.shape[0] < n_real:
                self.scores = np.zeros((n_real, self.scores.shape[1]), dtype=self.scores.dtype)

    def _attach_moe(self, moe_replay, moe_hook: bool, n_threads, moe_replay_scores=None) -> None:
        """Attaches the routing replay, the hook and the engine to the new context."""
        if moe_replay is None and moe_replay_scores is not None:
            raise ValueError("moe_replay_scores set without moe_replay: they are the replayed rows' router scores")
        if moe_replay is not None:
            self._attach_routing_replay(np.asarray(moe_replay), moe_replay_scores)
        setup = self._moe_setup
        if not moe_hook and setup is None:
            return
        self._moe.hook = engine_module().MoeHook(int(_lc.llama_model_n_layer(self.model)))
        self._moe.hook.attach(self._ctx_ptr())
        if setup is None:
            return
        if setup.ram_tier and not self.uses_mmap:
            # the weights outside the experts are in the process's memory now: their pages in the page cache are a
            # second copy, and the loader's read-ahead brought expert pages in beside them; drop the files' pages
            # (before "auto" measures the memory available)
            from hybrimoe.model.reader import open_gguf
            from hybrimoe.runtime.disk_calibration import drop_from_page_cache

            for f in open_gguf(setup.facts.path).files:
                drop_from_page_cache(f)
        # known only now: which device holds each MoE layer, the device memory left ("auto") and the loaded model to
        # calibrate on
        if setup.device is not None or self._split_devices:
            layer_devs = model_layer_devices(self.model, setup.facts.moe_layers)
            setup = setup.with_devices(layer_devs, self._split_devices, self._main_device)
        setup = setup.with_auto_slots(self.context_params.n_ubatch)
        setup = setup.with_auto_ram_slots(self.context_params.n_ubatch, other_in_ram=not self.uses_mmap)
        setup = calibration.with_first_use_cost(self, setup, n_threads)
        setup = calibration.with_device_costs(setup, self.model_path)
        self._moe.hook.reset_counters()  # the user's statistics start with the user's first eval
        # (_moe_warned is kept: a first-use calibration that already warned about layers left to upstream's
        # path warned about the same layers the user's evals will see, and once is enough)
        self._moe_setup = setup
        self._moe.engine = setup.make_engine()
        if self._moe.routing_replay is not None:
            self._moe.engine.set_routing_replay(self._moe.routing_replay)  # its scores, where it has them
        self._moe.hook.set_engine(self._moe.engine)

    @property
    def uses_mmap(self) -> bool:
        """Whether the model's weights are mapped from the file (llama.cpp's load mode: mmap, or mmap and mlock)
        rather than read into the process's memory."""
        return int(self.model_params.load_mode) in (int(_lc.LLAMA_LOAD_MODE_MMAP), int(_lc.LLAMA_LOAD_MODE_MMAP_MLOCK))

    @property
    def moe_setup(self) -> "EngineSetup | None":
        """The engine's set-up (:class:`hybrimoe.runtime.setup.EngineSetup`: facts, slots, policies, cost model,
        device),
        read-only; None without ``moe_cache``."""
        return self._moe_setup

    @property
    def moe_engine(self):
        """The MoE engine (``hybrimoe._engine.Engine``: counters, decision log, slot pool), or None without
        ``moe_cache`` (and after :meth:`close`)."""
        return self._moe.engine

    @property
    def moe_hook(self):
        """hybrimoe's MoE hook on this context (``hybrimoe._engine.MoeHook``: per-layer counters, routing
        recording), or None without ``moe_hook`` / ``moe_cache`` (and after :meth:`close`)."""
        return self._moe.hook

    @property
    def moe_recorder(self):
        """The routing recorder (``hybrimoe._engine.RoutingRecorder``) of ``record_routing``, or None."""
        return self._recorder

    @property
    def moe_replay(self):
        """The routing replay (``hybrimoe._engine.RoutingReplay``) of ``moe_replay``, or None."""
        return self._moe.routing_replay

    def _ctx_ptr(self) -> int:
        ctx = self._ctx.ctx
        return int(ctx.value if hasattr(ctx, "value") else ctx)

    def _attach_routing_replay(self, ids: np.ndarray, scores=None) -> None:
        # the same checks as --replay-trace's (hybrimoe.traces.routing_replay), against the loaded model's layers
        _, n_expert, top_k, moe_layers = model_routing_shape(self.model_path)
        n_layer = int(_lc.llama_model_n_layer(self.model))
        ids = check_routing_replay_table(ids, n_layer, n_expert, top_k, moe_layers)
        if scores is not None:
            scores = np.asarray(scores, dtype=np.float32)
            if scores.shape != (ids.shape[0], n_layer, n_expert):
                raise ValueError(f"moe_replay_scores must have shape [n_rows, n_layer, n_expert] = "
                                 f"{(ids.shape[0], n_layer, n_expert)}, got {scores.shape}")
            if not np.isfinite(scores).all():
                raise ValueError("moe_replay_scores holds values that are not finite")
        self._moe.routing_replay = engine_module().RoutingReplay(ids, n_expert, scores)
        self._moe.routing_replay.attach(self._ctx_ptr())

    def eval(self, tokens, *, logits_all: bool = False):
        """llama-cpp-python's ``eval``; raises RuntimeError when the MoE engine failed during it (the layers it
        failed in were computed on the CPU; the next call tries the engine again). llama-cpp-python has then
        already counted the tokens as evaluated (``n_tokens``). With ``moe_hook`` or ``moe_cache``, warns once
        (RuntimeWarning) when MoE layers were left to upstream's path or to the CPU only.

        ``logits_all``: compute the outputs of every token, not only the last of each batch, so that every layer
        sees every token (llama.cpp's model builders drop the tokens without an output before the last layer's
        FFN; the routing recorder needs them all). The extra logits are not kept (``scores`` is llama-cpp-python's
        and sized for its own ``logits_all``)."""
        if self._moe.engine is not None:
            self._moe.engine.clear_failure()
        try:
            if logits_all:
                self._eval_all_outputs(tokens)
            else:
                super().eval(tokens)
        except RuntimeError as e:
            raise self._decode_failure(e) from e
        if self._moe.hook is not None and not self._moe_warned:
            self._moe_warned = True  # the hook has seen every layer once the first graph ran
            st = self.moe_stats()
            for key, where in (("unsupported", "upstream's path"), ("engine_skipped", "the CPU only")):
                if st.get(key):
                    reasons = sorted({u["reason"] for u in st[key]})
                    # stacklevel 3: the caller of eval, past the closed-check wrapper (_open_only)
                    warnings.warn(f"{len(st[key])} MoE layer(s) ran on {where} ({'; '.join(reasons)})",
                                  RuntimeWarning, stacklevel=3)
        err = self._moe.engine.take_error() if self._moe.engine is not None else ""
        if err:  # (no engine reference left in this frame: a kept traceback must not keep the engine alive)
            raise RuntimeError(f"hybrimoe engine failed: {err}")

    def _decode_batch(self, batch) -> None:
        """``llama_decode`` of a raw ``llama_batch`` (the batch API's steps: several sequences), with ``eval``'s
        failure handling: RuntimeError when the decode or the MoE engine failed, a lost device as
        :class:`hybrimoe.runtime.errors.DeviceLostError`."""
        if self._moe.engine is not None:
            self._moe.engine.clear_failure()
        rc = llama_cpp.llama_cpp.llama_decode(self.ctx, batch)
        if rc != 0:
            raise self._decode_failure(RuntimeError(f"llama_decode returned {rc}"))
        err = self._moe.engine.take_error() if self._moe.engine is not None else ""
        if err:
            raise RuntimeError(f"hybrimoe engine failed: {err}")

    def create_completions(self, prompts, **kwargs) -> list:
        """Completions of several prompts generated together: one decode per step carries the next token of every
        prompt that is generating and chunks of those still prefilling (continuous batching, as llama-server's
        slots; :class:`hybrimoe.runtime.batch.BatchGenerator`). Up to ``n_seq_max`` prompts (the constructor's)
        run at once, the others wait for a slot; each gets ``n_ctx / n_seq_max`` tokens of context (llama.cpp
        rounds it up to a multiple of 256).

        ``prompts``: strings or token lists. Keywords: ``max_tokens``, ``temperature``, ``top_p``, ``min_p``,
        ``typical_p``, ``stop``, ``frequency_penalty``, ``presence_penalty``, ``repeat_penalty``, ``top_k``,
        ``seed``, ``logit_bias`` (token id -> added logit), ``grammar`` (a ``llama_cpp.LlamaGrammar`` or GBNF
        text), ``logprobs`` (top tokens to list; without ``logits_all``, unlike ``create_completion``), as
        ``create_completion``'s (same defaults), each one value for all or a list with one per prompt.
        Returns one ``create_completion``-style dict per prompt, in order. The prompt cache of ``create_completion``
        is cleared before and after.

        Raises:
            ValueError: no prompts, an empty prompt, a list of values of the wrong length, an unknown keyword, a
                value the samplers cannot take (a grammar llama.cpp does not parse included), or a prompt longer
                than one sequence's context (``max_tokens`` is cut to what that context leaves, as
                ``create_completion`` cuts it).
            RuntimeError: a failed decode (as ``eval``).
        """
        from hybrimoe.runtime.batch import BatchGenerator

        return BatchGenerator(self).run(prompts, **kwargs)

    def _decode_failure(self, e: RuntimeError) -> RuntimeError:
        """The error to raise for a failed decode: :class:`hybrimoe.runtime.errors.DeviceLostError` naming the lost
        RPC servers when ggml's RPC client lost one, else ``e`` with the likely cause where RPC servers are in use."""
        if not (self._rpc_endpoints and "llama_decode returned" in str(e)):
            return e
        lost = [(ep, m) for ep in self._rpc_endpoints for m in [_ggml.rpc_connection_error(ep)] if m]
        if lost:
            devices = [m for _, m in lost]
            return DeviceLostError(f"{e}: {'; '.join(devices)}; this Llama cannot compute any more (close it)",
                                   devices, [ep for ep, _ in lost])
        return RuntimeError(f"{e} (the compute failed; with RPC servers ({', '.join(self._rpc_endpoints)}) a server "
                            "that stopped answering is the usual cause: see the log)")

    def embed(self, *args, **kwargs):
        """llama-cpp-python's ``embed``; a lost device raises :class:`hybrimoe.runtime.errors.DeviceLostError`, as in
        :meth:`eval`."""
        try:
            return super().embed(*args, **kwargs)
        except RuntimeError as e:
            raise self._decode_failure(e) from e

    def _eval_all_outputs(self, tokens) -> None:
        # llama-cpp-python's eval loop (Llama.eval) with every token's output flag set
        self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
        for i in range(0, len(tokens), self.n_batch):
            batch = tokens[i:min(len(tokens), i + self.n_batch)]
            n_past = self.n_tokens
            self._batch.set_batch(batch=batch, n_past=n_past, logits_all=True)
            self._ctx.decode(self._batch)
            self.input_ids[n_past:n_past + len(batch)] = batch
            self.n_tokens += len(batch)
            self._requires_eval = False

    def moe_log(self, on: bool = True) -> None:
        """Starts (or, ``on=False``, stops and drops) the engine's decision log: one record per MoE layer and
        ubatch (routing ids ``[T, k]``, router scores ``[T, E]``, expert bytes, the engine's clock and copy-queue
        estimate, predictions shown to the prefetcher, and every decision: cached, planned and run split, loads,
        prefetches, fills, evictions, predicted makespan). Start it before the first decode to replay it with
        :func:`hybrimoe.runtime.decision_replay.replay_engine_log`. The log grows with every record (the router scores
        alone are ``T x E`` floats per MoE layer and ubatch: about 3.4 MB per 512-token prompt of a 26-layer, 64-expert
        model): take it often or stop it on long runs. Raises ValueError without the engine (``moe_cache``)."""
        if self._moe.engine is None:
            raise ValueError("moe_log needs the MoE engine (moe_cache=...)")
        self._moe.engine.set_logging(bool(on))

    def moe_take_log(self) -> list:
        """The decision records kept since the last call (see :meth:`moe_log`), as dicts. Raises ValueError
        without the engine."""
        if self._moe.engine is None:
            raise ValueError("moe_take_log needs the MoE engine (moe_cache=...)")
        return self._moe.engine.take_log()

    def moe_stats(self) -> dict:
        """Statistics of hybrimoe's MoE hook and engine.

        Hook (``moe_hook`` or ``moe_cache``): per model layer, plan-node runs (one per ubatch), tokens, hook calls
        (graph builds); layers left on upstream's path (``unsupported``) or on the CPU-only path
        (``engine_skipped``) with the reason. Empty without either option.

        Engine (``moe_cache`` or ``moe_ram_cache``), under ``"engine"``: ``policy``, ``cost_model`` (where the
        planner's cost model came from), ``moe_cache`` (how the GPU slots were sized), ``profile`` (where
        ``moe_profile`` came from, '' without one), ``n_slots``, ``slot_bytes`` (bytes), ``slot_buffers``, ``hit_rate``
        (activated experts resident when their layer ran / all activated experts), ``cache`` (accesses, hits,
        misses, admissions, evictions), ``cpu_experts`` / ``gpu_experts`` (distinct experts per layer and ubatch,
        summed), ``cpu_late_experts`` (of the CPU's, those the RAM tier was still reading at the layer's plan,
        which the CPU share computes in a second pass after the others; 0 with ``HYBRIMOE_RAM_TWO_PASS=0``, where
        it runs one pass after every read), ``ram`` (the RAM tier's counters, ``moe_ram_cache``; see
        :func:`hybrimoe.runtime.stats.ram_stats`), ``bytes_copied`` and its parts
        ``bytes_demand`` / ``bytes_prefetch`` / ``bytes_fill`` (H2D bytes), ``layer_s`` (mean seconds per MoE layer
        run, plan start to GPU share done), ``all_cpu_reason`` (why the planner put no expert on the GPU, from its
        cost model, when it did so; "" otherwise: :func:`hybrimoe.runtime.stats.all_cpu_reason`), ``failed``
        (the engine fell back to upstream's path after an error), ``repacked`` (per MoE layer, whether the CPU share
        reads its gate, up and down matrices repacked), ``fused`` / ``fused_mode`` (``moe_cpu_fused``: the largest
        ubatch each layer's CPU share runs fused, and the mode), ``layers`` (per MoE layer counters, see
        ``hybrimoe._engine.Engine.layer_stats``) and ``devices`` (per device that holds expert slots: its MoE layers,
        slots, hit rate, experts run and bytes copied, :func:`hybrimoe.runtime.stats.device_stats`; with several
        GPUs the figures above are the totals over them), ``predictor`` (a reuse-predicting cache's learning: its
        samples, log-loss and Brier score, weights; ``{}`` for other policies:
        :func:`hybrimoe.runtime.stats.predictor_stats`; the RAM tier's under ``ram``).
        """
        if self._moe.hook is None:
            return {}
        out = hook_stats(self._moe.hook)
        if self._moe.engine is not None:
            out["engine"] = engine_stats(self._moe.engine, self._moe_setup)
        return out

    def create_completion(self, prompt, *args, **kwargs):
        if (isinstance(prompt, (str, bytes)) and len(prompt) == 0) or \
                (isinstance(prompt, (list, tuple)) and len(prompt) == 0):
            raise ValueError("prompt is empty: give at least one character or token")
        # values llama-cpp-python would crash on (a grammar llama.cpp cannot parse), raise a ctypes error for, or
        # ignore (a logit bias outside the vocabulary): ValueError first, as the batch path checks them
        from hybrimoe.runtime.batch import checked_sampling

        checked = checked_sampling(self, kwargs)
        if checked.get("grammar") is not None:
            kwargs["grammar"] = checked["grammar"]
        call = _COMPLETION_SIGNATURE.bind(self, prompt, *args, **kwargs)
        call.apply_defaults()
        max_tokens, stream = call.arguments["max_tokens"], call.arguments["stream"]
        # llama-cpp-python's loop skips its max_tokens check while the text ends inside a UTF-8 character, so a
        # completion could run on to the end of the context and fail there (llama_decode returns 1); generate()
        # ends it at max_tokens, or where the context is full, as "length". The limit is this call's own: handed
        # to the generate() the completion starts, and to no other.
        state = _Cut(max_tokens if max_tokens is not None and max_tokens > 0 else None)
        if stream:
            return self._length_marked(super().create_completion(prompt, *args, **kwargs), state)
        self._gen_state = state
        try:
            out = super().create_completion(prompt, *args, **kwargs)
        finally:
            if self._gen_state is state:  # the completion failed before its generate() took it
                self._gen_state = None
        if state.cut and out.get("choices"):
            out["choices"][0]["finish_reason"] = "length"
        return out

    def _length_marked(self, chunks, state: "_Cut"):
        """A streamed completion (``chunks``, not started yet) whose generate() gets ``state`` as it starts; where
        generate() cut it, its last chunk's finish reason is "length"."""
        self._gen_state = state  # the first next() below runs the completion up to its generate(), which takes it
        try:
            for chunk in chunks:
                if state.cut and chunk.get("choices") and chunk["choices"][0].get("finish_reason") == "stop":
                    chunk["choices"][0]["finish_reason"] = "length"
                yield chunk
        finally:
            if self._gen_state is state:
                self._gen_state = None

    def generate(self, tokens, *args, **kwargs):
        """llama-cpp-python's ``generate`` (sampled token ids, without end). Started by ``create_completion`` it
        also ends after ``max_tokens`` tokens and before a token the context has no cell left to evaluate: it then
        gives an end-of-generation token, so that the completion ends there with its text whole (and
        ``create_completion`` reports "length"). Called by itself it is llama-cpp-python's."""
        state, self._gen_state = getattr(self, "_gen_state", None), None  # one completion's
        if state is None:
            yield from super().generate(tokens, *args, **kwargs)
            return
        it = super().generate(tokens, *args, **kwargs)
        n = 0
        while True:
            # each token after the first is evaluated when the next one is asked for: it needs a free cell
            full = n > 0 and self.n_tokens >= self._n_ctx
            if full or (state.limit is not None and n >= state.limit):
                end = self._end_token()
                if end < 0:  # the vocabulary has no end token to give: the generation just ends
                    return
                state.cut = True
                yield end
                return
            try:
                token = next(it)
            except StopIteration:
                return
            n += 1
            yield token

    def _end_token(self) -> int:
        """A token llama.cpp counts as the end of generation (``llama_vocab_is_eog``): the end-of-sequence token,
        else the first such id of the vocabulary; -1 where there is none."""
        if getattr(self, "_eog_token", None) is None:
            eos = self.token_eos()
            vocab = self._model.vocab
            if eos >= 0 and _lc.llama_vocab_is_eog(vocab, eos):
                self._eog_token = eos
            else:
                self._eog_token = next((t for t in range(self.n_vocab()) if _lc.llama_vocab_is_eog(vocab, t)), -1)
        return self._eog_token

    def close(self) -> None:
        """Frees the context and the model (llama-cpp-python's ``close``): hybrimoe's engine, hook and replay go
        first (they are on its exit stack, after the context). Afterwards the generation, eval and tokenizer
        methods raise RuntimeError (llama-cpp-python would use the freed context and crash)."""
        self._closed = True
        if hasattr(self, "_stack"):  # llama-cpp-python's __init__ may not have run (bad input)
            super().close()
        elif getattr(self, "_moe", None) is not None:
            self._moe.close()


#: the public methods that use the model or the context: after ``close()`` they raise instead of touching freed
#: memory
_NEEDS_OPEN = ("__call__", "create_completion", "create_completions", "create_chat_completion", "generate", "eval",
               "sample", "tokenize", "detokenize", "embed", "create_embedding", "reset", "save_state", "load_state",
               "n_ctx", "n_vocab", "n_embd", "token_bos", "token_eos", "token_nl")


def _open_only(name: str, method):
    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        if getattr(self, "_closed", False):
            raise RuntimeError(f"Llama.{name}: this Llama is closed (close() freed its model and context); "
                               "load the model again")
        return method(self, *args, **kwargs)

    return checked


for _name in _NEEDS_OPEN:
    if hasattr(Llama, _name):
        setattr(Llama, _name, _open_only(_name, getattr(Llama, _name)))
del _name
