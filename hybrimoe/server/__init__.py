"""The server of ``hybrimoe serve`` (:mod:`hybrimoe.commands.serve`): llama-cpp-python's OpenAI-compatible server on
:class:`hybrimoe.Llama`, with the engine's figures over HTTP. Split by role as ``llama_cpp.server`` is:
:mod:`~hybrimoe.server.errors` (OpenAI error objects), :mod:`~hybrimoe.server.model` (the served model and its
proxy), :mod:`~hybrimoe.server.metrics` (``/moe/stats``, ``/metrics``), :mod:`~hybrimoe.server.app` (the FastAPI
app).

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
  (:class:`ServedLlama`); ``GET /health`` (no API key, no lock): ``{"status": "ok"}`` once the model is loaded,
  503 ``{"status": "error", "reason"}`` once its device is gone (every request then gets 503 naming the device;
  ``hybrimoe serve --on-device-lost`` chooses between exiting and reloading the model).

Import order: :mod:`hybrimoe.runtime.llama` points llama-cpp-python at hybrimoe's libllama before anything here
imports ``llama_cpp.server`` (which imports ``llama_cpp``): a process loads one libllama.
"""
from hybrimoe._lazy import lazy_submodules

__getattr__ = lazy_submodules(__name__, ("errors", "model", "metrics", "app"))
