"""A model's chat template, rendered the way transformers' ``apply_chat_template`` renders it.

Chat templates are Jinja programs shipped in ``tokenizer_config.json`` (or ``chat_template.jinja``)
and, being downloaded code, run in Jinja's ``ImmutableSandboxedEnvironment``. The environment is
transformers' (``transformers/utils/chat_template_utils.py``): ``trim_blocks`` and ``lstrip_blocks``,
the ``loopcontrols`` extension, a ``{% generation %}`` block that renders its body, a ``tojson``
filter that does not escape HTML and takes ``indent``/``separators``/``sort_keys``, and the globals
``raise_exception(msg)`` and ``strftime_now(fmt)``. The template sees ``messages``,
``add_generation_prompt``, the special tokens (``bos_token``, ``eos_token``, ``unk_token``,
``pad_token``) and every extra keyword, such as Qwen3's ``enable_thinking=False``, ``tools`` or
Llama-3's ``date_string``; a keyword overrides a special token of the same name.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from ..errors import PromptError, TokenizerError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")

# Names a message's reasoning comes under; templates read the first (transformers fills it in).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(tokenizer_config: dict, messages: list[dict], *,
                         add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
    """The prompt text for ``messages`` (dicts with a ``role``) under the chat template of
    ``tokenizer_config`` (a tokenizer_config.json as a dict).

    Raises TokenizerError when there is no template or it does not compile, and PromptError
    when the messages are malformed or the template rejects them (its ``raise_exception``).
    """
    template = _template_text(tokenizer_config)
    chat = _check_messages(messages)
    special = {k: _token_text(tokenizer_config[k]) for k in SPECIAL_TOKEN_KEYS
               if tokenizer_config.get(k) is not None}
    context = {**special, **template_kwargs}
    compiled = _compile(template)
    try:
        return compiled.render(messages=chat, add_generation_prompt=add_generation_prompt,
                               **context)
    except _TemplateRaised as e:
        raise PromptError(f"the chat template rejects these messages: {e}") from None
    except Exception as e:  # TemplateError, or Python's own (None + str) inside the template
        raise PromptError(f"the chat template failed on these messages "
                          f"({type(e).__name__}: {e})") from None


class _TemplateRaised(Exception):
    """raise_exception() called by a template: the template's own verdict on the messages."""


def _template_text(tokenizer_config: dict) -> str:
    """The template string; a list of named templates (an older format) gives its "default"."""
    t = tokenizer_config.get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
        if t is None:
            raise TokenizerError(f"the model has named chat templates ({', '.join(map(str, named))}) "
                                 "but none called 'default'")
    if not t:
        raise TokenizerError("the model has no chat template (no chat_template in "
                             "tokenizer_config.json and no chat_template.jinja)")
    if not isinstance(t, str):
        raise TokenizerError(f"the model's chat_template is a {type(t).__name__}, not a string")
    return t


def _token_text(v: Any) -> str:
    """A special token as tokenizer_config.json may spell it: a string or an AddedToken dict."""
    return str(v.get("content", "")) if isinstance(v, dict) else str(v)


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise PromptError(f"messages must be a list of dicts, not a {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise PromptError(f"message {i} is not a dict with a 'role': {m!r:.80}")
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:  # as transformers does: every name the templates read
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(dict(m))
    return out


_COMPILED: dict[str, Any] = {}


def _compile(template: str):
    """The compiled template, cached by its text (a chat compiles the same template each turn)."""
    hit = _COMPILED.get(template)
    if hit is not None:
        return hit
    from jinja2.exceptions import TemplateSyntaxError

    try:
        compiled = _environment().from_string(template)
    except TemplateSyntaxError as e:
        raise TokenizerError(f"the model's chat template does not compile: {e} "
                             f"(template line {e.lineno})") from None
    if len(_COMPILED) > 32:
        _COMPILED.clear()
    _COMPILED[template] = compiled
    return compiled


def _environment():
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's text (transformers uses
        it for training masks); rendering, it is just its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise _TemplateRaised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: Jinja's own tojson escapes <, >, & and ' for HTML
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
