"""``hybrimoe serve``: llama-cpp-python's OpenAI-compatible server on :class:`hybrimoe.Llama`, with the engine's
figures over HTTP.

Used as llama-cpp-python 0.3.36 ships it (``llama_cpp.server``): its routes (``llama_cpp.server.app.router``:
``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``, ``GET /v1/models``, ``/extras/*``), their
request types and generation code, its model lock (``llama_cpp.server.app.get_llama_proxy``: one request on the
model at a time, the others wait), its ``interrupt_requests`` and its API-key check (``authenticate``), configured
through its ``ServerSettings``. Not used: ``create_app`` and ``LlamaProxy``'s loader, which build a
``llama_cpp.Llama`` (upstream's placement, no engine) the moment they are called.

hybrimoe's own parts:

- the model: :class:`HybrimoeProxy`, a ``LlamaProxy`` whose loader builds a :class:`ServedLlama` (a
  ``hybrimoe.Llama``) from ``hybrimoe serve``'s flags, and which answers 404 to a request naming another model
  (llama-cpp-python's proxy silently uses its default one);
- errors: every error is OpenAI's object ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for
  what the request got wrong (bad JSON or field 400, wrong or missing API key 401, unknown model 404, prompt longer
  than the context 400, embeddings from a model not loaded for them 400) and 500 ``server_error`` for a failure of
  the server (the engine failed); never a traceback in a response, and the server keeps serving. A streamed
  request's errors before its first chunk get the same status and object (the response's start is held back until
  there is content, :class:`_HeldStartResponse`); after it, the stream ends with one ``data: {"error": ...}``
  event;
- ``GET /moe/stats`` (JSON) and ``GET /metrics`` (Prometheus text format 0.0.4): the engine's counters, read from
  a snapshot that the decoding thread publishes after every decode, so that neither waits for the model lock
  (:class:`ServedLlama`); ``GET /health`` (no API key, no lock): ``{"status": "ok"}`` once the model is loaded.

Import order: ``hybrimoe.llama`` points llama-cpp-python at hybrimoe's libllama before anything here imports
``llama_cpp.server`` (which imports ``llama_cpp``): a process loads one libllama.
"""
from __future__ import annotations

import argparse
import hmac
import json
import math
import re
import signal
import socket
import sys
import threading
import time

from .llama import Llama  # first: hybrimoe's libllama under llama_cpp (see the module docstring)

import llama_cpp.server.app as lcp_app  # noqa: E402
from fastapi import APIRouter, Depends, FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.middleware.cors import CORSMiddleware  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse  # noqa: E402
from fastapi.routing import APIRoute  # noqa: E402
from llama_cpp.server.model import LlamaProxy  # noqa: E402
from llama_cpp.server.settings import ModelSettings, ServerSettings  # noqa: E402
from sse_starlette.sse import EventSourceResponse  # noqa: E402
from starlette.exceptions import HTTPException as StarletteHTTPException  # noqa: E402
from starlette.responses import Response  # noqa: E402

PROG = "hybrimoe serve"
#: seconds that SIGTERM/SIGINT leave running requests to finish before they are cancelled (uvicorn's
#: ``timeout_graceful_shutdown``; streams end at once: sse-starlette ends them when uvicorn starts to shut down), and
#: that closing the model then waits for a decode still running
GRACE_S = 10.0

# llama-cpp-python's message for a prompt that does not fit (llama_cpp.Llama._create_completion)
_CONTEXT_RE = re.compile(r"Requested tokens \((\d+)\) exceed context window of (\d+)")


class APIError(Exception):
    """An error answered with OpenAI's error object.

    Args:
        status: HTTP status (400, 401, 404, 500, ...).
        message: what went wrong, for the user.
        type: OpenAI's error type: ``invalid_request_error`` (4xx) or ``server_error`` (5xx) by default.
        code: OpenAI's machine-readable code (``model_not_found``, ``context_length_exceeded``,
            ``invalid_api_key``, ...) or None.
        param: the request field at fault, or None.
    """

    def __init__(self, status: int, message: str, type: str | None = None, code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type or ("server_error" if self.status >= 500 else "invalid_request_error")
        self.code = code
        self.param = param

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _leaf(exc: BaseException) -> BaseException:
    """The first non-group exception of an (anyio task group's) exception group, else ``exc``."""
    # (BaseExceptionGroup is a builtin from Python 3.11 on; anyio brings the backport on 3.10)
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line for the first problem of a request that FastAPI could not parse or validate, and its field."""
    errors = exc.errors()
    if not errors:
        return "the request is invalid", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        why = (e.get("ctx") or {}).get("error", "JSON decode error")
        where = f" at character {loc[0]}" if loc else ""
        return f"the request body is not valid JSON: {why}{where}", None
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    if param is None:
        return f"the request body is invalid: {msg}{more}", None
    return f"{param}: {msg}, got {e.get('input')!r}{more}", param


def api_error(exc: BaseException) -> APIError:
    """The :class:`APIError` that answers ``exc`` (an exception raised while serving a request).

    Request errors (4xx): :class:`APIError` itself; FastAPI's validation errors (bad JSON, a missing or bad field:
    400); Starlette's HTTP exceptions (their status: an unknown path 404, a wrong method 405, llama-cpp-python's
    own 401); ``ValueError`` from the model (llama-cpp-python and hybrimoe raise it for what the request asked:
    a prompt longer than the context, ``context_length_exceeded``; an empty prompt; logprobs without
    ``logits_all``) and a chat template's own error (``jinja2.TemplateError``, e.g. roles that do not alternate):
    400. Anything else is the server's failure (the engine failed during a decode): 500 ``server_error``.
    """
    exc = _leaf(exc)
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        message, param = _validation_message(exc)
        return APIError(400, message, code="invalid_request" if param is None else "invalid_value", param=param)
    if isinstance(exc, StarletteHTTPException):
        codes = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}
        return APIError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code))
    if isinstance(exc, ValueError):
        m = _CONTEXT_RE.search(str(exc))
        if m:
            return APIError(400, f"the prompt has {m.group(1)} tokens and this model's context holds "
                                 f"{m.group(2)} (hybrimoe serve -c): shorten the prompt",
                            code="context_length_exceeded", param="prompt")
        return APIError(400, str(exc))
    try:
        import jinja2

        if isinstance(exc, jinja2.TemplateError):
            return APIError(400, f"the chat template refused the messages: {exc}", param="messages")
    except ImportError:  # jinja2 comes with llama-cpp-python; without it there are no templates to fail
        pass
    print(f"{PROG}: error: request failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return APIError(500, f"the server failed: {type(exc).__name__}: {exc}")


class _HeldStartResponse(Response):
    """A streamed (server-sent events) response whose ``http.response.start`` is held back until its first
    content, so that an error before it (a prompt longer than the context, an unknown model, detected by
    llama-cpp-python's ``get_event_publisher`` once it holds the model lock) is answered with its own status and
    error object rather than a 200 and a broken stream. Empty body messages are held with the start: the stream
    may close its channel (an empty end) before the error that closed it reaches this wrapper. An error after the
    first content ends the stream with one ``data: {"error": ...}`` event.

    Args:
        inner: llama-cpp-python's ``EventSourceResponse``.
    """

    def __init__(self, inner: Response):
        self.inner = inner
        self.status_code = inner.status_code
        self.background = None
        self.raw_headers = inner.raw_headers

    async def __call__(self, scope, receive, send) -> None:
        held: list[dict] = []
        started = False  # content went out (and the held start with it)
        ended = False  # the last body message went out

        async def send_once_content(message: dict) -> None:
            nonlocal started, ended
            if not started:
                if message["type"] == "http.response.start" or not message.get("body"):
                    held.append(message)
                    return
                started = True
                for m in held:
                    await send(m)
                held.clear()
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.inner(scope, receive, send_once_content)
        except Exception as e:  # noqa: BLE001 - every failure becomes the error object, never a traceback
            err = api_error(e)
            if not started:
                await err.response()(scope, receive, send)
            elif not ended:
                event = b"data: " + json.dumps(err.body()).encode() + b"\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": False})
            return
        for m in held:  # a stream that ended without content (its client left while it waited)
            await send(m)


class _OpenAIRoute(APIRoute):
    """A route whose failures are OpenAI error objects (:func:`api_error`) and whose streamed responses hold their
    start until their first content (:class:`_HeldStartResponse`). In place of llama-cpp-python's
    ``RouteErrorHandler``, which answers a bad field with a 500 and a body that is not JSON with an exception of
    its own."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                response = await handler(request)
            except Exception as e:  # noqa: BLE001
                return api_error(e).response()
            if isinstance(response, EventSourceResponse):
                return _HeldStartResponse(response)
            return response

        return route


def _snapshot_of(llm: "ServedLlama", decodes: int, tokens: int) -> dict:
    stats = llm.moe_stats()
    return {"decodes": decodes, "tokens_decoded": tokens, "updated_unix_s": time.time(),
            "engine": stats.get("engine"),
            "hook": {k: v for k, v in stats.items() if k != "engine"} or None}


class ServedLlama(Llama):
    """A :class:`hybrimoe.Llama` that publishes its statistics for readers that do not hold the model lock.

    Why a snapshot: ``moe_stats()`` reads the engine's and the hook's counters, which the decoding threads write
    without a lock of their own (the model lock is the only guard, and ``/moe/stats`` must not wait for it: a
    stream holds it to its end). So the thread that decodes, which holds the model, builds a new dict after every
    :meth:`eval` (one per token in decode, per batch in prefill) and :meth:`embed`, and publishes it with one
    attribute assignment (atomic under the GIL); readers take :attr:`moe_snapshot` and never touch the engine.
    Cost: one ``moe_stats()`` per decode (a few microseconds per MoE layer).

    Also: :meth:`close_when_idle` closes the model once no decode runs, and refuses later decodes (shutdown).
    Same arguments and errors as :class:`hybrimoe.Llama`; after :meth:`close_when_idle`, ``eval`` raises
    RuntimeError.
    """

    def __init__(self, *args, **kwargs):
        self._serving = False  # no snapshot during the constructor (a first-use calibration decodes)
        self._closing = False
        self._decode_lock = threading.Lock()  # held by each decode: closing waits for the running one
        self._decodes = 0
        self._tokens = 0
        self._snapshot: dict = {}
        super().__init__(*args, **kwargs)
        self._snapshot = _snapshot_of(self, 0, 0)
        self._serving = True

    @property
    def moe_snapshot(self) -> dict:
        """The statistics as of the last decode: ``decodes`` (evals since the server started), ``tokens_decoded``,
        ``updated_unix_s`` (seconds since the epoch), ``engine`` (``moe_stats()["engine"]``, None without
        ``--moe-cache``) and ``hook`` (the hook's per-layer counters, None without hook or engine). Never waits."""
        return self._snapshot

    def _publish(self) -> None:
        if self._serving:
            self._snapshot = _snapshot_of(self, self._decodes, self._tokens)

    def eval(self, tokens, **kwargs):
        with self._decode_lock:
            if self._closing:
                raise RuntimeError("the server is shutting down")
            try:
                super().eval(tokens, **kwargs)
            finally:
                self._decodes += 1
                self._tokens += len(tokens)
                self._publish()

    def embed(self, *args, **kwargs):
        # llama-cpp-python's embed decodes on its own (llama_cpp.Llama.embed), not through eval
        with self._decode_lock:
            if self._closing:
                raise RuntimeError("the server is shutting down")
            try:
                return super().embed(*args, **kwargs)
            finally:
                self._decodes += 1
                self._publish()

    def close_when_idle(self, timeout_s: float = GRACE_S) -> bool:
        """Refuses further decodes, waits up to ``timeout_s`` seconds for a running one, then closes the model.
        Returns False (the model left open) when a decode still runs after the wait."""
        self._closing = True
        if not self._decode_lock.acquire(timeout=timeout_s):
            return False
        try:
            self.close()
        finally:
            self._decode_lock.release()
        return True


class _LoadFailed(Exception):
    """The model could not be loaded (the reason is printed already)."""


class HybrimoeProxy(LlamaProxy):
    """llama-cpp-python's ``LlamaProxy`` (the routes' handle on the model, ``llama_proxy(body.model)``) over one
    :class:`ServedLlama`, loaded at construction by ``load(settings)``.

    Differences: the model comes from ``load`` (``hybrimoe serve``'s flags; llama-cpp-python's loader would build
    a ``llama_cpp.Llama`` from the settings); a model name that is not the alias raises :class:`APIError` 404
    (``model_not_found``) instead of falling back to the default model. ``model=None`` (a request without
    ``model``) is the one model.

    Raises:
        _LoadFailed: ``load`` returned None.
    """

    def __init__(self, settings: ModelSettings, load):
        self._load = load
        super().__init__(models=[settings])

    def load_llama_from_model_settings(self, settings: ModelSettings) -> ServedLlama:  # type: ignore[override]
        llm = self._load(settings)
        if llm is None:
            raise _LoadFailed(settings.model)
        return llm

    def check_model(self, model) -> None:
        """Raises :class:`APIError` 404 unless ``model`` is None or this server's model name."""
        if model is not None and model not in self._model_settings_dict:
            names = ", ".join(repr(m) for m in self)
            raise APIError(404, f"the model {model!r} does not exist: this server serves {names} (GET /v1/models)",
                           code="model_not_found", param="model")

    def __call__(self, model: str | None = None) -> ServedLlama:
        self.check_model(model)
        return super().__call__(model)

    @property
    def llm(self) -> ServedLlama:
        """The model (the one loaded)."""
        return self._current_model

    @property
    def alias(self) -> str:
        """The model's name in the API."""
        return self._default_model_alias


class _State:
    """What hybrimoe's parts of the app need: the proxy (model) and the API key (None: none)."""

    def __init__(self, proxy: HybrimoeProxy, api_key: str | None):
        self.proxy = proxy
        self.api_key = api_key


def _check_api_key(request: Request) -> None:
    """Raises :class:`APIError` 401 when the server has an API key and the request lacks it or sends another
    (``Authorization: Bearer KEY``, as OpenAI's clients send it). Runs before llama-cpp-python's own check
    (``authenticate``, which then passes), to say which of the two went wrong."""
    key = request.app.state.hybrimoe.api_key
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    if not auth.strip():
        raise APIError(401, "this server needs an API key: send the header 'Authorization: Bearer KEY' "
                            "(openai client: api_key=KEY)", code="invalid_api_key")
    scheme, _, token = auth.strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")


async def _preflight(request: Request) -> None:
    """Checks that need no model lock, before a route waits for it (a FastAPI dependency of every route of
    llama-cpp-python's router): the API key; then, for a JSON object body, the model name (404), embeddings from a
    model not loaded for them (400) and more than one completion prompt (400; llama-cpp-python asserts). A body
    that is not JSON or has bad fields is left to the route's own validation (FastAPI: 400 from
    :func:`api_error`)."""
    _check_api_key(request)
    if request.method != "POST":
        return
    try:
        body = json.loads(await request.body() or b"null")
    except ValueError:
        return
    if not isinstance(body, dict):
        return
    state: _State = request.app.state.hybrimoe
    model = body.get("model")
    if isinstance(model, str):
        state.proxy.check_model(model)
    path = request.url.path
    if path.endswith("/embeddings") and not state.proxy.llm.context_params.embeddings:
        raise APIError(400, "this server's model was not loaded for embeddings: start it with "
                            "hybrimoe serve --embedding", code="embeddings_not_enabled", param="model")
    prompt = body.get("prompt")
    if path.endswith("/completions") and isinstance(prompt, list) and len(prompt) > 1:
        raise APIError(400, f"one prompt per request, got a list of {len(prompt)}", code="invalid_value",
                       param="prompt")


def _openai_router() -> APIRouter:
    """llama-cpp-python's routes (``llama_cpp.server.app.router``: same paths, endpoints, dependencies and
    documentation) under :class:`_OpenAIRoute` and :func:`_preflight`. Left out: its Copilot alias
    ``/v1/engines/copilot-codex/completions``, which names a model of its own (``copilot-codex``) that the 404
    rule would refuse."""
    router = APIRouter(route_class=_OpenAIRoute, dependencies=[Depends(_preflight)])
    for route in lcp_app.router.routes:
        if not isinstance(route, APIRoute) or "copilot-codex" in route.path:
            continue
        router.add_api_route(route.path, route.endpoint, methods=sorted(route.methods),
                             dependencies=list(route.dependencies), response_model=route.response_model,
                             summary=route.summary, description=route.description, tags=route.tags,
                             responses=route.responses, include_in_schema=route.include_in_schema, name=route.name)
    return router


def stats_json(state: _State) -> dict:
    """``GET /moe/stats``: ``model`` (its name), ``model_busy`` (a request holds the model lock now: read without
    taking it), then :attr:`ServedLlama.moe_snapshot` (the figures as of the last decode)."""
    return {"object": "moe.stats", "model": state.proxy.alias, "model_busy": lcp_app.llama_inner_lock.locked(),
            **state.proxy.llm.moe_snapshot}


def _label(value: str) -> str:
    # Prometheus text format: label values escape backslash, double quote and line feed
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics_text(state: _State) -> str:
    """``GET /metrics``: the snapshot's figures in Prometheus' text format (0.0.4), labelled with the model.

    Counters (``_total``, since the server started): decodes, tokens decoded, cache accesses / hits / misses /
    evictions, experts run per side (``side="cpu"|"gpu"``, distinct experts per layer and ubatch), H2D bytes per
    kind (``kind="demand"|"prefetch"|"fill"``). Gauges: the model lock held, the hit rate, the mean seconds per MoE
    layer run, the GPU expert slots and their bytes. Engine figures only with ``--moe-cache``."""
    snap = stats_json(state)
    model = f'model="{_label(state.proxy.alias)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP hybrimoe_{name} {help_text}")
        lines.append(f"# TYPE hybrimoe_{name} {kind}")
        for labels, value in samples:
            v = float(value)
            text = "NaN" if math.isnan(v) else repr(v) if not v.is_integer() else str(int(v))
            lines.append(f"hybrimoe_{name}{{{model}{labels}}} {text}")

    metric("decodes_total", "counter", "Model decodes (one per generated token, per batch of a prompt).",
           [("", snap["decodes"])])
    metric("tokens_decoded_total", "counter", "Tokens decoded (prompt and generated).", [("", snap["tokens_decoded"])])
    metric("model_busy", "gauge", "1 while a request holds the model.", [("", 1 if snap["model_busy"] else 0)])
    e = snap.get("engine")
    if e:
        c = e["cache"]
        metric("cache_accesses_total", "counter", "Activated experts looked up in the GPU expert cache.",
               [("", c["accesses"])])
        metric("cache_hits_total", "counter", "Activated experts resident on the GPU when their layer ran.",
               [("", c["hits"])])
        metric("cache_misses_total", "counter", "Activated experts not resident when their layer ran.",
               [("", c["misses"])])
        metric("cache_evictions_total", "counter", "Experts evicted from the GPU expert cache.", [("", c["evictions"])])
        metric("cache_hit_rate", "gauge", "Hits / accesses since the server started.", [("", e["hit_rate"])])
        metric("experts_total", "counter", "Experts run, distinct per MoE layer and ubatch, by side.",
               [(',side="cpu"', e["cpu_experts"]), (',side="gpu"', e["gpu_experts"])])
        metric("h2d_bytes_total", "counter", "Expert bytes copied host to device, by kind.",
               [(',kind="demand"', e["bytes_demand"]), (',kind="prefetch"', e["bytes_prefetch"]),
                (',kind="fill"', e["bytes_fill"])])
        metric("moe_layer_seconds", "gauge", "Mean seconds per MoE layer run (plan to GPU share done).",
               [("", e["layer_s"])])
        metric("gpu_expert_slots", "gauge", "Expert slots of the GPU expert cache.", [("", e["n_slots"])])
        metric("gpu_expert_slot_bytes", "gauge", "Bytes per expert slot.", [("", e["slot_bytes"])])
    return "\n".join(lines) + "\n"


def _json_default(obj):
    # numpy scalars and arrays in the engine's per-layer counters
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def build_app(proxy: HybrimoeProxy, *, api_key: str | None = None, interrupt_requests: bool = False) -> FastAPI:
    """The FastAPI app: llama-cpp-python's routes over ``proxy`` (:func:`_openai_router`), ``/moe/stats``,
    ``/metrics``, ``/health``, CORS open to every origin (as llama-cpp-python's ``create_app``: browser front
    ends), and OpenAI error objects for every error (:func:`api_error`).

    llama-cpp-python's routes reach their settings and model through its module's globals
    (``get_server_settings``, ``get_llama_proxy``): this sets both (``set_server_settings``; ``_llama_proxy``,
    which its ``set_llama_proxy`` would fill with a proxy of its own loader). So one app per process.
    """
    # model_construct: exactly these values; the settings classes (pydantic BaseSettings) would otherwise also read
    # HOST, PORT, API_KEY, INTERRUPT_REQUESTS... from the environment
    lcp_app.set_server_settings(ServerSettings.model_construct(api_key=api_key,
                                                               interrupt_requests=bool(interrupt_requests)))
    lcp_app._llama_proxy = proxy
    app = FastAPI(title="hybrimoe serve", version=__import__("hybrimoe").__version__)
    app.state.hybrimoe = _State(proxy, api_key)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"],
                       allow_headers=["*"])

    async def http_error(request: Request, exc: Exception):
        err = api_error(exc)
        if err.status in (404, 405) and not isinstance(exc, APIError):  # Starlette's routing: say what was asked
            err.message = (f"no endpoint {request.method} {request.url.path} (the API is under /v1: "
                           "/v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models)")
        return err.response()

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, http_error)
    app.add_exception_handler(APIError, http_error)
    app.include_router(_openai_router())

    ours = APIRouter(route_class=_OpenAIRoute)

    @ours.get("/health", summary="Health", tags=["hybrimoe"])
    async def health() -> dict:
        return {"status": "ok"}

    @ours.get("/moe/stats", summary="MoE engine statistics", tags=["hybrimoe"])
    async def moe_stats(request: Request) -> Response:
        _check_api_key(request)
        return Response(json.dumps(stats_json(request.app.state.hybrimoe), default=_json_default),
                        media_type="application/json")

    @ours.get("/metrics", summary="Prometheus metrics", tags=["hybrimoe"])
    async def metrics(request: Request) -> PlainTextResponse:
        _check_api_key(request)
        return PlainTextResponse(metrics_text(request.app.state.hybrimoe),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(ours)
    return app


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


def main(args: argparse.Namespace) -> int:
    """``hybrimoe serve`` after its flags were checked (``hybrimoe.cli``): loads the model and its engine, listens,
    prints ``hybrimoe serve: <model> ready at http://HOST:PORT/v1 ...`` (stdout, once both are ready), serves
    until SIGTERM or SIGINT, then closes the model. Returns 0 after SIGTERM, 130 after SIGINT, 1 when the model
    cannot be loaded or the address cannot be bound, 2 for a bad ``--chat-format``."""
    import uvicorn

    from . import cli

    if args.chat_format is not None:
        from llama_cpp import llama_chat_format

        try:
            llama_chat_format.get_chat_completion_handler(args.chat_format)
        except Exception as e:  # noqa: BLE001 - llama-cpp-python's not-found exception is no ValueError
            print(f"{PROG}: error: --chat-format: {e}", file=sys.stderr)
            return 2
    model = cli.model_argument(args, PROG)
    if model is None:
        return 1
    alias = args.alias or (model.name[:-len(".gguf")] if model.name.endswith(".gguf") else model.name)

    def load(settings: ModelSettings):
        return cli.load_llama(args, model, PROG, llama_class=ServedLlama, chat_format=args.chat_format,
                              embedding=args.embedding)

    settings = ModelSettings.model_construct(model=str(model), model_alias=alias, chat_format=args.chat_format,
                                             embedding=args.embedding, n_ctx=args.ctx_size, verbose=args.verbose)
    try:
        proxy = HybrimoeProxy(settings, load)
    except _LoadFailed:
        return 1
    llm = proxy.llm
    try:
        try:
            sock = _listen(args.host, args.port)
        except OSError as e:
            print(f"{PROG}: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
            return 1
        app = build_app(proxy, api_key=args.api_key, interrupt_requests=args.interrupt_requests)
        config = uvicorn.Config(app, log_level="info" if args.verbose else "warning",
                                timeout_graceful_shutdown=int(GRACE_S))
        server = uvicorn.Server(config)
        got: list[int] = []

        def note(signum, frame):
            got.append(signum)

        # uvicorn handles SIGTERM/SIGINT while it serves (graceful shutdown) and, since 0.29, raises the signal
        # again once it stopped (uvicorn.Server.capture_signals), with the handler found before it: with the
        # default one SIGTERM would kill the process with -15 after a clean stop. This handler notes it instead.
        old = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
        e = llm.moe_snapshot.get("engine")
        engine = (f"hybrid engine {e['policy']}, {e['n_slots']} GPU expert slots" if e else
                  "no hybrid engine (--moe-cache)")
        print(f"{PROG}: {alias} ready at {_url(sock)}/v1 ({engine}; one request at a time"
              f"{', a waiting request interrupts a stream' if args.interrupt_requests else ''})", flush=True)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            got.append(signal.SIGINT)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            sock.close()
        return 130 if signal.SIGINT in got else 0
    finally:
        if not llm.close_when_idle(GRACE_S):
            print(f"{PROG}: warning: a decode still ran after {GRACE_S:.0f} s; the model was left to the exit",
                  file=sys.stderr)
