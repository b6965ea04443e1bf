"""The OpenAI-compatible HTTP app of ``specpilot serve`` (FastAPI; uvicorn runs it).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed
as server-sent events with ``"stream": true``, OpenAI's chunk objects and ``data: [DONE]``;
``stream_options.include_usage`` adds the usage chunk), ``GET /health``, ``GET /metrics``
(Prometheus text). A request is tokenized here (chat: the deployment's chat template with the
benchmarks' template arguments, :func:`specpilot.prompts.format_prompt`, then the tokenizer
without special tokens: the ids a prompt file holds for the same message), submitted to the
engine's :class:`~specpilot.engine.online.OnlineScheduler`, and its text is produced as the engine
commits tokens (:class:`~specpilot.server.text.TextStream`, in the engine thread, so that a stop
string ends the request at the step that completed it). A client that disconnects cancels its
request (its slot is refilled); a full queue answers 429. Every refusal is OpenAI's error object
naming the field (:mod:`specpilot.server.protocol`); a body whose text cannot be decoded is refused
before it is parsed (:class:`TextCheckedRoute`).
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.online import QueueFull, Submission
from ..errors import SpecpilotError
from ..prompts import CHAT_TEMPLATE_KWARGS, format_prompt
from .engine import RecordWriter, ServedEngine
from .protocol import (ApiError, ChatBody, CompletionBody, check_body_text, check_sampling, encode_text, message_text,
                       stop_strings, token_budget)
from .text import TextStream


class TextCheckedRoute(APIRoute):
    """A POST route whose raw body is checked as text (:func:`check_body_text`: UTF-8, no lone
    surrogates, no unescaped control characters) before FastAPI parses it, so that such a body is a
    400 naming the field instead of the parser's unnamed error or a tokenizer's exception (FastAPI's
    custom route class; the body read here is the one the route parses)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request):
            if request.method == "POST":
                check_body_text(await request.body())
            return await handler(request)

        return checked


class Job:
    """One request in flight: the engine thread's callbacks feed its text and end it; the event
    loop reads ``queue`` (text deltas, then None) and ``done``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, text: TextStream, on_done=None):
        self.loop, self.text, self.on_done = loop, text, on_done
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = asyncio.Event()
        self.result = self.reason = None

    def _call(self, fn, *args) -> None:
        """Run ``fn(*args)`` in the event loop (dropped once the loop is closed: the server stopped)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def on_tokens(self, ids: list[int]) -> bool:
        """Engine thread: one step's tokens; True when a stop string ends the response."""
        delta, stopped = self.text.feed(ids)
        if delta:
            self._call(self.queue.put_nowait, delta)
        return stopped

    def on_finish(self, result, reason: str) -> None:
        """Engine thread: the request ended (``reason`` of :data:`specpilot.engine.online.REASONS`)."""
        tail = self.text.flush() if reason != "error" else ""
        if tail:
            self._call(self.queue.put_nowait, tail)
        self._call(self._finish, result, reason)

    def _finish(self, result, reason: str) -> None:
        self.result, self.reason = result, reason
        self.queue.put_nowait(None)
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish_reason: ``length`` (the budget) or ``stop`` (EOS or a stop string)."""
        return "length" if self.reason == "length" else "stop"

    @property
    def completion_tokens(self) -> int:
        """Output tokens the response covers (up to the one completing a stop string)."""
        if self.text.stop_tokens is not None:
            return self.text.stop_tokens
        return len(self.result.output_ids) if self.result is not None else 0


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def metrics_text(engine: ServedEngine) -> str:
    """Prometheus text exposition of the engine's counters and load."""
    c = engine.scheduler.counters
    waiting, running = engine.scheduler.load()
    lines = []

    def metric(name: str, kind: str, help_: str, values: dict[str, float] | float) -> None:
        lines.extend([f"# HELP specpilot_{name} {help_}", f"# TYPE specpilot_{name} {kind}"])
        for labels, v in (values.items() if isinstance(values, dict) else [("", values)]):
            lines.append(f"specpilot_{name}{labels} {v}")

    metric("requests_total", "counter", "requests finished, by reason",
           {f'{{reason="{k}"}}': v for k, v in c.finished.items()})
    metric("requests_submitted_total", "counter", "requests accepted into the queue", c.submitted)
    metric("requests_rejected_total", "counter", "requests refused with 429 (queue full)", c.rejected)
    metric("prompt_tokens_total", "counter", "prompt tokens of accepted requests", c.prompt_tokens)
    metric("generation_tokens_total", "counter", "output tokens of finished requests", c.output_tokens)
    metric("verify_steps_total", "counter", "verify steps of finished requests", c.verify_steps)
    metric("committed_tokens_total", "counter", "tokens those verify steps committed (bonus included)", c.committed)
    metric("tau", "gauge", "committed tokens per verify step over finished requests",
           c.committed / c.verify_steps if c.verify_steps else 0.0)
    metric("queue_length", "gauge", "requests waiting for a slot", waiting)
    metric("running_requests", "gauge", "requests in slots", running)
    metric("slots", "gauge", "request slots (--max-concurrency)", engine.slots)
    return "\n".join(lines) + "\n"


class _Server:
    """The routes' shared state: the engine, the served model name, the record writer."""

    def __init__(self, engine: ServedEngine, model: str, writer: RecordWriter | None):
        self.engine, self.model, self.writer = engine, model, writer

    def check_model(self, body) -> None:
        """Raise ApiError 404 (param ``model``) unless the body names the served model."""
        if body.model != self.model:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves {self.model!r}",
                           "model", "model_not_found")

    def chat_prompt(self, body: ChatBody) -> list[int]:
        """The messages through the chat template, tokenized as a prompt file is (no special tokens added)."""
        messages = [{"role": m.role, "content": message_text(m)} for m in body.messages]
        kwargs = CHAT_TEMPLATE_KWARGS if body.chat_template_kwargs is None else body.chat_template_kwargs
        try:
            text = format_prompt(self.engine.tokenizer, messages, kwargs)
        except SpecpilotError as e:
            raise ApiError(400, str(e), "messages") from None
        except Exception as e:  # noqa: BLE001 -- the template failing on this request's messages or arguments
            field = "messages" if body.chat_template_kwargs is None else "chat_template_kwargs"
            raise ApiError(400, f"the chat template failed on this request ({type(e).__name__}: {e})", field) from None
        return encode_text(self.engine.tokenizer, text, "messages")

    def completion_prompt(self, body: CompletionBody) -> list[int]:
        """The prompt's token ids: text tokenized, or ids checked against the vocabulary (ApiError naming ``prompt``)."""
        p = body.prompt
        if isinstance(p, list) and p and all(isinstance(t, str) for t in p):
            if len(p) != 1:
                raise ApiError(400, "one prompt per request (a list of several prompts is not supported)", "prompt")
            p = p[0]
        if isinstance(p, str):
            ids = encode_text(self.engine.tokenizer, p, "prompt")
        else:
            vocab = int(self.engine.dep.target.config.vocab_size)
            if any(not 0 <= t < vocab for t in p):
                raise ApiError(400, f"prompt token ids must be in 0..{vocab - 1}", "prompt")
            ids = list(p)
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        return [int(t) for t in ids]

    def submit(self, body, prompt_ids: list[int], field: str, budget_field: str, requested: int | None,
               endpoint: str) -> tuple[Job, int]:
        """Check the request, submit it; returns (job, engine id). Raises ApiError (400, 429, 503)."""
        self.check_model(body)
        check_sampling(body)
        stops = stop_strings(body)
        eng = self.engine
        try:
            budget = token_budget(requested, budget_field, len(prompt_ids), eng.room(len(prompt_ids)), eng.max_seq)
        except ApiError as e:
            e.param = field if e.param == "prompt" else e.param
            raise
        rid = self.writer.new_id() if self.writer is not None else None
        job = Job(asyncio.get_running_loop(), TextStream(eng.tokenizer, stops))
        if self.writer is not None:
            job.on_done = lambda j: self._record(j, rid, prompt_ids, budget, endpoint, body.ignore_eos)
        try:
            i = eng.scheduler.submit(Submission(prompt_ids, budget, body.ignore_eos, job.on_tokens, job.on_finish))
        except QueueFull as e:
            raise ApiError(429, str(e), None, "queue_full") from None
        except SpecpilotError as e:
            raise ApiError(503, str(e)) from None
        return job, i

    def _record(self, job: Job, rid: str, prompt_ids: list[int], budget: int, endpoint: str, ignore_eos: bool) -> None:
        r = job.result
        if r is None or not r.output_ids or job.reason == "error":
            return
        served = {"finish_reason": job.reason, "endpoint": endpoint, "completion_tokens": job.completion_tokens,
                  "max_new_tokens": budget}
        if job.text.stop is not None:
            served["stop"] = {"string": job.text.stop, "tokens": job.text.stop_tokens}
        self.writer.add(self.engine.record(rid, prompt_ids, r, served, ignore_eos), prompt_ids)


async def _collect(request: Request, job: Job, server: _Server, i: int) -> None:
    """Wait for a non-streamed request to end; a client that disconnects cancels it."""
    while not job.done.is_set():
        try:
            await asyncio.wait_for(job.done.wait(), 0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                server.engine.scheduler.cancel(i)
                return


def _usage(prompt_ids: list[int], job: Job) -> dict:
    n = job.completion_tokens
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}


async def _respond(request: Request, server: _Server, job: Job, i: int, body, prompt_ids: list[int], chat: bool):
    """The response: one JSON object, or the server-sent events of a stream."""
    created, kind = int(time.time()), "chat.completion" if chat else "text_completion"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{i}"

    def choice(text: str, finish: str | None, first: bool = False) -> dict:
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if body.stream:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}

    def chunk(choices: list, usage: dict | None = None) -> dict:
        obj = {"id": rid, "object": kind + (".chunk" if chat and body.stream else ""), "created": created, "model": server.model,
               "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return obj

    if not body.stream:
        await _collect(request, job, server, i)
        if job.reason == "error":
            raise ApiError(500, f"the engine failed: {server.engine.scheduler.error}")
        return JSONResponse(chunk([choice(job.text.text, job.finish_reason)], _usage(prompt_ids, job)))

    usage = bool((body.stream_options or {}).get("include_usage"))

    async def events():
        try:
            first = chat
            while True:
                delta = await job.queue.get()
                if delta is None:
                    break
                yield _sse(chunk([choice(delta, None, first)]))
                first = False
            if job.reason == "error":
                yield _sse(ApiError(500, f"the engine failed: {server.engine.scheduler.error}").body())
            else:
                yield _sse(chunk([choice("", job.finish_reason, first)]))
                if usage:
                    yield _sse(chunk([], _usage(prompt_ids, job)))
            yield "data: [DONE]\n\n"
        finally:
            if not job.done.is_set():  # the client went away mid-stream: free the slot
                server.engine.scheduler.cancel(i)

    return StreamingResponse(events(), media_type="text/event-stream")


def create_app(engine: ServedEngine, model: str, writer: RecordWriter | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model name ``model`` (module docstring)."""
    app = FastAPI(title="specpilot serve")
    app.router.route_class = TextCheckedRoute
    server = _Server(engine, model, writer)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # FastAPI's own (e.g. a body it cannot parse)
        param = "body" if e.status_code == 400 else None
        return JSONResponse(ApiError(e.status_code, str(e.detail), param).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":
            return JSONResponse(ApiError(400, f"malformed JSON body: {err.get('msg', '')}", "body").body(),
                                status_code=400)
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return JSONResponse(ApiError(400, f"{param or 'body'}: {err.get('msg', 'invalid')}", param).body(),
                            status_code=400)

    @app.get("/health")
    async def health():
        s = engine.scheduler
        if not s.alive:
            return JSONResponse({"status": "error", "error": str(s.error or "engine not running")}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "specpilot",
                                            "max_model_len": engine.max_seq}]}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        server.check_model(body)
        ids = server.completion_prompt(body)
        job, i = server.submit(body, ids, "prompt", "max_tokens", body.max_tokens, "completions")
        return await _respond(request, server, job, i, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatBody):
        server.check_model(body)
        ids = server.chat_prompt(body)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        job, i = server.submit(body, ids, "messages", field, requested, "chat/completions")
        return await _respond(request, server, job, i, body, ids, chat=True)

    return app
