"""The OpenAI request bodies ``specpilot serve`` accepts, and what it refuses (one 4xx per field).

Bodies are parsed by pydantic (:class:`CompletionBody`, :class:`ChatBody`; unknown fields are
ignored, as OpenAI-compatible servers do); :func:`check_sampling` then refuses what the engine
cannot do. Every refusal is an :class:`ApiError`: an HTTP status and OpenAI's error object
``{"error": {"message", "type", "param", "code"}}`` whose ``param`` names the field.

Greedy decoding only: ``temperature`` 0 or omitted, ``top_p`` 1 or omitted, ``n`` 1,
``presence_penalty`` / ``frequency_penalty`` 0 or omitted, no ``logprobs``; anything else is
refused (400) rather than silently decoded greedily. ``max_tokens`` (or
``max_completion_tokens``) >= 1 and within the context (:func:`token_budget`). Text that cannot be
decoded (bytes that are not UTF-8, lone surrogates, unescaped control characters) is refused
before the body is parsed (:func:`check_body_text`), text the tokenizer refuses when it is
tokenized (:func:`encode_text`): each a 400 naming the field, never a 500.
"""

from __future__ import annotations

import json
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


def _first_bad_string(obj, path: tuple = (), bad=None) -> tuple[tuple, str, int] | None:
    """(path, string, index) of the first string (key or value) of a parsed JSON body in which
    ``bad(string)`` finds a character (its index), depth first; None when there is none."""
    if isinstance(obj, str):
        k = bad(obj)
        return None if k is None else (path, obj, k)
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        if isinstance(key, str) and bad(key) is not None:
            return path + (key,), key, bad(key)
        hit = _first_bad_string(value, path + (key,), bad)
        if hit is not None:
            return hit
    return None


def _surrogate(s: str) -> int | None:
    """Index of the first lone surrogate (U+D800..U+DFFF: no Unicode character, not encodable as UTF-8)."""
    return next((i for i, ch in enumerate(s) if 0xD800 <= ord(ch) <= 0xDFFF), None)


def _control(s: str) -> int | None:
    """Index of the first character JSON requires escaped (U+0000..U+001F)."""
    return next((i for i, ch in enumerate(s) if ord(ch) < 0x20), None)


def _field(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "body"


def check_body_text(raw: bytes) -> None:
    """Refuse a JSON request body whose text cannot be decoded, naming the field (OpenAI's
    ``param``, the dotted path as for a pydantic error: ``messages.0.content``), before the body
    is parsed into a request: bytes that are not UTF-8 (RFC 8259 section 8.1: JSON exchanged
    between systems is UTF-8), a string holding a lone surrogate (a ``\\ud800`` escape without
    its pair: no Unicode character, which no tokenizer can encode), or an unescaped control
    character (U+0000..U+001F, RFC 8259 section 7). A body that is malformed JSON otherwise is
    left to the parser (400, param ``body``). Escaped control characters (``\\u0000``) are text
    and pass; the tokenizer decides (:func:`encode_text`).

    Raises:
        ApiError: 400 naming the field, the character's index in it and what is wrong.
    """
    try:
        text, undecodable = raw.decode("utf-8"), None
    except UnicodeDecodeError as e:  # decoded anyway (bytes -> U+DC80..U+DCFF) to find the field holding them
        text, undecodable = raw.decode("utf-8", errors="surrogateescape"), e
    try:
        obj = json.loads(text)
    except ValueError:
        try:
            obj = json.loads(text, strict=False)  # control characters inside strings are allowed here
        except ValueError:
            if undecodable is not None:
                raise ApiError(400, f"the request body is not UTF-8 text (byte {undecodable.start}: "
                                    f"{undecodable.reason})", "body") from None
            return  # malformed JSON: the parser's error
        hit = _first_bad_string(obj, bad=_control)
        if hit is not None:
            path, s, k = hit
            raise ApiError(400, f"{_field(path)}: unescaped control character U+{ord(s[k]):04X} at character {k} "
                                f"(JSON strings need it escaped, e.g. \\u{ord(s[k]):04x})", _field(path))
    hit = _first_bad_string(obj, bad=_surrogate)
    if hit is not None:
        path, s, k = hit
        what = (f"bytes that are not UTF-8 (byte {undecodable.start} of the body: {undecodable.reason})"
                if undecodable is not None else f"a lone surrogate U+{ord(s[k]):04X} at character {k} (an escaped "
                                                 f"UTF-16 half without its pair: no Unicode character)")
        raise ApiError(400, f"{_field(path)}: not valid Unicode text: {what}", _field(path))


def encode_text(tokenizer, text: str, field: str) -> list[int]:
    """``text``'s token ids (no special tokens added), as a prompt file holds them.

    Raises:
        ApiError: 400 naming ``field`` when the tokenizer refuses the text (e.g. characters its
            normalizer or vocabulary cannot take), with the tokenizer's message."""
    try:
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    except Exception as e:  # noqa: BLE001 -- whatever the tokenizer raises on this text is the request's fault
        raise ApiError(400, f"{field}: the tokenizer cannot encode this text ({type(e).__name__}: {e})", field) from None
