"""The served model: :class:`ServedLlama` (a :class:`hybrimoe.Llama` that publishes its statistics for readers that
do not hold the model lock) and :class:`HybrimoeProxy` (llama-cpp-python's ``LlamaProxy`` over it)."""
from __future__ import annotations

import contextvars
import threading
import time
import uuid

from llama_cpp.server.model import LlamaProxy
from llama_cpp.server.settings import ModelSettings

from hybrimoe.envs import SERVER_GRACE_S
from hybrimoe.runtime.batch import SAMPLING_DEFAULTS, BatchGenerator, BatchScheduler, QueueFull
from hybrimoe.runtime.errors import DeviceLostError
from hybrimoe.runtime.llama import Llama
from hybrimoe.server.errors import APIError

#: seconds a shutdown waits for running requests and decodes (:data:`hybrimoe.envs.SERVER_GRACE_S`)
GRACE_S = SERVER_GRACE_S


#: create_completion's keywords the batch scheduler does not take, with the values that ask nothing of it (their
#: defaults, or what llama-cpp-python's chat handlers pass when a request leaves them out)
_PARALLEL_NEUTRAL = {"suffix": (None, ""), "echo": (False, None), "tfs_z": (1.0, None),
                     "mirostat_mode": (0, None), "mirostat_tau": None, "mirostat_eta": None,
                     "logits_processor": (None,)}


#: the batched requests an HTTP response started, as (scheduler, request): the app sets a list per response
#: (contextvars reach the worker thread that runs create_completion) and cancels what is unfinished when the response
#: ends, its client gone included: a stream's iterator is not closed when its client leaves
REQUEST_HANDLES: "contextvars.ContextVar[list | None]" = contextvars.ContextVar("hybrimoe_request_handles",
                                                                                 default=None)


def cancel_unfinished(handles: list) -> None:
    """Cancels the requests of ``handles`` (:data:`REQUEST_HANDLES`' list) that have not finished."""
    for sched, r in handles:
        if r.finish is None:
            sched.cancel(r)


def _snapshot_of(llm: "ServedLlama", decodes: int, tokens: int) -> dict:
    stats = llm.moe_stats()
    sched = getattr(llm, "_scheduler", None)
    return {"decodes": decodes, "tokens_decoded": tokens, "updated_unix_s": time.time(),
            "engine": stats.get("engine"),
            "hook": {k: v for k, v in stats.items() if k != "engine"} or None,
            "parallel": sched.state() if sched is not None else None}


class ServedLlama(Llama):
    """A :class:`hybrimoe.Llama` that publishes its statistics for readers that do not hold the model lock.

    Why a snapshot: ``moe_stats()`` reads the engine's and the hook's counters, which the decoding threads write
    without a lock of their own (the model lock is the only guard, and ``/moe/stats`` must not wait for it: a
    stream holds it to its end). So the thread that decodes, which holds the model, builds a new dict after every
    :meth:`eval` (one per token in decode, per batch in prefill) and :meth:`embed`, and publishes it with one
    attribute assignment (atomic under the GIL); readers take :attr:`moe_snapshot` and never touch the engine.
    Cost: one ``moe_stats()`` per decode (a few microseconds per MoE layer).

    Also: :meth:`close_when_idle` closes the model once no decode runs, and refuses later decodes (shutdown). A
    decode that finds the model's device gone (:class:`hybrimoe.runtime.errors.DeviceLostError`) sets :attr:`lost`
    and calls ``on_device_lost(error)`` once; every later decode raises the same error without touching the device.
    Responses name the model ``api_name`` (the alias of ``/v1/models``) when a request names none.

    With ``parallel`` > 1 (``hybrimoe serve --parallel N``; the context must hold N sequences, ``n_seq_max``) its
    completions go through a :class:`hybrimoe.runtime.batch.BatchScheduler`: concurrent requests share one decode
    per step (continuous batching), each on its own sequence; ``max_waiting`` bounds the requests waiting for a slot
    (past it: :class:`APIError` 429). A request asking for what the scheduler does not do (echo, a suffix,
    mirostat, a logits processor such as ``min_tokens``) is refused with ValueError (400); a grammar (and so a
    chat's ``response_format`` JSON schema) is served, each request with its own grammar sampler, and so are
    logprobs, streamed or not (each chunk with its token's). With ``parallel`` 1 a request with logprobs on a model
    loaded without ``logits_all`` is generated alone by the batch path on its own thread
    (:meth:`BatchGenerator.stream_alone`; llama-cpp-python's path would refuse it); the others go through
    llama-cpp-python's ``create_completion``.

    Args: ``api_name``: the model's name in the API; the rest as :class:`hybrimoe.Llama`, with the same errors; after
    :meth:`close_when_idle`, ``eval`` raises RuntimeError.
    """

    def __init__(self, *args, api_name: str | None = None, parallel: int = 1, max_waiting: int | None = None,
                 **kwargs):
        self.api_name = api_name
        #: why the model cannot compute any more ("" while it can): its device is gone
        self.lost = ""
        #: called once, with the :class:`DeviceLostError`, from the decoding thread when the device is found gone
        self.on_device_lost = None
        self._lost_error: DeviceLostError | None = None
        self._serving = False  # no snapshot during the constructor (a first-use calibration decodes)
        self._closing = False
        self._decode_lock = threading.Lock()  # held by each decode: closing waits for the running one
        self._decodes = 0
        self._tokens = 0
        self._snapshot: dict = {}
        self._scheduler = None
        super().__init__(*args, **kwargs)
        if parallel > 1:
            self._scheduler = BatchScheduler(self, lock=self._decode_lock, on_step=self._stepped,
                                             on_change=self._publish, max_waiting=max_waiting)
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

    def _check_can_decode(self) -> None:
        if self._closing:
            raise RuntimeError("the server is shutting down")
        e = self._lost_error
        if e is not None:
            raise DeviceLostError(str(e), e.devices, e.endpoints)

    def _device_lost(self, e: DeviceLostError) -> None:
        if self._lost_error is None:
            self._lost_error = e
            self.lost = "; ".join(e.devices)
            if self.on_device_lost is not None:
                self.on_device_lost(e)

    def _stepped(self, gen) -> None:
        # the scheduler's thread, after each batched decode
        self._decodes += 1
        self._tokens += gen.batch_sizes[-1] if gen.batch_sizes else 0
        self._publish()

    def _decode_batch(self, batch) -> None:
        # the scheduler's steps (it holds the decode lock around each)
        self._check_can_decode()
        try:
            super()._decode_batch(batch)
        except DeviceLostError as e:
            self._device_lost(e)
            raise

    def eval(self, tokens, **kwargs):
        with self._decode_lock:
            self._check_can_decode()
            try:
                super().eval(tokens, **kwargs)
            except DeviceLostError as e:
                self._device_lost(e)
                raise
            finally:
                self._decodes += 1
                self._tokens += len(tokens)
                self._publish()

    def embed(self, *args, **kwargs):
        # llama-cpp-python's embed decodes on its own (llama_cpp.Llama.embed), not through eval
        with self._decode_lock:
            self._check_can_decode()
            try:
                return super().embed(*args, **kwargs)
            except DeviceLostError as e:
                self._device_lost(e)
                raise
            finally:
                self._decodes += 1
                self._publish()

    def _batch_asks(self, kwargs: dict) -> list[str]:
        """The keywords of a completion request that the batch scheduler does not serve (with values that ask for
        something)."""
        asked = [k for k, v in kwargs.items() if k not in SAMPLING_DEFAULTS and k != "stream" and
                 _PARALLEL_NEUTRAL.get(k, ()) is not None and v not in _PARALLEL_NEUTRAL.get(k, ())]
        # the server turns min_tokens into a logits processor: name what the request asked
        return ["min_tokens (a logits processor)" if k == "logits_processor" else k for k in asked]

    def create_completion(self, prompt, *args, model: str | None = None, **kwargs):
        # a request without "model": the response names the model as /v1/models does, not by its file
        if self._scheduler is None:
            lp = kwargs.get("logprobs")
            if args or lp is None or lp is False or self._logits_all:
                return super().create_completion(prompt, *args, model=model or self.api_name, **kwargs)
            asked = self._batch_asks(kwargs)
            if asked:
                # llama-cpp-python's path would say "logits_all=False", which is not what the request got wrong
                raise ValueError(f"logprobs cannot go with {', '.join(sorted(asked))} on this server (the model is "
                                 "loaded without logits_all): drop one or the other")
            # logprobs without every row's logits (llama-cpp-python's own path needs logits_all, which would make
            # every prompt compute logits for each of its tokens): the batch path computes them from the row each
            # token is sampled from, stepped alone on this request's thread (the server's model lock is held for
            # the request; no thread of its own, which a client that leaves would strand)
            self._check_can_decode()
            return self._batched(None, prompt, model, dict(kwargs))
        if args:
            raise TypeError("create_completion takes its options by keyword with --parallel")
        self._check_can_decode()
        return self._batched(self._scheduler, prompt, model, kwargs)

    def _batched(self, sched, prompt, model, kwargs: dict):
        """A completion (or its stream of chunks) through the batch scheduler ``sched``, or with ``sched`` None
        through :meth:`BatchGenerator.stream_alone` on the caller's thread."""
        stream = bool(kwargs.pop("stream", False))
        asked = self._batch_asks(kwargs)
        if asked:
            raise ValueError(f"{', '.join(sorted(asked))}: not served with --parallel above 1 (each request's own "
                             "sampling, stop strings, penalties, seed, logit_bias, grammar and logprobs are); "
                             "start the server with --parallel 1 for these"
                             + (" (without logprobs)" if kwargs.get("logprobs") not in (None, False) else ""))
        kw = {k: v for k, v in kwargs.items() if k in SAMPLING_DEFAULTS}
        if kw.get("stop") == []:
            kw["stop"] = None
        name = model or self.api_name
        if sched is None:
            gen = BatchGenerator(self)
            r = gen.request(prompt, **kw)
            items = gen.stream_alone(r, lock=self._decode_lock, on_step=self._stepped)
            if not stream:
                for _ in items:
                    pass
                return gen.completion(r, name)
            return self._chunks(items, name)
        try:
            r = sched.submit(prompt, **kw)
        except QueueFull as e:
            raise APIError(429, f"too many requests: {e}; try again later", type="rate_limit_error",
                           code="too_many_requests") from e
        handles = REQUEST_HANDLES.get()
        if handles is not None:
            handles.append((sched, r))
        if not stream:
            return sched.result(r, name)
        return self._chunks(sched.stream(r), name)

    @staticmethod
    def _chunks(items, name):
        # llama-cpp-python's streamed completion chunks (with logprobs: each chunk's tokens' entries) of a request's
        # stream items; closing this generator early (the client left) closes theirs (BatchScheduler.stream then
        # cancels the request)
        cid, created = f"cmpl-{uuid.uuid4()}", int(time.time())
        for delta, finish, lps in items:
            yield {"id": cid, "object": "text_completion", "created": created, "model": name,
                   "choices": [{"text": delta, "index": 0, "logprobs": lps, "finish_reason": finish}]}

    @property
    def parallel(self) -> int:
        """Sequences decoded together (``--parallel``; 1: one request at a time)."""
        return self._scheduler.n_slots if self._scheduler is not None else 1

    def create_embedding(self, input, model: str | None = None, **kwargs):
        return super().create_embedding(input, model=model or self.api_name, **kwargs)

    def close_when_idle(self, timeout_s: float = GRACE_S) -> bool:
        """Refuses further decodes, waits up to ``timeout_s`` seconds for a running one, then closes the model.
        Returns False (the model left open) when a decode still runs after the wait."""
        self._closing = True
        if self._scheduler is not None:
            self._scheduler.close(timeout_s)
            if self._scheduler.alive():  # a step still runs: the context stays
                return False
        if not self._decode_lock.acquire(timeout=timeout_s):
            return False
        try:
            self.close()
        finally:
            self._decode_lock.release()
        return True


class LoadFailed(Exception):
    """The model could not be loaded (the reason is printed already)."""


class HybrimoeProxy(LlamaProxy):
    """llama-cpp-python's ``LlamaProxy`` (the routes' handle on the model, ``llama_proxy(body.model)``) over one
    :class:`ServedLlama`, loaded at construction by ``load(settings)``.

    Differences: the model comes from ``load`` (``hybrimoe serve``'s flags; llama-cpp-python's loader would build
    a ``llama_cpp.Llama`` from the settings); a model name that is not the alias raises :class:`APIError` 404
    (``model_not_found``) instead of falling back to the default model. ``model=None`` (a request without
    ``model``) is the one model.

    Raises:
        LoadFailed: ``load`` returned None.
    """

    def __init__(self, settings: ModelSettings, load):
        self._load = load
        super().__init__(models=[settings])

    def load_llama_from_model_settings(self, settings: ModelSettings) -> ServedLlama:  # type: ignore[override]
        llm = self._load(settings)
        if llm is None:
            raise LoadFailed(settings.model)
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

    def replace_model(self, llm: ServedLlama) -> None:
        """Serves ``llm`` from now on (a model reloaded after its device came back); the caller closes the old one."""
        self._current_model = llm

    @property
    def alias(self) -> str:
        """The model's name in the API."""
        return self._default_model_alias
