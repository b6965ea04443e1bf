"""The OpenAI request bodies ``specpilot serve`` accepts, and what it refuses (one 4xx per field).

Bodies are parsed by pydantic (:class:`CompletionBody`, :class:`ChatBody`; unknown fields are
ignored, as OpenAI-compatible servers do); :func:`check_sampling` then refuses what the engine
cannot do. Every refusal is an :class:`ApiError`: an HTTP status and OpenAI's error object
``{"error": {"message", "type", "param", "code"}}`` whose ``param`` names the field.

Greedy decoding only: ``temperature`` 0 or omitted, ``top_p`` 1 or omitted, ``n`` 1,
``presence_penalty`` / ``frequency_penalty`` 0 or omitted, no ``logprobs``; anything else is
refused (400) rather than silently decoded greedily. ``max_tokens`` (or
``max_completion_tokens``) >= 1 and within the context (:func:`token_budget`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ApiError(Exception):
    """A refused request: HTTP ``status`` and OpenAI's error object naming ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 429:
            kind = "rate_limit_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # vLLM / SGLang's extension: decode the whole budget past EOS


class CompletionBody(_Body):
    """``POST /v1/completions``: ``prompt`` as text or token ids."""

    prompt: str | list[int] | list[str]


class Message(BaseModel):
    """One chat message (``content`` as a string, or OpenAI's list of text parts)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict]


class ChatBody(_Body):
    """``POST /v1/chat/completions``: ``messages`` through the deployment's chat template
    (``chat_template_kwargs``: vLLM's extension; default the benchmarks' settings)."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict | None = None


def check_sampling(body: _Body) -> None:
    """Refuse what greedy decoding cannot serve (module docstring). Raises ApiError (400) naming the field."""
    if body.temperature not in (None, 0):
        raise ApiError(400, f"temperature {body.temperature:g}: this server decodes greedily only (temperature 0 "
                            f"or omitted); sampling is not supported", "temperature")
    if body.top_p not in (None, 1):
        raise ApiError(400, f"top_p {body.top_p:g}: greedy decoding only (top_p 1 or omitted)", "top_p")
    if body.n not in (None, 1):
        raise ApiError(400, f"n {body.n}: one choice per request only (greedy decoding gives one answer)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            raise ApiError(400, f"{name} {getattr(body, name):g}: greedy decoding only (0 or omitted)", name)
    if body.logprobs not in (None, False, 0):
        raise ApiError(400, "logprobs are not supported", "logprobs")


def stop_strings(body: _Body) -> list[str]:
    """The request's stop strings (empty strings refused: ApiError naming ``stop``)."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must be non-empty", "stop")
    return stops


def message_text(m: Message) -> str:
    """A message's text: its string content, or its text parts joined (other parts refused)."""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for p in m.content:
        if p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise ApiError(400, "only text content parts are supported", "messages")
        parts.append(p["text"])
    return "".join(parts)


def token_budget(requested: int | None, field: str, prompt_len: int, room: int, context: int) -> int:
    """The request's ``max_tokens``: ``requested`` (>= 1 and <= ``room``, the new tokens the
    context leaves after a prompt of ``prompt_len`` tokens), or ``room`` when omitted.

    Raises:
        ApiError: the prompt leaves no room (param ``prompt`` / ``messages``: the caller renames it)
            or ``requested`` < 1 or > ``room`` (param ``field``), each naming the context.
    """
    if room < 1:
        raise ApiError(400, f"the prompt of {prompt_len} tokens leaves no room for a new token in the context of "
                            f"{context} tokens (KV-cache slots per request, --max-seq)", "prompt",
                       "context_length_exceeded")
    if requested is None:
        return room
    if requested < 1:
        raise ApiError(400, f"{field} must be >= 1, got {requested}", field)
    if requested > room:
        raise ApiError(400, f"{field} {requested} is past the context: a prompt of {prompt_len} tokens leaves room for "
                            f"{room} new tokens in the context of {context} tokens (--max-seq)", field,
                       "context_length_exceeded")
    return requested
