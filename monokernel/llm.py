"""The public entry point: ``LLM`` (load once, then generate, stream or chat) and ``Completion``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from .errors import PromptError, TokenizerError
from .model.loader import LoadedModel, load_model
from .runtime import Engine, make_executor
from .sampling import SamplingParams
from .streaming import TextStream


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # generated tokens, without a final stop token
    finish_reason: str  # "stop" | "length"
    prompt_token_ids: list[int] = field(default_factory=list)
    backend: str = ""
    elapsed_s: float = 0.0
    decode_tokens_per_s: float = float("nan")

    def __str__(self) -> str:
        return self.text


class Stream:
    """Iterator of text pieces; after it is exhausted, ``completion`` holds the whole result."""

    def __init__(self, gen: Iterator[str]):
        self._gen = gen
        self.completion: Completion | None = None

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        return next(self._gen)


class LLM:
    """``LLM()`` loads the bundled SmolLM2-135M-Instruct; ``LLM("dir" | "file.gguf")`` another
    model. ``backend``: auto | numpy | emulator | emulator-multi | cuda | cuda-multi."""

    def __init__(self, model: str | Path | None = None, backend: str = "auto", *,
                 max_seq_len: int | None = None, progress: bool = True, **backend_options: Any):
        self.model: LoadedModel = load_model(model, progress=progress)
        self.config = self.model.config
        self.tokenizer = self.model.tokenizer
        max_seq_len = min(max_seq_len or 2048, self.config.max_position_embeddings)
        self.engine = Engine(make_executor(backend, self.model, max_seq_len, **backend_options))
        self.backend = self.engine.executor.name
        self.default_params = SamplingParams.from_generation_config(self.model.generation_config)

    # ---- prompts --------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("the prompt is empty")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids
        return [int(t) for t in prompt]

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        tc = self.model.tokenizer_config
        template = tc.get("chat_template")
        if not template:
            raise TokenizerError(f"{self.model.path}: tokenizer_config.json has no chat_template")

        def raise_exception(msg: str) -> None:
            raise TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception

        def tok_str(v: Any) -> str:
            return v.get("content", "") if isinstance(v, dict) else (v or "")

        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=tok_str(tc.get("bos_token")), eos_token=tok_str(tc.get("eos_token")))

    # ---- generation -----------------------------------------------------------------------
    def _run(self, ids: list[int], params: SamplingParams, stream: TextStream, out_stream: Stream
             ) -> Iterator[str]:
        t0 = time.perf_counter()
        out: list[int] = []
        finish = "length"
        for tok, is_stop in self.engine.generate_ids(ids, params):
            if is_stop:
                finish = "stop"
                break
            out.append(tok)
            piece = stream.push(tok)
            if piece:
                yield piece
            if stream.stopped:
                finish = "stop"
                break
        tail = stream.finish()
        if tail:
            yield tail
        out_stream.completion = Completion(
            text=stream.text, token_ids=out, finish_reason=finish, prompt_token_ids=ids,
            backend=self.backend, elapsed_s=time.perf_counter() - t0,
            decode_tokens_per_s=self.engine.stats.decode_tokens_per_s)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               add_special_tokens: bool = True) -> Stream:
        params = params or self.default_params
        ids = self.encode(prompt, add_special_tokens=add_special_tokens)
        self.engine.check_prompt(ids)  # fail now, not at the first next()
        s = Stream(iter(()))
        s._gen = self._run(ids, params, TextStream(self.tokenizer, params.stop), s)
        return s

    def generate(self, prompt: str | Sequence[int] | list[str],
                 params: SamplingParams | None = None) -> Completion | list[Completion]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            return [self.generate(p, params) for p in prompt]  # type: ignore[misc]
        s = self.stream(prompt, params)
        for _ in s:
            pass
        assert s.completion is not None
        return s.completion

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None,
             *, stream: bool = False) -> Completion | Stream:
        text = self.apply_chat_template(messages, add_generation_prompt=True)
        # the template already wrote any BOS: do not let the tokenizer add a second one
        ids = self.encode(text, add_special_tokens=False)
        s = self.stream(ids, params)
        if stream:
            return s
        for _ in s:
            pass
        assert s.completion is not None
        return s.completion
