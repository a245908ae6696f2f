"""The hybrimoe command line: run, serve, info, make-tiny-model, trace, simulate, synth, calibrate, bench.

Flags follow llama.cpp's tools (``-m -p -n -t -c -ngl -ub --seed --temp -ot --n-cpu-moe --rpc``); hybrimoe's
own flags start with ``--moe-``.
"""
from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
from pathlib import Path

from .defaults import progress_on

DEFAULT_PROMPT = "Once upon a time"


def default_model_path() -> Path:
    """The default model of ``hybrimoe run``: a tiny qwen3moe Q8_0 GGUF in the cache, written on first use."""
    from .defaults import cache_dir

    path = cache_dir() / "models" / "tiny-qwen3moe-q8_0-seed0.gguf"
    if not path.exists():
        from .tiny import make_tiny_model

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.gguf")
        try:
            make_tiny_model(tmp, "qwen3moe", seed=0, quant="Q8_0")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        print(f"hybrimoe: wrote the default tiny model {path}", file=sys.stderr)
    return path


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="prompt text (default: %(default)r)")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate (default: %(default)s)")
    add_llama_arguments(p)
    p.add_argument("--replay-trace", default=None, metavar="TRACE.npz",
                   help="force every MoE layer's expert ids from a routing trace (token at position p gets row "
                        "p mod rows): real activation patterns on a synthetic model; the text is then meaningless")
    p.add_argument("--moe-stats", action="store_true",
                   help="print the engine's statistics (hit rate, CPU/GPU experts, bytes copied) on stderr")
    p.add_argument("--output-format", choices=["text", "json"], default="text",
                   help="text: stream the generated text; json: print {prompt_tokens, tokens, text, n_ctx} at the end")


def add_llama_arguments(p: argparse.ArgumentParser, sampling: bool = True) -> None:
    """The model, placement, sampling and engine flags that ``run``, ``trace`` and ``serve`` share (llama.cpp's
    names). ``sampling=False`` leaves out ``--temp``, ``--top-k`` and ``--top-p`` (``serve``: each request brings
    its own)."""
    p.add_argument("-m", "--model", help="GGUF model (default: a tiny qwen3moe model, created on first use)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: llama-cpp-python's)")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="context size in tokens")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="logical batch size in tokens")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="physical batch (ubatch) size in tokens")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                   help="layers to offload to the devices (-1: all)")
    p.add_argument("--seed", type=int, default=-1, help="sampling seed (-1: random)")
    if sampling:
        p.add_argument("--temp", type=float, default=0.8, help="temperature (0: greedy)")
        p.add_argument("--top-k", type=int, default=40)
        p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("-ot", "--override-tensor", action="append", default=[], metavar="REGEX=BUFT,...",
                   help="keep tensors matching REGEX in buffer type BUFT, e.g. exps=CPU (repeatable)")
    p.add_argument("-cmoe", "--cpu-moe", action="store_true", help="keep all routed experts in host memory")
    p.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=None, metavar="N",
                   help="keep the routed experts of the first N layers in host memory")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT,...", help="ggml RPC servers to use as devices")
    p.add_argument("--moe-hook", action="store_true",
                   help="install hybrimoe's MoE hook alone (CPU path, upstream's numbers; for checks)")
    from . import defaults
    from .policy import DEFAULT_PRESET, ENGINE_PRESETS, preset_names

    p.add_argument("--moe-cache", default=None, metavar="SIZE",
                   help="turn on the hybrid CPU+GPU engine with a GPU expert cache of SIZE: 25%% (of all routed "
                        "experts), 3GiB, 512MB or bytes; auto = as much as the device has left after the model "
                        "(like upstream's --fit); 0 = every expert on the CPU through the engine")
    p.add_argument("--moe-policy", default=None,
                   help=f"engine policy: {', '.join(ENGINE_PRESETS)} (default: {DEFAULT_PRESET}; needs --moe-cache; "
                        "hot-set needs --moe-profile; what each does: hybrimoe.policy.SYSTEM_PRESETS)")
    p.add_argument("--moe-profile", default=None, metavar="TRACE.npz",
                   help="profile of expert frequencies: a routing trace (hybrimoe trace -o FILE) whose activation "
                        "counts per (MoE layer, expert) choose hot-set's resident experts and the adaptive caches' "
                        "initial fill; its MoE layers and experts must be the model's (needs --moe-cache; "
                        "--moe-policy hot-set needs it)")
    p.add_argument("--moe-prefetch-layers", type=int, default=None, metavar="N",
                   help=f"MoE layers predicted and prefetched ahead (0: none; default: {defaults.PREFETCH_LAYERS}; "
                        "needs --moe-cache)")
    p.add_argument("--moe-cost-model", default=None, metavar="PRESET|FILE",
                   help=f"planner cost model: a hardware preset ({', '.join(preset_names())}) or a JSON "
                        "file (default: this model's stored calibration on this device, see hybrimoe calibrate; "
                        "without one, a short calibration runs on first use and is stored; "
                        f"{defaults.AUTO_CALIBRATE_ENV}=0: {defaults.COST_PRESET} instead; --moe-stats names the "
                        "one used)")
    p.add_argument("-nr", "--no-repack", action="store_true",
                   help="keep CPU weights in the file's layout (upstream --no-repack)")
    p.add_argument("--verbose", action="store_true", help="llama.cpp's log on stderr")


def check_llama_arguments(args: argparse.Namespace, prog: str) -> str:
    """The first bad value among :func:`add_llama_arguments`'s flags, as an error line, or ''."""
    if getattr(args, "n_predict", 0) < 0:
        return f"{prog}: error: -n must be >= 0"
    for name, value, low in (("-t", args.threads, 1), ("-c", args.ctx_size, 0), ("-b", args.batch_size, 1),
                             ("-ub", args.ubatch_size, 1)):
        if value is not None and value < low:
            return f"{prog}: error: {name} must be >= {low}, got {value}"
    if args.moe_prefetch_layers is not None and args.moe_prefetch_layers < 0:
        return f"{prog}: error: --moe-prefetch-layers must be >= 0"
    if getattr(args, "top_p", None) is not None and not 0.0 < args.top_p <= 1.0:
        return f"{prog}: error: --top-p must be in (0, 1], got {args.top_p}"
    return ""


def load_llama(args: argparse.Namespace, model: Path, prog: str, *, llama_class=None, **extra):
    """A :class:`hybrimoe.Llama` (or ``llama_class``, a subclass) from :func:`add_llama_arguments`'s flags
    (``extra``: more keyword arguments), with a load progress bar on a terminal; library warnings print as one
    ``hybrimoe: warning:`` line each. Returns None after printing ``prog: error: ...`` when the model cannot be
    loaded."""
    import warnings

    from tqdm import tqdm

    from .llama import Llama

    # the library's warnings (e.g. MoE layers left to upstream's path), one line each in the CLI's style
    warnings.formatwarning = one_line_warning
    bar = tqdm(total=100, desc="loading", unit="%", file=sys.stderr, leave=False,
               disable=not progress_on())

    def progress(fraction: float) -> None:
        bar.n = int(round(100 * fraction))
        bar.refresh()

    try:
        return (llama_class or Llama)(
            str(model), n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
            n_threads=args.threads, n_threads_batch=args.threads, n_gpu_layers=args.n_gpu_layers,
            seed=args.seed if args.seed >= 0 else 0xFFFFFFFF, verbose=args.verbose,
            rpc_servers=args.rpc, tensor_buft_overrides=args.override_tensor or None,
            cpu_moe=args.cpu_moe, n_cpu_moe=args.n_cpu_moe, moe_hook=args.moe_hook, no_repack=args.no_repack,
            moe_cache=args.moe_cache, moe_policy=args.moe_policy, moe_prefetch_layers=args.moe_prefetch_layers,
            moe_cost_model=args.moe_cost_model, moe_profile=args.moe_profile, load_progress=progress, **extra)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None
    finally:
        bar.close()


def model_argument(args: argparse.Namespace, prog: str) -> Path | None:
    """``-m`` as a path, or the default tiny model (written on first use); None after printing the error."""
    try:
        return Path(args.model) if args.model else default_model_path()
    except OSError as e:
        print(f"{prog}: error: cannot write the default model: {e}", file=sys.stderr)
        return None


def _run(args: argparse.Namespace) -> int:
    if args.prompt == "":
        print("hybrimoe run: error: the prompt is empty (-p TEXT)", file=sys.stderr)
        return 2
    bad = check_llama_arguments(args, "hybrimoe run")
    if not bad and args.moe_stats and args.moe_cache is None:
        # the statistics are the engine's: without it there are none to print
        bad = "hybrimoe run: error: --moe-stats prints the engine's statistics and needs --moe-cache (the engine)"
    if bad:
        print(bad, file=sys.stderr)
        return 2
    model = model_argument(args, "hybrimoe run")
    if model is None:
        return 1

    replay = None
    if args.replay_trace:
        from .replay import replay_table

        try:
            replay = replay_table(args.replay_trace, model)
        except (FileNotFoundError, ValueError) as e:
            print(f"hybrimoe run: error: --replay-trace: {e}", file=sys.stderr)
            return 1
        print(f"hybrimoe: routing replayed from {args.replay_trace} ({len(replay)} rows): the generated text is "
              "meaningless", file=sys.stderr)

    llm = load_llama(args, model, "hybrimoe run", moe_replay=replay)
    if llm is None:
        return 1
    try:
        prompt_tokens = llm.tokenize(args.prompt.encode(), add_bos=True, special=False)
        if len(prompt_tokens) >= llm.n_ctx():
            print(f"hybrimoe run: error: the prompt has {len(prompt_tokens)} tokens, the context holds "
                  f"{llm.n_ctx()} (-c)", file=sys.stderr)
            return 1
        try:
            tokens = generate_tokens(llm, prompt_tokens, args.n_predict, temp=args.temp, top_k=args.top_k,
                                     top_p=args.top_p,
                                     stream=sys.stdout if args.output_format == "text" else None)
        except (RuntimeError, ValueError) as e:
            print(f"\nhybrimoe run: error: generation failed: {e}", file=sys.stderr)
            return 1
        stats = llm.moe_stats() if (args.moe_hook or args.moe_cache is not None) else {}
        if args.output_format == "json":
            text = llm.detokenize(tokens).decode("utf-8", errors="replace")
            json.dump({"prompt_tokens": prompt_tokens, "tokens": tokens, "text": text, "n_ctx": llm.n_ctx()},
                      sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if args.moe_stats and "engine" in stats:
            e = stats["engine"]
            print(f"hybrimoe: engine {e['policy']}: {e['n_slots']} slots of {e['slot_bytes']} B, hit rate "
                  f"{e['hit_rate']:.3f}, experts CPU {e['cpu_experts']} / GPU {e['gpu_experts']}, H2D "
                  f"{e['bytes_copied'] / 2**20:.1f} MiB, {e['layer_s'] * 1e6:.0f} us per MoE layer; cost model: "
                  f"{e['cost_model']}" + (f"; profile: {e['profile']}" if e.get("profile") else ""),
                  file=sys.stderr)
    finally:
        llm.close()
    return 0


def generate_tokens(llm, prompt_tokens: list[int], n_predict: int, *, temp: float = 0.0, top_k: int = 40,
                    top_p: float = 0.95, stream=None) -> list[int]:
    """Generate up to ``n_predict`` tokens after ``prompt_tokens`` (stops at end-of-generation tokens and at
    the end of the context).

    With ``stream`` (a text file), writes each token's text as it comes (UTF-8 decoded incrementally).
    Returns the generated token ids. Sampling as llama-cpp-python's ``Llama.generate`` (temp 0: greedy).
    """
    from ._lib import llama_cpp_module

    lc = llama_cpp_module().llama_cpp
    vocab = lc.llama_model_get_vocab(llm.model)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out: list[int] = []
    # stop at the context's end (llama-cpp-python would fail to find a KV slot)
    n_predict = min(n_predict, llm.n_ctx() - len(prompt_tokens))
    if n_predict <= 0:
        return out
    for tok in llm.generate(prompt_tokens, temp=temp, top_k=top_k, top_p=top_p, reset=True):
        if lc.llama_vocab_is_eog(vocab, tok):
            break
        out.append(int(tok))
        if stream is not None:
            piece = llm.detokenize([tok], prev_tokens=prompt_tokens + out[:-1])
            stream.write(decoder.decode(piece))
            stream.flush()
        if len(out) >= n_predict:
            break
    if stream is not None:
        stream.write(decoder.decode(b"", final=True))
    return out


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_llama_arguments(p, sampling=False)
    # a server's prompts are chats, longer than run's one-line prompts: llama-cpp-python's server default
    p.set_defaults(ctx_size=2048)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default: %(default)s; 0: a free one, printed)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: none)")
    p.add_argument("-a", "--alias", default=None, metavar="NAME",
                   help="the model's name in the API (/v1/models, the requests' \"model\"; default: the file's "
                        "name without .gguf); requests naming another model get 404")
    p.add_argument("--interrupt-requests", action="store_true",
                   help="cut a running stream short when another request waits (llama-cpp-python's "
                        "interrupt_requests; default: off, every request runs to its end, one at a time)")
    p.add_argument("--chat-format", default=None, metavar="NAME",
                   help="llama-cpp-python chat format (chatml, llama-2, ...; default: the model's own chat "
                        "template, else llama-cpp-python's guess)")
    p.add_argument("--embedding", action="store_true",
                   help="load the model for /v1/embeddings (llama-cpp-python's embedding=True)")


def _serve(args: argparse.Namespace) -> int:
    bad = check_llama_arguments(args, "hybrimoe serve")
    if not bad and not 0 <= args.port <= 65535:
        bad = f"hybrimoe serve: error: --port must be in 0..65535, got {args.port}"
    if not bad and args.api_key is not None and not args.api_key.strip():
        bad = "hybrimoe serve: error: --api-key is empty"
    if bad:
        print(bad, file=sys.stderr)
        return 2
    try:
        from . import serve
    except ImportError as e:  # the server extra is not installed (FastAPI, uvicorn, sse-starlette, ...)
        print(f"hybrimoe serve: error: the server needs llama-cpp-python's server packages ({e}): "
              "pip install 'hybrimoe[server]'", file=sys.stderr)
        return 1
    return serve.main(args)


def _register_optional(sub, name: str, module: str, help_text: str) -> None:
    import importlib

    try:
        mod = importlib.import_module(f"hybrimoe.{module}")
    except ImportError as e:  # keep the rest of the CLI usable
        p = sub.add_parser(name, help=f"{help_text} (unavailable: {e})")
        p.set_defaults(func=lambda a, e=e: (print(f"hybrimoe {name}: unavailable: {e}", file=sys.stderr), 1)[1])
        return
    p = sub.add_parser(name, help=help_text, description=help_text)
    mod.add_arguments(p)
    p.set_defaults(func=mod.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrimoe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="generate text (llama.cpp flags)", description="generate text")
    _add_run_arguments(p)
    p.set_defaults(func=_run)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (llama-cpp-python's) on the hybrid engine",
                       description="OpenAI-compatible HTTP server (llama-cpp-python's routes: /v1/completions, "
                                   "/v1/chat/completions, /v1/embeddings, /v1/models) on hybrimoe.Llama, with the "
                                   "engine's figures at /moe/stats (JSON) and /metrics (Prometheus). One request "
                                   "runs at a time; the others wait.")
    _add_serve_arguments(p)
    p.set_defaults(func=_serve)
    _register_optional(sub, "info", "info", "MoE structure and expert bytes of a GGUF file")
    _register_optional(sub, "make-tiny-model", "tiny", "write a tiny synthetic MoE GGUF (tests, demos)")
    _register_optional(sub, "trace", "record", "record a model's routing (expert ids and router scores per token "
                       "and MoE layer) into a trace file for simulate and --replay-trace")
    _register_optional(sub, "simulate", "simulate", "trace-driven comparison of expert placement policies")
    _register_optional(sub, "synth", "synth", "write a synthetic routing trace of a model shape whose statistics "
                       "(popularity skew, temporal and cross-layer locality) are knobs")
    _register_optional(sub, "calibrate", "calibrate", "measure the engine's cost model for a model on this "
                       "machine (stored for later runs)")
    _register_optional(sub, "bench", "bench", "hybrimoe against upstream offloading at the same GPU memory "
                       "(pp/tg tokens/s, hit rate, bytes copied)")
    return parser


def one_line_warning(message, *args, **kwargs) -> str:
    """``warnings.formatwarning`` of the CLI: ``hybrimoe: warning: MESSAGE``, one line, no source location."""
    return f"hybrimoe: warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    import warnings

    args = build_parser().parse_args(argv)
    # every command prints the library's warnings as one line each in the CLI's style (not Python's file:line form)
    warnings.formatwarning = one_line_warning
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def rpc_server_main() -> None:
    """``ggml-rpc-server``: upstream's RPC server as built by hybrimoe (same flags)."""
    from ._lib import server_env
    from .rpc import SERVER_BIN

    if not SERVER_BIN.exists():
        print(f"ggml-rpc-server: {SERVER_BIN} is missing (hybrimoe not built)", file=sys.stderr)
        sys.exit(1)
    os.execve(str(SERVER_BIN), [str(SERVER_BIN)] + sys.argv[1:], server_env(os.environ))


if __name__ == "__main__":
    sys.exit(main())
