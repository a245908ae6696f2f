"""The model, placement, sampling and engine flags that ``run``, ``trace`` and ``serve`` share (llama.cpp's names:
``-m -t -c -b -ub -ngl -fa -sm -ts -mg --seed --temp -ot --cpu-moe --n-cpu-moe --rpc``; hybrimoe's own start with
``--moe-``), and loading a :class:`hybrimoe.Llama` from them."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tqdm import tqdm

from hybrimoe.commands.args import (
    COUNT,
    FUSED_FLAG,
    POSITIVE,
    SAMPLING_SEED,
    TEMPERATURE,
    THREADS,
    TOP_P,
    int_in,
    llama_threads_default,
    tensor_split,
)
from hybrimoe.envs import AUTO_CALIBRATE_ENV, DEFAULT_COST_HARDWARE, PREFETCH_LAYERS, progress_on
from hybrimoe.policy.hardware import hardware_names
from hybrimoe.policy.presets import DEFAULT_PRESET, ENGINE_PRESETS
from hybrimoe.runtime.devices import SPLIT_MODES


def add_split_arguments(p: argparse.ArgumentParser) -> None:
    """llama.cpp's flags for several devices: ``-sm``, ``-ts``, ``-mg`` (:func:`split_keywords` reads them)."""
    p.add_argument("-sm", "--split-mode", choices=("none", "layer", "row", "tensor"), default="layer",
                   help="how to split the model over several devices: layer (each layer and its experts' cache on "
                        "one device), none (one device, -mg); row and tensor are refused with the MoE engine")
    p.add_argument("-ts", "--tensor-split", type=tensor_split, default=None, metavar="N0,N1,...",
                   help="fraction of the layers for each device, e.g. 3,1 (default: by free memory)")
    p.add_argument("-mg", "--main-gpu", type=COUNT, default=0,
                   help="the device for -sm none, and for the GPU share of layers left on the host")


def flash_attn_word(value: str) -> str:
    """``-fa``'s value as ``on``, ``off`` or ``auto`` (llama.cpp's words:
    :data:`hybrimoe.runtime.params.FLASH_ATTN_NAMES`).

    Raises:
        argparse.ArgumentTypeError: another word.
    """
    from hybrimoe.runtime.params import FLASH_ATTN_NAMES

    t = FLASH_ATTN_NAMES.get(value.strip().lower())
    if t is None:
        raise argparse.ArgumentTypeError(f"unknown value {value!r}: use on, off or auto")
    return {1: "on", 0: "off", -1: "auto"}[t]


def add_flash_attn_argument(p: argparse.ArgumentParser) -> None:
    """llama.cpp's ``-fa``, with its default: ``auto`` (flash attention where every layer's device supports it)."""
    p.add_argument("-fa", "--flash-attn", type=flash_attn_word, default="auto", metavar="on|off|auto",
                   help="flash attention: on, off, or auto = where the devices support it, as upstream (which also "
                        "takes enabled/true/1, disabled/false/0) (default: %(default)s)")


def split_keywords(args: argparse.Namespace) -> dict:
    """The Llama keywords of :func:`add_split_arguments`' flags."""
    return dict(split_mode=SPLIT_MODES[args.split_mode], main_gpu=args.main_gpu,
                **({"tensor_split": args.tensor_split} if args.tensor_split else {}))


def add_llama_arguments(p: argparse.ArgumentParser, sampling: bool = True) -> None:
    """Adds the shared flags to ``p``. ``sampling=False`` leaves out ``--temp``, ``--top-k`` and ``--top-p``
    (``serve``: each request brings its own)."""
    p.add_argument("-m", "--model", help="GGUF model (default: a tiny qwen3moe model, created on first use)")
    p.add_argument("-t", "--threads", type=THREADS, default=None,
                   help=f"CPU threads for generation and prompt processing (default: {llama_threads_default()})")
    p.add_argument("-c", "--ctx-size", type=COUNT, default=512, help="context size in tokens (0: the model's)")
    p.add_argument("-b", "--batch-size", type=POSITIVE, default=512, help="logical batch size in tokens")
    p.add_argument("-ub", "--ubatch-size", type=POSITIVE, default=512, help="physical batch (ubatch) size in tokens")
    p.add_argument("-ngl", "--n-gpu-layers", type=int_in(0, also=(-1,)), default=0,
                   help="layers to offload to the devices (-1: all)")
    add_flash_attn_argument(p)
    add_split_arguments(p)
    p.add_argument("--seed", type=SAMPLING_SEED, default=-1, help="sampling seed (-1: random)")
    if sampling:
        p.add_argument("--temp", type=TEMPERATURE, default=0.8, help="temperature (0: greedy)")
        p.add_argument("--top-k", type=COUNT, default=40, help="top-k sampling (0: off)")
        p.add_argument("--top-p", type=TOP_P, default=0.95, help="top-p sampling, in (0, 1]")
    p.add_argument("-ot", "--override-tensor", action="append", default=[], metavar="REGEX=BUFT,...",
                   help="keep tensors matching REGEX in buffer type BUFT, e.g. exps=CPU (repeatable)")
    p.add_argument("-cmoe", "--cpu-moe", action="store_true", help="keep all routed experts in host memory")
    p.add_argument("-ncmoe", "--n-cpu-moe", type=COUNT, default=None, metavar="N",
                   help="keep the routed experts of the first N layers in host memory")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT,...", help="ggml RPC servers to use as devices")
    p.add_argument("--moe-hook", action="store_true",
                   help="install hybrimoe's MoE hook alone (CPU path, upstream's numbers; for checks)")
    p.add_argument("--moe-cache", default=None, metavar="SIZE",
                   help="turn on the hybrid CPU+GPU engine with a GPU expert cache of SIZE: 25%% (of all routed "
                        "experts), 3GiB, 512MB or bytes; auto = as much as the device has left after the model "
                        "(like upstream's --fit); 0 = every expert on the CPU through the engine (default: off: "
                        "upstream's MoE path). Several GPUs (-ts): a cache on each, SIZE each (25%% of its own "
                        "layers' experts), or one SIZE per GPU in -ts order: 10GiB,6GiB")
    p.add_argument("--moe-ram-cache", default=None, metavar="SIZE",
                   help="for a model larger than RAM: keep SIZE of the routed experts in RAM (40%% of their bytes, "
                        "12GiB, bytes, or auto = what the memory left after the load holds) and read the others from "
                        "the GGUF file when needed or ahead by the router look-ahead; the loader leaves them unread. "
                        "Turns the engine on with --moe-cache 0 (every expert on the CPU) (default: off: every "
                        "expert read at load, as upstream)")
    p.add_argument("--moe-ram-policy", default=None, metavar="NAME",
                   help="the RAM tier's cache policy: mrs (default; alpha 0.1), lru, lfu, reuse (predicted reuse); "
                        "each with TinyLFU admission of reads ahead; the simulator's RAM presets hybrimoe and "
                        "hybrimoe-reuse name mrs and reuse (needs --moe-ram-cache)")
    p.add_argument("--moe-ram-exclusive", action="store_true",
                   help="with --moe-cache and --moe-ram-cache: exclusive tiers (an expert on the GPU gives up its RAM "
                        "slot; one the GPU evicts is copied back into RAM when it ranks high enough) (default: off, "
                        "inclusive)")
    p.add_argument("--moe-policy", default=None,
                   help=f"engine policy: {', '.join(ENGINE_PRESETS)} (default: {DEFAULT_PRESET}; needs --moe-cache; "
                        "hot-set needs --moe-profile; what each does: hybrimoe.policy.presets.SYSTEM_PRESETS)")
    p.add_argument("--moe-profile", default=None, metavar="TRACE.npz",
                   help="profile of expert frequencies: a routing trace (hybrimoe trace -o FILE) whose activation "
                        "counts per (MoE layer, expert) choose hot-set's resident experts and the adaptive caches' "
                        "initial fill; its MoE layers and experts must be the model's (needs --moe-cache; "
                        "--moe-policy hot-set needs it)")
    p.add_argument("--moe-prefetch-layers", type=COUNT, default=None, metavar="N",
                   help=f"MoE layers predicted and prefetched ahead (0: none; default: {PREFETCH_LAYERS}): "
                        "copied to the GPU cache (--moe-cache) and read into the RAM tier (--moe-ram-cache)")
    p.add_argument("--moe-cost-model", default=None, metavar="PRESET|FILE",
                   help=f"planner cost model: a hardware preset ({', '.join(hardware_names())}) or a JSON "
                        "file (default: this model's stored calibration on this device, see hybrimoe calibrate; "
                        "without one, a short calibration runs on first use and is stored; "
                        f"{AUTO_CALIBRATE_ENV}=0: {DEFAULT_COST_HARDWARE} instead; --moe-stats names the one used)")
    p.add_argument("--moe-cpu-fused", nargs="?", const="on", default="off", choices=("on", "fast", "off"),
                   help="each MoE layer's CPU share as one fused op: 'on' (the flag alone) with upstream's kernels and "
                        "numbers; 'fast' also with repacked gemm kernels that round differently (faster Q4_K "
                        "prefill); needs --moe-cache or --moe-ram-cache (default: %(default)s)")
    p.add_argument("-nr", "--no-repack", action="store_true",
                   help="keep CPU weights in the file's layout (upstream --no-repack)")
    p.add_argument("--no-host", action="store_true",
                   help="keep CPU weights out of the GPU's pinned host buffer, so that they may be repacked "
                        "(upstream --no-host)")
    p.add_argument("--lazy-experts", action="store_true",
                   help="leave the routed experts unread at load: their pages are read from the file when first "
                        "used (for a model larger than RAM)")
    p.add_argument("--verbose", action="store_true", help="llama.cpp's log on stderr")


def one_line_warning(message, *args, **kwargs) -> str:
    """``warnings.formatwarning`` of the CLI: ``hybrimoe: warning: MESSAGE``, one line, no source location."""
    return f"hybrimoe: warning: {message}\n"


def model_argument(args: argparse.Namespace, prog: str) -> Path | None:
    """``-m`` as a path, or the default tiny model (written on first use); None after printing the error."""
    from hybrimoe.runtime.generate import default_model_path

    try:
        return Path(args.model) if args.model else default_model_path()
    except OSError as e:
        print(f"{prog}: error: cannot write the default model: {e}", file=sys.stderr)
        return None


def load_llama(args: argparse.Namespace, model: Path, prog: str, *, llama_class=None, **extra):
    """A :class:`hybrimoe.Llama` (or ``llama_class``, a subclass) from :func:`add_llama_arguments`'s flags
    (``extra``: more keyword arguments), with a load progress bar on a terminal. Returns None after printing
    ``prog: error: ...`` when the model cannot be loaded."""
    from hybrimoe.runtime.llama import Llama

    # the bar writes to a copy of stderr's descriptor: llama-cpp-python points stderr at /dev/null while it loads a
    # model without verbose, and the bar would stay at 0%
    out = os.fdopen(os.dup(sys.stderr.fileno()), "w") if progress_on() else sys.stderr
    bar = tqdm(total=100, desc="loading", unit="%", file=out, leave=False, disable=not progress_on())

    def progress(fraction: float) -> None:
        bar.n = int(round(100 * fraction))
        bar.refresh()
        if fraction >= 1.0:
            bar.close()  # loaded: what follows (a first-use calibration, warnings) starts on a line of its own

    try:
        return (llama_class or Llama)(
            str(model), n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
            n_threads=args.threads, n_threads_batch=args.threads, n_gpu_layers=args.n_gpu_layers,
            flash_attn=args.flash_attn, **split_keywords(args), seed=args.seed if args.seed >= 0 else 0xFFFFFFFF,
            verbose=args.verbose,
            rpc_servers=args.rpc, tensor_buft_overrides=args.override_tensor or None,
            cpu_moe=args.cpu_moe, n_cpu_moe=args.n_cpu_moe, moe_hook=args.moe_hook, no_repack=args.no_repack,
            no_host=args.no_host, lazy_experts=args.lazy_experts,
            moe_cache=args.moe_cache, moe_policy=args.moe_policy, moe_prefetch_layers=args.moe_prefetch_layers,
            moe_cost_model=args.moe_cost_model, moe_profile=args.moe_profile, moe_ram_cache=args.moe_ram_cache,
            moe_ram_policy=args.moe_ram_policy, moe_cpu_fused=FUSED_FLAG[args.moe_cpu_fused], load_progress=progress,
            moe_ram_exclusive=args.moe_ram_exclusive, **extra)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None
    finally:
        bar.close()
        if out is not sys.stderr:
            out.close()
