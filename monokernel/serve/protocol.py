"""OpenAI's wire format, without a web framework: read a request body into a prompt and sampling
arguments, write completions, chat completions, stream chunks and errors.

Reading is strict about types (``"max_tokens": "8"`` is a 400 naming ``max_tokens``, not a
guess) and refuses the OpenAI fields monokernel cannot honour (``n > 1``, ``logit_bias``,
``tools``, ...) instead of ignoring them; fields it does not know are ignored, as vLLM does.

Defaults follow vLLM: a field the request leaves out takes the model's generation_config.json
value when it has one (temperature, top_p, top_k, repetition_penalty, min_p), else OpenAI's
(temperature 1, top_p 1). ``max_tokens`` left out is the server's default (``monokernel serve
--default-max-tokens``), cut to what the context leaves after the prompt; a ``max_tokens``
given past what the context leaves is a 400 (see ``check_max_tokens``), as in vLLM.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import MonokernelError

MAX_LOGPROBS = 20  # vLLM's cap; OpenAI allows 5 (completions) and 20 (chat)

# OpenAI request field -> SamplingParams argument, for the fields passed through unchanged
_NUMBER_FIELDS = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p",
                  "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty",
                  "repetition_penalty": "repetition_penalty"}
_INT_FIELDS = {"top_k": "top_k", "seed": "seed", "min_tokens": "min_tokens"}
_FROM_GENERATION_CONFIG = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")
# SamplingParams argument -> the request field to name in an error
PARAM_NAMES = {"max_new_tokens": "max_tokens"}
SAMPLING_FIELDS = {"max_new_tokens", "max_tokens", "temperature", "top_k", "top_p", "min_p",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
                   "stop_token_ids", "logprobs", "prompt_logprobs", "min_tokens"}


class APIError(MonokernelError):
    """A request the server answers with an HTTP error and OpenAI's error JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        # a message may quote the request: keep it encodable whatever the request held
        message = self.message.encode("utf-8", "replace").decode("utf-8")
        return {"error": {"message": message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- reading a request --------------------------------------------------------------------
def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {e}",
                          code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    try:  # "\ud800" is valid JSON but no text: it would fail deep inside the tokenizer
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the request body holds a string with a lone UTF-16 surrogate "
                          "(an escape such as \\ud800 without its pair)",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_kind(body)}",
                          code="invalid_json")
    return body


def _kind(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def int_field(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"`{name}` must be an integer, got {_kind(v)} ({v!r})", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_request(f"`{name}` must be {rng}, got {v}", name)
    return v


def number_field(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"`{name}` must be a number, got {_kind(v)} ({v!r})", name)
    if not math.isfinite(v):
        raise bad_request(f"`{name}` must be finite, got {v}", name)
    return float(v)


def bool_field(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"`{name}` must be true or false, got {_kind(v)} ({v!r})", name)
    return v


def str_list_field(body: dict, name: str) -> list[str] | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise bad_request(f"`{name}` must be a string or an array of strings, got {_kind(v)}", name)


def int_list_field(body: dict, name: str) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return v
    raise bad_request(f"`{name}` must be an array of integers", name)


def _refuse(body: dict, name: str, unsupported: bool, why: str) -> None:
    if unsupported:
        raise bad_request(f"`{name}` {why}", name, code="unsupported")


@dataclass
class Request:
    """What a completion or chat request asks for, checked, in monokernel's terms."""
    model: str | None
    sampling: dict[str, Any]  # SamplingParams arguments
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top-N alternatives per token (0: the sampled token only)
    return_token_ids: bool = False  # vLLM extension: token ids in every choice and chunk
    prompt: str | list[int] | None = None  # completions
    echo: bool = False
    messages: list[dict[str, Any]] | None = None  # chat
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_tokens_given: bool = False  # False: sampling's max_new_tokens is the server's default


def _common(body: dict, defaults: dict[str, Any]) -> Request:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"`model` must be a string, got {_kind(model)}", "model")
    n = int_field(body, "n", 1)
    _refuse(body, "n", n not in (None, 1), f"must be 1: monokernel runs one sequence per request "
            f"(got {n}); send {n} requests, with different seeds")
    best_of = int_field(body, "best_of", 1)
    _refuse(body, "best_of", best_of not in (None, 1), f"must be 1 (got {best_of})")
    _refuse(body, "logit_bias", bool(body.get("logit_bias")), "is not supported")
    _refuse(body, "use_beam_search", bool(body.get("use_beam_search")), "is not supported")
    sampling: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0}
    sampling.update({k: defaults[k] for k in _FROM_GENERATION_CONFIG if defaults.get(k) is not None})
    for name, arg in _NUMBER_FIELDS.items():
        v = number_field(body, name)
        if v is not None:
            sampling[arg] = v
    for name, arg in _INT_FIELDS.items():
        v = int_field(body, name)
        if v is not None:
            sampling[arg] = v
    stop = str_list_field(body, "stop")
    if stop:
        sampling["stop"] = tuple(stop)
    stop_ids = int_list_field(body, "stop_token_ids")
    if stop_ids:
        sampling["stop_token_ids"] = tuple(stop_ids)
    if bool_field(body, "ignore_eos"):
        sampling["ignore_eos"] = True
    stream = bool_field(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request(f"`stream_options` must be an object, got {_kind(opts)}",
                          "stream_options")
    include_usage = bool_field(opts or {}, "include_usage")
    return Request(model=model, sampling=sampling, stream=stream, include_usage=include_usage,
                   return_token_ids=bool_field(body, "return_token_ids"))


def _max_tokens(req: Request, max_tokens: int | None, default: int) -> None:
    req.max_tokens_given = max_tokens is not None
    req.sampling["max_new_tokens"] = default if max_tokens is None else max_tokens


def check_max_tokens(max_tokens: int, given: bool, prompt_tokens: int, max_seq_len: int
                     ) -> int:
    """The tokens a request may generate: ``max_tokens`` when the context has room for it
    after the prompt; the server's default is cut to that room; a ``max_tokens`` the request
    gave past it is a 400 naming both numbers. (A prompt that fills the context is the
    engine's error, raised when the generation starts.)"""
    room = max_seq_len - prompt_tokens
    if room < 1 or max_tokens <= room:
        return max_tokens
    if not given:
        return room
    raise bad_request(f"`max_tokens` is {max_tokens}, but the context of {max_seq_len} tokens "
                      f"leaves {room} after the prompt's {prompt_tokens}: ask for at most "
                      f"{room}", "max_tokens", code="max_tokens_exceeds_context")


def parse_completion(body: dict, defaults: dict[str, Any], default_max_tokens: int) -> Request:
    req = _common(body, defaults)
    req.prompt = prompt_field(body.get("prompt"))
    _refuse(body, "suffix", bool(body.get("suffix")), "is not supported (no fill-in-the-middle)")
    req.echo = bool_field(body, "echo")
    _max_tokens(req, int_field(body, "max_tokens", 1), default_max_tokens)
    req.logprobs = int_field(body, "logprobs", 0, MAX_LOGPROBS)
    if req.logprobs is not None:
        req.sampling["logprobs"] = req.logprobs
        if req.echo:
            req.sampling["prompt_logprobs"] = req.logprobs
    return req


def prompt_field(p: Any) -> str | list[int]:
    """A string, token ids, or a batch of one of either (OpenAI's four prompt shapes)."""
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad_request("`prompt` is empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad_request(f"`prompt` holds {len(p)} prompts; monokernel takes one per request",
                          "prompt", code="unsupported")
    if p is None:
        raise bad_request("`prompt` is required", "prompt")
    raise bad_request(f"`prompt` must be a string or an array of token ids, got {_kind(p)}"
                      + (" (empty)" if p == [] else ""), "prompt")


def parse_chat(body: dict, defaults: dict[str, Any], default_max_tokens: int) -> Request:
    req = _common(body, defaults)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("`messages` must be a non-empty array of {role, content} objects",
                          "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"`messages[{i}]` must be an object, got {_kind(m)}",
                              f"messages[{i}]")
        if not isinstance(m.get("role"), str):
            raise bad_request(f"`messages[{i}].role` must be a string", f"messages[{i}].role")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise bad_request(f"`messages[{i}].content` must be a string or an array of "
                              f"content parts, got {_kind(c)}", f"messages[{i}].content")
    req.messages = msgs
    _refuse(body, "tools", bool(body.get("tools")) or bool(body.get("functions")),
            "is not supported (no tool calling)")
    fmt = body.get("response_format")
    _refuse(body, "response_format",
            fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"),
            "is not supported (only {\"type\": \"text\"})")
    max_tokens = int_field(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", 1)
    _max_tokens(req, max_tokens, default_max_tokens)
    top = int_field(body, "top_logprobs", 0, MAX_LOGPROBS)
    if bool_field(body, "logprobs"):
        req.logprobs = top or 0
        req.sampling["logprobs"] = req.logprobs
    elif top:
        raise bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    kw = body.get("chat_template_kwargs")
    if kw is not None and not isinstance(kw, dict):
        raise bad_request(f"`chat_template_kwargs` must be an object, got {_kind(kw)}",
                          "chat_template_kwargs")
    req.chat_template_kwargs = kw or {}
    return req


# ---- tokens as text -----------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TokenText:
    """The bytes and the text of single tokens, as logprobs report them. A byte-level token
    can hold part of a UTF-8 character: its ``bytes`` are exact, its text shows U+FFFD."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        try:
            decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        except Exception:
            decoder = {}
        self.byte_level = decoder.get("type") == "ByteLevel"
        self.added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.unbyte = {c: b for b, c in _bytes_to_unicode().items()}
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            piece = self.tok.id_to_token(token_id)
            if token_id in self.added or piece is None or not self.byte_level:
                b = self.tok.decode([token_id], skip_special_tokens=False).encode()
            else:
                try:
                    b = bytes(self.unbyte[c] for c in piece)
                except KeyError:
                    b = self.tok.decode([token_id], skip_special_tokens=False).encode()
            self._cache[token_id] = b
        return b

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


# ---- writing responses --------------------------------------------------------------------
@dataclass
class TokenLogprob:
    """One position: the chosen token, its log-probability and the top alternatives."""
    token_id: int
    logprob: float | None  # None: the first prompt token (nothing before it predicts it)
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


def _num(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number, vLLM writes -9999.0
    return float(x) if math.isfinite(x) else -9999.0


def completion_logprobs(entries: list[TokenLogprob], tt: TokenText, offset: int
                        ) -> dict[str, Any]:
    """OpenAI completions format; the first prompt token (``echo``) has null logprobs."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        s = tt.text(e.token_id)
        tokens.append(s)
        lps.append(None if e.logprob is None else _num(e.logprob))
        tops.append(None if e.logprob is None else {tt.text(t): _num(lp) for t, lp in e.top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], tt: TokenText) -> dict[str, Any]:
    def one(t: int, lp: float) -> dict[str, Any]:
        return {"token": tt.text(t), "logprob": _num(lp), "bytes": list(tt.bytes(t))}

    return {"content": [dict(one(e.token_id, e.logprob),
                             top_logprobs=[one(t, lp) for t, lp in e.top]) for e in entries]}


def envelope(rid: str, obj: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()
