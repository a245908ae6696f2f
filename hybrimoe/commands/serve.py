"""``hybrimoe serve``: llama-cpp-python's OpenAI-compatible server on :class:`hybrimoe.Llama` (:mod:`hybrimoe.server`),
with the engine's figures at ``/moe/stats`` and ``/metrics``."""
from __future__ import annotations

import argparse
import importlib
import signal
import socket
import sys
import threading
import time

from hybrimoe import _ggml
from hybrimoe.commands.args import PORT, int_in
from hybrimoe.commands.llama_args import add_llama_arguments, load_llama, model_argument
from hybrimoe.envs import SERVER_GRACE_S as GRACE_S

HELP = "OpenAI-compatible HTTP server (llama-cpp-python's) on the hybrid engine"
DESCRIPTION = ("OpenAI-compatible HTTP server (llama-cpp-python's routes: /v1/completions, /v1/chat/completions, "
               "/v1/embeddings, /v1/models) on hybrimoe.Llama, with the engine's figures at /moe/stats (JSON) and "
               "/metrics (Prometheus). One request runs at a time unless --parallel N: then up to N share each "
               "decode (continuous batching) and the others wait.")
PROG = "hybrimoe serve"
ON_DEVICE_LOST = ("exit", "reload")
#: the exit status after the model's device was lost (``--on-device-lost exit``)
DEVICE_LOST_STATUS = 3
#: seconds between checks whether a lost device answers again (``--on-device-lost reload``)
RELOAD_POLL_S = 1.0
#: the packages of llama-cpp-python's server extra (``pip install 'hybrimoe[server]'``): the only ImportErrors
#: reported as a missing extra rather than raised
SERVER_PACKAGES = ("fastapi", "uvicorn", "sse_starlette", "starlette", "starlette_context", "pydantic_settings",
                   "pydantic")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``serve`` flags: the shared llama flags (no sampling: each request brings its own), address, API key,
    the model's name and llama-cpp-python's server options."""
    add_llama_arguments(p, sampling=False)
    # a server's prompts are chats, longer than run's one-line prompts: llama-cpp-python's server default
    p.set_defaults(ctx_size=2048)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=PORT, default=8080, help="TCP port (default: %(default)s; 0: a free one, printed)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: none)")
    p.add_argument("-a", "--alias", default=None, metavar="NAME",
                   help="the model's name in the API (/v1/models, the requests' \"model\"; default: the file's "
                        "name without .gguf); requests naming another model get 404")
    p.add_argument("-np", "--parallel", type=int_in(1, 256), default=1, metavar="N",
                   help="requests decoded together, each on its own sequence of the context (continuous batching, "
                        "llama-server's -np: every step decodes the next token of each and chunks of the prompts "
                        "still prefilling, up to --batch-size tokens); each gets --ctx-size / N tokens of context. "
                        "Default: 1, one request at a time")
    p.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_const", const=True, default=None,
                   help="with --parallel above 1: one KV cache for all the slots (llama.cpp's -kvu), each request "
                        "still held to its slot's share of --ctx-size (rounded up to 256 tokens, as with a cache "
                        "per slot). Default: on where the whole context stays within the model's training context "
                        "(llama-server turns -kvu on only for its automatic slot count, not at -np N): a step "
                        "holding a prompt chunk is then one pass over the experts per --ubatch-size tokens, where "
                        "caches per slot split it per slot (llama.cpp's split_equal) into several")
    p.add_argument("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_const", const=False,
                   help="with --parallel above 1: a KV cache per slot (llama-server's -np N default)")
    p.add_argument("--max-waiting", type=int_in(0), default=16, metavar="N",
                   help="with --parallel above 1: requests waiting for a slot at most; past that a request gets 429 "
                        "(default: %(default)s; each waiting or running request holds one of the server's 40 worker "
                        "threads)")
    p.add_argument("--interrupt-requests", action="store_true",
                   help="cut a running stream short when another request waits (llama-cpp-python's "
                        "interrupt_requests; default: off, every request runs to its end, one at a time)")
    p.add_argument("--chat-format", default=None, metavar="NAME",
                   help="llama-cpp-python chat format (chatml, llama-2, ...; default: the model's own chat "
                        "template, else llama-cpp-python's guess)")
    p.add_argument("--embedding", action="store_true",
                   help="load the model for /v1/embeddings (llama-cpp-python's embedding=True)")
    p.add_argument("--on-device-lost", choices=ON_DEVICE_LOST, default="exit",
                   help="when the model's device is gone (an RPC server died): exit with status 3, after answering "
                        "the request with 503, so that a supervisor restarts the server; or reload the model once "
                        "the device answers again (/health and every request say 503 meanwhile). Default: exit")


def missing_extra(e: ImportError) -> str:
    """The error line for an ImportError of one of the server extra's packages (:data:`SERVER_PACKAGES`), naming it
    and both ways to install it; "" for any other ImportError (a bug, raised as it is)."""
    top = (e.name or "").partition(".")[0]
    if top not in SERVER_PACKAGES:
        return ""
    return (f"{PROG}: error: the server needs llama-cpp-python's server packages ({top} is missing): "
            "pip install 'hybrimoe[server]' (from a clone of hybrimoe: pip install '.[server]', which builds the "
            "package again)")


def run(args: argparse.Namespace) -> int:
    """Runs ``hybrimoe serve``: 0 after SIGTERM, 130 after SIGINT, 1 when the model cannot be loaded, the address
    cannot be bound or the server's packages are missing, 2 for bad flags, 3 after the model's device was lost
    (``--on-device-lost exit``)."""
    if args.api_key is not None and not args.api_key.strip():
        print(f"{PROG}: error: --api-key is empty", file=sys.stderr)
        return 2
    if args.parallel > 1 and (args.embedding or args.interrupt_requests):
        flag = "--embedding" if args.embedding else "--interrupt-requests"
        print(f"{PROG}: error: {flag} works one request at a time: it cannot go with --parallel {args.parallel}",
              file=sys.stderr)
        return 2
    try:
        importlib.import_module("hybrimoe.server.app")  # the server's packages: FastAPI, uvicorn, sse-starlette, ...
    except ImportError as e:
        line = missing_extra(e)
        if not line:
            raise
        print(line, file=sys.stderr)
        return 1
    return serve(args)


def parallel_kv(asked, n_ctx: int, n_slots: int, model) -> tuple[bool, int]:
    """``(kv_unified, n_ctx)`` of the context for ``--parallel n_slots``: ``asked`` (the flag: True, False or None
    for the default). With a cache per slot llama.cpp gives each slot ``n_ctx / n_slots`` cells rounded up to 256
    (``llama_context``'s ``n_ctx_seq``) and grows ``n_ctx`` to match; a unified cache gets that many cells too, so a
    slot holds as many tokens either way. The default is unified unless the whole context exceeds the model's
    training context (the GGUF's ``context_length``): llama.cpp chooses a model's long RoPE factors (Phi-3.5-MoE's)
    by the context one sequence may reach, the whole context when unified, and the slots' share must keep choosing
    as it did. ``n_ctx`` 0 (the model's own) stays 0."""
    if n_ctx <= 0:
        return (asked is not False), n_ctx
    per = -(-n_ctx // n_slots)
    per = -(-per // 256) * 256
    if asked is None:
        train = gguf_context_length(model)
        asked = train is None or per * n_slots <= train
    return asked, per * n_slots


def gguf_context_length(model) -> "int | None":
    """The GGUF's ``<architecture>.context_length`` (the training context), or None where the file has none."""
    from hybrimoe.model.reader import open_gguf

    g = open_gguf(model)
    n = g.field(f"{g.field('general.architecture', '')}.context_length")
    return None if n is None else int(n)


def model_settings(**kw):
    """llama-cpp-python's ``ModelSettings`` with exactly these values (``model_construct``: its settings classes,
    pydantic BaseSettings, would otherwise also read the environment)."""
    from llama_cpp.server.settings import ModelSettings

    return ModelSettings.model_construct(**kw)


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one). Raises OSError (address in use, unknown
    host...)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class DeviceWatch:
    """What the server does once its model's device is gone (``--on-device-lost``): ``exit`` stops it (the request
    that found the loss is answered first) and :func:`serve` returns :data:`DEVICE_LOST_STATUS`; ``reload`` waits,
    in a thread of its own, until every lost RPC server answers a handshake again, then closes the old model and
    loads a new one (``load() -> ServedLlama or None``), which the proxy serves from then on."""

    def __init__(self, mode: str, proxy, load, server):
        self.mode, self.proxy, self.load, self.server = mode, proxy, load, server
        self.exited = False
        self.attach(proxy.llm)

    def attach(self, llm) -> None:
        llm.on_device_lost = self.lost

    def lost(self, error) -> None:
        """Called once per model, from the decoding thread, with the DeviceLostError."""
        what = "; ".join(error.devices)
        if self.mode == "exit":
            print(f"{PROG}: error: the model's device is gone ({what}): the server stops with status "
                  f"{DEVICE_LOST_STATUS} so that a supervisor can restart it (--on-device-lost reload waits for the "
                  "device instead)", file=sys.stderr, flush=True)
            self.exited = True
            self.server.should_exit = True
            return
        print(f"{PROG}: error: the model's device is gone ({what}): requests get 503 until it answers again, then "
              "the model is reloaded", file=sys.stderr, flush=True)
        threading.Thread(target=self._reload, args=(list(error.endpoints),), daemon=True,
                         name="hybrimoe-reload").start()

    def _device_back(self, endpoints: list) -> bool:
        for ep in endpoints:
            host, _, port = ep.rpartition(":")
            try:
                _ggml.check_rpc_server(ep, host.strip("[]"), int(port), timeout=2.0)
            except (ValueError, RuntimeError, OSError):
                return False
        return True

    def _reload(self, endpoints: list) -> None:
        while not self.server.should_exit:
            if not self._device_back(endpoints):
                time.sleep(RELOAD_POLL_S)
                continue
            self.proxy.llm.close_when_idle(GRACE_S)
            llm = self.load(None)
            if llm is None:  # load_llama printed why; try again
                time.sleep(5 * RELOAD_POLL_S)
                continue
            self.attach(llm)
            self.proxy.replace_model(llm)
            print(f"{PROG}: the device answers again: model reloaded", file=sys.stderr, flush=True)
            return


def _serve_until_stopped(server, sock) -> list:
    """Runs uvicorn on ``sock`` until SIGTERM, SIGINT or a stop request; returns the signals received.

    uvicorn handles SIGTERM/SIGINT while it serves (graceful shutdown) and, since 0.29, raises the signal again once
    it stopped (uvicorn.Server.capture_signals), with the handler found before it: with the default one SIGTERM
    would kill the process with -15 after a clean stop. The handler set here notes the signal instead."""
    got: list[int] = []

    def note(signum, frame):
        got.append(signum)

    old = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        got.append(signal.SIGINT)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        sock.close()
    return got


def serve(args: argparse.Namespace) -> int:
    """``hybrimoe serve`` once its flags are checked and the server's packages import: loads the model and its
    engine, listens, prints ``hybrimoe serve: <model> ready at http://HOST:PORT/v1 ...`` (stdout, once both are
    ready), serves until SIGTERM or SIGINT (or the model's device is lost: :class:`DeviceWatch`), then closes the
    model. Returns 0 after SIGTERM, 130 after SIGINT, 3 after a lost device, 1 when the model cannot be loaded or the
    address cannot be bound, 2 for a bad ``--chat-format``."""
    import uvicorn
    from llama_cpp import llama_chat_format

    from hybrimoe.server.app import build_app
    from hybrimoe.server.model import HybrimoeProxy, LoadFailed, ServedLlama

    if args.chat_format is not None:
        try:
            llama_chat_format.get_chat_completion_handler(args.chat_format)
        except Exception as e:  # llama-cpp-python's not-found exception is no ValueError
            print(f"{PROG}: error: --chat-format: {e}", file=sys.stderr)
            return 2
    model = model_argument(args, PROG)
    if model is None:
        return 1
    alias = args.alias or (model.name[:-len(".gguf")] if model.name.endswith(".gguf") else model.name)

    def load(settings):
        more, flags = {}, args
        if args.parallel > 1:
            unified, n_ctx = parallel_kv(args.kv_unified, args.ctx_size, args.parallel, model)
            more = dict(parallel=args.parallel, max_waiting=args.max_waiting, n_seq_max=args.parallel,
                        kv_unified=unified)
            flags = argparse.Namespace(**dict(vars(args), ctx_size=n_ctx))
        return load_llama(flags, model, PROG, llama_class=ServedLlama, chat_format=args.chat_format,
                          embedding=args.embedding, api_name=alias, **more)

    settings = model_settings(model=str(model), model_alias=alias, chat_format=args.chat_format,
                              embedding=args.embedding, n_ctx=args.ctx_size, verbose=args.verbose)
    try:
        proxy = HybrimoeProxy(settings, load)
    except LoadFailed:
        return 1
    try:
        try:
            sock = _listen(args.host, args.port)
        except OSError as e:
            print(f"{PROG}: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
            return 1
        app = build_app(proxy, api_key=args.api_key, interrupt_requests=args.interrupt_requests,
                        parallel=args.parallel > 1)
        server = uvicorn.Server(uvicorn.Config(app, log_level="info" if args.verbose else "warning",
                                               timeout_graceful_shutdown=int(GRACE_S)))
        watch = DeviceWatch(args.on_device_lost, proxy, load, server)
        e = proxy.llm.moe_snapshot.get("engine")
        engine = (f"hybrid engine {e['policy']}, {e['n_slots']} GPU expert slots" if e else
                  "no hybrid engine (it runs with --moe-cache on a GPU or --rpc, or with --moe-ram-cache)")
        how = (f"up to {args.parallel} requests per decode" if args.parallel > 1 else
               "one request at a time" + (", a waiting request interrupts a stream" if args.interrupt_requests
                                           else ""))
        print(f"{PROG}: {alias} ready at {_url(sock)}/v1 ({engine}; {how})", flush=True)
        got = _serve_until_stopped(server, sock)
        if signal.SIGINT in got:
            return 130
        return DEVICE_LOST_STATUS if watch.exited else 0
    finally:
        if not proxy.llm.close_when_idle(GRACE_S):
            print(f"{PROG}: warning: a decode still ran after {GRACE_S:.0f} s; the model was left to the exit",
                  file=sys.stderr)
