"""OpenAI error objects for every error the server answers: 4xx for what the request got wrong, 500
``server_error`` for a failure of the server (:func:`api_error`)."""
from __future__ import annotations

import re
import sys

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybrimoe.runtime.errors import DeviceLostError

PROG = "hybrimoe serve"
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


def device_lost_error(devices) -> APIError:
    """503 ``device_unavailable``: the model's device is gone, naming it (``devices``: ggml's words for each)."""
    what = "; ".join(devices) if not isinstance(devices, str) else devices
    return APIError(503, f"the model cannot compute any more: its device is gone ({what})",
                    code="device_unavailable")


def api_error(exc: BaseException) -> APIError:
    """The :class:`APIError` that answers ``exc`` (an exception raised while serving a request).

    Request errors (4xx): :class:`APIError` itself; FastAPI's validation errors (bad JSON, a missing or bad field:
    400); Starlette's HTTP exceptions (their status: an unknown path 404, a wrong method 405, llama-cpp-python's
    own 401); ``ValueError`` from the model (llama-cpp-python and hybrimoe raise it for what the request asked:
    a prompt longer than the context, ``context_length_exceeded``; an empty prompt; logprobs without
    ``logits_all``) and a chat template's own error (``jinja2.TemplateError``, e.g. roles that do not alternate):
    400. The model's device gone (:class:`hybrimoe.runtime.errors.DeviceLostError`): 503 ``device_unavailable``,
    naming it. Anything else is the server's failure (the engine failed during a decode): 500 ``server_error``.
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
    if isinstance(exc, DeviceLostError):
        return device_lost_error(exc.devices)
    if isinstance(exc, ValueError):
        m = _CONTEXT_RE.search(str(exc))
        if m:
            return APIError(400, f"the prompt has {m.group(1)} tokens and a request's context holds "
                                 f"{m.group(2)} (hybrimoe serve -c, divided among the --parallel slots): shorten "
                                 "the prompt",
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
