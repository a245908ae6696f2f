"""The FastAPI app of ``hybrimoe serve``: llama-cpp-python's routes over the served model, hybrimoe's own routes
(``/health``, ``/moe/stats``, ``/metrics``), the API key, and OpenAI error objects for every error."""
from __future__ import annotations

import hmac
import json

import llama_cpp.server.app as lcp_app
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from llama_cpp.server.settings import ServerSettings
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from hybrimoe._version import __version__
from hybrimoe.server.errors import APIError, api_error, device_lost_error
from hybrimoe.server.metrics import json_default, metrics_text, stats_json
from hybrimoe.server.model import REQUEST_HANDLES, HybrimoeProxy, cancel_unfinished


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

        handles: list = []  # the batched requests this stream started (--parallel): cancelled if unfinished at its end
        token = REQUEST_HANDLES.set(handles)
        try:
            await self.inner(scope, receive, send_once_content)
        except Exception as e:  # every failure becomes the error object, never a traceback
            err = api_error(e)
            if not started:
                await err.response()(scope, receive, send)
            elif not ended:
                event = b"data: " + json.dumps(err.body()).encode() + b"\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": False})
            return
        finally:
            REQUEST_HANDLES.reset(token)
            cancel_unfinished(handles)
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
            except Exception as e:  # every failure becomes the error object
                return api_error(e).response()
            if isinstance(response, EventSourceResponse):
                return _HeldStartResponse(response)
            return response

        return route


class AppState:
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
    lost = request.app.state.hybrimoe.proxy.llm.lost
    if lost:  # no request waits for a model that cannot compute
        raise device_lost_error(lost)
    if request.method != "POST":
        return
    try:
        body = json.loads(await request.body() or b"null")
    except ValueError:
        return
    if not isinstance(body, dict):
        return
    state: AppState = request.app.state.hybrimoe
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


async def _unlocked_proxy():
    """llama-cpp-python's ``get_llama_proxy`` without its model lock: with ``--parallel`` above 1 the served model
    takes concurrent requests (its batch scheduler orders the decodes)."""
    yield lcp_app._llama_proxy


def build_app(proxy: HybrimoeProxy, *, api_key: str | None = None, interrupt_requests: bool = False,
              parallel: bool = False) -> FastAPI:
    """The FastAPI app: llama-cpp-python's routes over ``proxy`` (:func:`_openai_router`), ``/moe/stats``,
    ``/metrics``, ``/health``, CORS open to every origin (as llama-cpp-python's ``create_app``: browser front
    ends), and OpenAI error objects for every error (:func:`api_error`).

    llama-cpp-python's routes reach their settings and model through its module's globals
    (``get_server_settings``, ``get_llama_proxy``): this sets both (``set_server_settings``; ``_llama_proxy``,
    which its ``set_llama_proxy`` would fill with a proxy of its own loader). So one app per process. ``parallel``:
    the model serves concurrent requests (``--parallel``): the completion routes do not take llama-cpp-python's
    model lock (its routes name ``get_llama_proxy`` at call time, so the module's function is replaced).
    """
    # model_construct: exactly these values; the settings classes (pydantic BaseSettings) would otherwise also read
    # HOST, PORT, API_KEY, INTERRUPT_REQUESTS... from the environment
    lcp_app.set_server_settings(ServerSettings.model_construct(api_key=api_key,
                                                               interrupt_requests=bool(interrupt_requests)))
    lcp_app._llama_proxy = proxy
    if not hasattr(lcp_app, "_locked_get_llama_proxy"):
        lcp_app._locked_get_llama_proxy = lcp_app.get_llama_proxy
    lcp_app.get_llama_proxy = _unlocked_proxy if parallel else lcp_app._locked_get_llama_proxy
    app = FastAPI(title="hybrimoe serve", version=__version__)
    app.state.hybrimoe = AppState(proxy, api_key)
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
    async def health(request: Request) -> Response:
        # no API key, no model lock: 503 once the model cannot compute any more, so that a supervisor notices
        lost = request.app.state.hybrimoe.proxy.llm.lost
        if lost:
            return JSONResponse({"status": "error", "reason": f"the model's device is gone ({lost})"},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @ours.get("/moe/stats", summary="MoE engine statistics", tags=["hybrimoe"])
    async def moe_stats(request: Request) -> Response:
        _check_api_key(request)
        return Response(json.dumps(stats_json(request.app.state.hybrimoe), default=json_default),
                        media_type="application/json")

    @ours.get("/metrics", summary="Prometheus metrics", tags=["hybrimoe"])
    async def metrics(request: Request) -> PlainTextResponse:
        _check_api_key(request)
        return PlainTextResponse(metrics_text(request.app.state.hybrimoe),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(ours)
    return app
