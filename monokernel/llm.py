"""The public entry point: ``LLM`` (load once, then generate, stream or chat) and the results:
``Completion`` (vLLM-shaped too: ``outputs[0].text``), ``Stream``, ``Delta``, ``TokenLogprob``.

Calls pasted from vLLM work: ``generate(prompts, sampling_params=...)`` with one or a list of
params, ``{"prompt_token_ids": [...]}`` prompts, ``chat()`` on a list of conversations,
``get_tokenizer()``. A list of prompts runs as one batch on a batched backend (numpy, or a
kernel backend built with ``slots=N``: up to ``max_num_seqs`` sequences per step, the rest
admitted as slots free up; batching.py), one after another on a kernel backend without slots,
which runs one sequence at a time.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .control_tokens import ControlTokens, content_spans
from .errors import ParameterError, PromptError, TokenizerError
from .model.chat_template import render_chat_template
from .model.loader import LoadedModel, load_model
from .results import Completion, CompletionOutput, Delta, Logprob, TokenLogprob
from .kernel.isa import StopReason
from .batching import batch_options
from .runtime import Engine, Generation, Sampled, make_executor, resolve_backend
from .sampling import SamplingParams
from .streaming import TextStream

DEFAULT_MAX_SEQ_LEN = 2048


class Stream:
    """A running generation. Iterating yields the new text pieces (``str``, never empty);
    ``deltas()`` yields :class:`Delta` objects (text, token ids, logprobs) of the same
    generation instead: use one or the other. After exhaustion ``completion`` is the
    :class:`Completion`. ``close()`` cancels the generation at once (from any thread: if a
    step is running, it stops before the next) and frees the engine for the next request;
    ``completion`` then holds what was generated, with finish_reason "abort"."""

    def __init__(self, llm: "LLM", gen: Generation, prompt: str | None, ids: list[int],
                 params: SamplingParams, text: "TextStop"):
        self._llm = llm
        self._gen = gen
        self._text = text
        self._prompt = prompt
        self._ids = ids
        self._params = params
        self._closed = False
        self.completion: Completion | None = None
        self._it = self._run()

    def __iter__(self) -> "Stream":
        return self

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._ids

    def __next__(self) -> str:
        while True:
            d = next(self._it)
            if d.text:
                return d.text

    def deltas(self) -> Iterator[Delta]:
        return self._it

    def ready(self) -> bool:
        """Whether the next delta comes without running an engine step (batched backends:
        the server's engine thread serves the streams that are ready, then steps)."""
        return self._gen.ready()

    def close(self) -> None:
        self._closed = True
        self._gen.close()
        try:
            self._it.close()
        except ValueError:  # being iterated in another thread: it ends before the next step
            pass
        if self.completion is None:
            self.completion = self._llm._completion(self._prompt, self._ids, self._gen, [
                CompletionOutput(0, "", [], "abort")], 0.0)

    def _run(self) -> Iterator[Delta]:
        llm, p, gen = self._llm, self._params, self._gen
        t0 = time.perf_counter()
        ts = self._text.stream
        want = p.logprobs is not None
        out: list[int] = []
        lps: list[TokenLogprob] | None = [] if want else None
        finish, stop_reason, generated, done = "length", None, 0, False
        try:
            for s in gen:
                generated += 1
                if s.stop:
                    finish = "stop"
                    stop_reason = s.token if s.token in p.stop_token_ids else None
                    break
                out.append(s.token)
                tl = llm._token_logprob(s) if want else None
                if lps is not None:
                    lps.append(tl)  # type: ignore[arg-type]
                # the Engine handed the token to the TextStream as it made it (TextStop)
                yield Delta(self._text.pieces.popleft(), [s.token],
                            [tl] if want else None)  # type: ignore
                if s.end is StopReason.HOST:  # its stop string (later tokens may be queued)
                    finish, stop_reason = "stop", ts.stop_hit
                    break
            tail = ts.finish()
            if tail:
                yield Delta(tail, [], [] if want else None)
            done = not self._closed
        finally:
            gen.close()  # left early (closed, an error): the kernel may still be making tokens
            if not done:
                finish, stop_reason = "abort", None
                ts.finish()
            cum = (sum(t.logprob for t in lps) if lps is not None else None)
            o = CompletionOutput(0, ts.text, out, finish, stop_reason, lps, cum, generated)
            self.completion = llm._completion(self._prompt, self._ids, gen, [o],
                                              time.perf_counter() - t0)


class TextStop:
    """The stop strings as the Engine's ``text_stop``: each generated token goes through the
    TextStream as the Engine makes it, so the Engine's StopRule ends the generation at a stop
    string (and a multi-step kernel's launch with it); ``piece`` keeps the text the token made
    safe to show until the Stream hands it on (in order: in a batch the Engine may make
    several tokens before the Stream takes the first)."""

    def __init__(self, stream: TextStream):
        self.stream = stream
        self.pieces: collections.deque[str] = collections.deque()

    def __call__(self, token: int) -> bool:
        self.pieces.append(self.stream.push(token))
        return self.stream.stopped


# ================================================================================================
# Tokenizer view
# ================================================================================================
class Tokenizer:
    """What ``LLM.get_tokenizer()`` returns: the Hugging Face calls people paste
    (``encode`` -> ids, ``decode``, ``apply_chat_template``, ``eos_token_id``) over the
    model's ``tokenizers.Tokenizer`` (``.backend``)."""

    def __init__(self, llm: "LLM"):
        self._llm = llm
        self.backend = llm.tokenizer
        self.eos_token_id = llm.config.eos_token_ids[0] if llm.config.eos_token_ids else None
        self.bos_token_id = llm.config.bos_token_id
        self.vocab_size = llm.config.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._llm.tokenize(text, add_special_tokens=add_special_tokens)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._llm.detokenize(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def apply_chat_template(self, messages, tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs: Any):
        kwargs = kwargs or None
        text = self._llm.apply_chat_template(messages, add_generation_prompt, kwargs)
        if not tokenize:
            return text
        return self._llm._encode_chat(text, messages, True, add_generation_prompt, kwargs)


# ================================================================================================
# LLM
# ================================================================================================
def check_text(text: str, what: str) -> str:
    """``text`` unless it holds a lone surrogate (U+D800-U+DFFF: half of a UTF-16 pair, or a
    byte Python could not decode as UTF-8 and escaped), which has no UTF-8 form and which the
    tokenizer refuses with a bare TypeError: then a PromptError naming where it is."""
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            raise PromptError(f"{what} holds a lone surrogate U+{ord(ch):04X} at character {i} "
                              f"({text[max(0, i - 10):i]!r} before it): not valid Unicode text. "
                              f"Decode bytes with the right codec, or drop the half pair "
                              f"(text.encode('utf-8', 'replace').decode())")
    return text


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


class LLM:
    """``LLM()`` loads the bundled SmolLM2-135M-Instruct; ``LLM("dir" | "file.gguf")`` another
    model. ``backend``: auto | numpy | emulator | emulator-multi | cuda | cuda-multi.
    ``max_seq_len`` (vLLM: ``max_model_len``): the context (default min(2048, the model's));
    ``enable_prefix_caching``: reuse the K/V cache of the prefix shared with the previous
    sequence (chat turns, repeated system prompts). ``max_num_seqs`` (default 32) and
    ``max_num_batched_tokens`` (default max(512, max_num_seqs)): how many sequences a batched
    backend runs at once and how many rows one step takes (batching.py): numpy, or a kernel
    backend built with ``slots=N`` (at most N sequences and ``step_tokens`` rows; without it a
    kernel runs one sequence at a time whatever they say). Other keywords are the backend's options
    (``blocks=8``, ``threads=2``: runtime.backend_options), checked before the model loads."""

    def __init__(self, model: str | Path | None = None, backend: str = "auto", *,
                 max_seq_len: int | None = None, progress: bool = True,
                 enable_prefix_caching: bool = True, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 **backend_options: Any):
        if max_model_len is not None:
            if max_seq_len is not None and max_seq_len != max_model_len:
                raise ParameterError(f"give max_seq_len or max_model_len, not both (got "
                                     f"{max_seq_len} and {max_model_len})")
            max_seq_len = max_model_len
        if max_seq_len is not None and (not _is_int(max_seq_len) or max_seq_len < 2):
            raise ParameterError(f"max_seq_len must be an integer >= 2 (one prompt token and "
                                 f"one generated), got {max_seq_len!r}")
        spec = resolve_backend(backend)  # a misspelt backend or option fails before the load
        options = spec.parse(backend_options)
        batch_options(max_num_seqs, max_num_batched_tokens, *options.batch_limits())
        self.model: LoadedModel = load_model(model, progress=progress)
        self.config = self.model.config
        self.tokenizer = self.model.tokenizer
        limit = self.config.max_position_embeddings
        if max_seq_len is None:
            max_seq_len = min(DEFAULT_MAX_SEQ_LEN, limit)
        elif max_seq_len > limit:
            raise ParameterError(f"max_seq_len {max_seq_len} exceeds the model's "
                                 f"max_position_embeddings {limit}")
        self.max_seq_len = int(max_seq_len)
        self.engine = Engine(make_executor(spec, self.model, self.max_seq_len, options),
                             prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens)
        self.backend = self.engine.executor.name
        self.default_params = SamplingParams.from_generation_config(self.model.generation_config)
        p = Path(model) if model is not None else self.model.path
        self.model_name: str = p.stem if p.suffix.lower() == ".gguf" else p.name
        """A short id of the model (the folder name, or the GGUF file's stem)."""
        self._token_texts: dict[int, str] = {}
        self._controls: ControlTokens | None = None

    # ---- tokens ---------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True, *,
                 split_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens``: the tokenizer's BOS and the like.
        Special-token strings typed in ``text`` (``<|im_end|>``) are control tokens, as in
        Hugging Face and vLLM, unless ``split_special_tokens`` (then they are plain text)."""
        if not isinstance(text, str):
            raise PromptError(f"tokenize takes a str, got {type(text).__name__}")
        check_text(text, "the text")
        tok = self._control_tokens().plain if split_special_tokens else self.tokenizer
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = self._check_ids(ids, "detokenize")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_tokenizer(self) -> Tokenizer:
        return Tokenizer(self)

    def encode(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True) -> list[int]:
        """A prompt -> token ids: a str is tokenized (see ``tokenize``), token ids are checked."""
        return self._prompt_ids(prompt, add_special_tokens)[1]

    def _check_ids(self, ids: Any, what: str) -> list[int]:
        if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, (list, tuple,
                                                                             np.ndarray)):
            raise PromptError(f"{what}: token ids must be a list of ints, got "
                              f"{type(ids).__name__}")
        for i, t in enumerate(ids):
            if not _is_int(t):
                raise PromptError(f"{what}: token at position {i} is {t!r}, not an int")
        v = self.config.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= int(t) < v:
                raise PromptError(f"{what}: token id {int(t)} at position {i} is outside the "
                                  f"vocabulary [0, {v})")
        return [int(t) for t in ids]

    def _prompt_ids(self, prompt: Any, add_special_tokens: bool = True
                    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a str, a list of token ids, or vLLM's
        {"prompt": str} / {"prompt_token_ids": [...]}."""
        if isinstance(prompt, Mapping):
            keys = set(prompt)
            if keys == {"prompt_token_ids"} or keys == {"prompt_token_ids", "prompt"}:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple, np.ndarray)):
                    raise PromptError(f"prompt_token_ids must be a list of ints, got "
                                      f"{type(ids).__name__}")
                return prompt.get("prompt"), self._prompt_ids(list(ids))[1]
            if keys == {"prompt"}:
                return self._prompt_ids(prompt["prompt"], add_special_tokens)
            raise PromptError(f"a dict prompt takes 'prompt' or 'prompt_token_ids', got keys "
                              f"{sorted(map(str, keys))}")
        if isinstance(prompt, (bytes, bytearray)):
            raise PromptError(f"the prompt is {type(prompt).__name__} ({bytes(prompt[:20])!r}"
                              f"...); pass a str (e.g. prompt.decode('utf-8')) or a list of "
                              f"token ids")
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("the prompt is empty")
            check_text(prompt, "the prompt")
            return prompt, self.tokenize(prompt, add_special_tokens)
        if isinstance(prompt, (list, tuple, np.ndarray)):
            for i, t in enumerate(prompt):
                if not _is_int(t):
                    raise PromptError(f"the prompt holds {t!r} at position {i}: a prompt is a "
                                      f"str or a list of int token ids")
            return None, [int(t) for t in prompt]
        raise PromptError(f"a prompt is a str, a list of token ids or a dict with "
                          f"'prompt_token_ids', got {type(prompt).__name__}")

    def _params(self, params: Any) -> SamplingParams:
        if params is None:
            return self.default_params
        if isinstance(params, SamplingParams):
            return params
        if isinstance(params, Mapping):
            return SamplingParams.from_dict(params)
        raise ParameterError(f"sampling parameters must be SamplingParams, a dict or None, got "
                             f"{type(params).__name__}")

    def _token_text(self, tok: int) -> str:
        t = self._token_texts.get(tok)
        if t is None:
            t = self._token_texts[tok] = self.tokenizer.decode([tok], skip_special_tokens=False)
        return t

    def _token_logprob(self, s: Sampled) -> TokenLogprob:
        return TokenLogprob(s.token, self._token_text(s.token), float(s.logprob),
                            [(i, self._token_text(i), lp) for i, lp in (s.top or [])], s.rank)

    # ---- chat templates -------------------------------------------------------------------
    def _messages(self, messages: Any) -> list[dict[str, Any]]:
        """Check a conversation and flatten OpenAI content parts into strings."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
            raise PromptError(f"messages must be a list of {{'role': ..., 'content': ...}} "
                              f"dicts, got {type(messages).__name__}")
        if not messages:
            raise PromptError("messages is empty")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise PromptError(f"message {i} is a {type(m).__name__}, not a dict with "
                                  f"'role' and 'content'")
            if "role" not in m:
                raise PromptError(f"message {i} has no 'role' (keys: {sorted(map(str, m))})")
            if not isinstance(m["role"], str):
                raise PromptError(f"message {i}: role must be a str, got {m['role']!r}")
            if "content" not in m:
                raise PromptError(f"message {i} ({m['role']}) has no 'content'")
            m = dict(m)
            m["content"] = self._content(m["content"], i)
            out.append(m)
        return out

    @staticmethod
    def _content(c: Any, i: int) -> str:
        if c is None:
            return ""  # OpenAI: an assistant message with tool calls may have null content
        if isinstance(c, str):
            return check_text(c, f"message {i}")
        if isinstance(c, (list, tuple)):
            texts = []
            for j, part in enumerate(c):
                if isinstance(part, str):
                    texts.append(check_text(part, f"message {i}, content part {j}"))
                elif isinstance(part, Mapping) and part.get("type") == "text":
                    if not isinstance(part.get("text"), str):
                        raise PromptError(f"message {i}, content part {j}: 'text' must be a "
                                          f"str, got {part.get('text')!r}")
                    texts.append(check_text(part["text"], f"message {i}, content part {j}"))
                else:
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise PromptError(f"message {i}, content part {j}: type {kind!r} is not "
                                      f"supported (text only)")
            return "\n".join(texts)  # as vLLM joins text parts for string templates
        raise PromptError(f"message {i}: content must be a str or a list of content parts, "
                          f"got {type(c).__name__}")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """Render a conversation with the model's chat template (Hugging Face's semantics).
        ``messages``: [{"role", "content"}] where content is a str or OpenAI content parts
        ([{"type": "text", "text": ...}], joined with newlines); a message without role or
        content raises a PromptError naming its index. ``chat_template_kwargs`` are extra
        template variables (e.g. ``{"enable_thinking": False}`` for Qwen3)."""
        messages = self._messages(messages)
        if not isinstance(chat_template_kwargs or {}, Mapping):
            raise ParameterError(f"chat_template_kwargs must be a dict, got "
                                 f"{type(chat_template_kwargs).__name__}")
        extra = dict(chat_template_kwargs or {})
        reserved = {"messages", "add_generation_prompt"} & set(extra)
        if reserved:
            raise ParameterError(f"chat_template_kwargs must not set {sorted(reserved)}")
        try:
            return render_chat_template(self.model.tokenizer_config, messages,
                                        add_generation_prompt=add_generation_prompt, **extra)
        except TokenizerError as e:
            raise TokenizerError(f"{self.model.path}: {e}") from None

    def _control_tokens(self) -> ControlTokens:
        if self._controls is None:
            self._controls = ControlTokens(self.tokenizer)
        return self._controls

    def _encode_chat(self, text: str, messages: Any, split_special_tokens: bool = True,
                     add_generation_prompt: bool = True,
                     chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of ``text``, the rendering of ``messages``. The template's own control
        tokens stay control tokens; special-token strings inside message contents are plain
        text unless ``split_special_tokens`` is False. (The template already wrote any BOS.)"""
        msgs = self._messages(messages)
        ct = self._control_tokens()
        if not split_special_tokens or not any(ct.find(m["content"]) for m in msgs):
            return self.tokenizer.encode(text, add_special_tokens=False).ids

        def render_marked(markers: list[str]) -> str | None:
            marked = [dict(m, content=k) for m, k in zip(msgs, markers)]
            try:
                return self.apply_chat_template(marked, add_generation_prompt,
                                                chat_template_kwargs)
            except PromptError:
                return None

        spans = content_spans(text, [m["content"] for m in msgs], render_marked)
        return ct.encode_outside(text, spans)

    # ---- generation -----------------------------------------------------------------------
    def _completion(self, prompt: str | None, ids: list[int], gen: Generation,
                    outputs: list[CompletionOutput], elapsed: float) -> Completion:
        first = outputs[0]
        plp = None
        if gen.prompt_logprobs is not None:
            plp = [None] + [TokenLogprob(ids[i], self._token_text(ids[i]), e[0],
                                         [(t, self._token_text(t), lp) for t, lp in e[1]], e[2])
                            for i, e in enumerate(gen.prompt_logprobs[1:], start=1)
                            if e is not None]
        return Completion(
            text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason,
            prompt_token_ids=ids, backend=self.backend, elapsed_s=elapsed,
            decode_tokens_per_s=gen.stats.decode_tokens_per_s, prompt=prompt,
            logprobs=first.logprobs, prompt_logprobs=plp, stop_reason=first.stop_reason,
            outputs=outputs, reused_prompt_tokens=gen.stats.reused_tokens,
            launches=gen.stats.launches)

    def _start(self, prompt: str | None, ids: list[int], params: SamplingParams,
               seed: int | None = None) -> Stream:
        text = TextStop(TextStream(self.tokenizer, params.stop, min_tokens=params.min_tokens))
        gen = self.engine.generate(ids, params, seed=seed, text_stop=text)  # checks the prompt
        return Stream(self, gen, prompt, ids, params, text)

    def stream(self, prompt: str | Sequence[int] | Mapping[str, Any],
               params: SamplingParams | Mapping[str, Any] | None = None, *,
               add_special_tokens: bool = True) -> Stream:
        """Start a generation and return its :class:`Stream` (the prompt is checked now)."""
        params = self._params(params)
        if params.n != 1:
            raise ParameterError(f"streaming takes n=1, got n={params.n}")
        text, ids = self._prompt_ids(prompt, add_special_tokens)
        return self._start(text, ids, params)

    def _run_all(self, text: str | None, ids: list[int], params: SamplingParams) -> Completion:
        return self._run_batch([(text, ids, params)])[0]

    def _run_batch(self, requests: list[tuple[str | None, list[int], SamplingParams]]
                   ) -> list[Completion]:
        """Every request (and each of its ``n`` samples) started at once, then collected in
        order: on a batched executor they run as one batch (vLLM's semantics; each stream's
        tokens wait in its queue while another is drained), on a one-sequence executor one
        after another as each is drained."""
        t0 = time.perf_counter()
        started = [[self._start(text, ids, p, None if p.seed is None else p.seed + i)
                    for i in range(p.n)] for text, ids, p in requests]
        out = []
        try:
            for streams in started:
                outputs = []
                for i, s in enumerate(streams):
                    for _ in s.deltas():
                        pass
                    assert s.completion is not None
                    o = s.completion.outputs[0]
                    o.index = i
                    outputs.append(o)
                c = streams[0].completion
                assert c is not None
                c.outputs = outputs
                c.elapsed_s = time.perf_counter() - t0
                out.append(c)
        finally:
            for streams in started:  # an error or Ctrl-C: the rest give back their slots
                for s in streams:
                    if s.completion is None:
                        s.close()
        return out

    def generate(self, prompts: Any, sampling_params: Any = None, *,
                 add_special_tokens: bool = True, use_tqdm: bool = False,
                 params: Any = None) -> Completion | list[Completion]:
        """Generate for one prompt (-> Completion) or a list of prompts (-> list of
        Completion, run one after another). A prompt is a str, a list of token ids, or
        vLLM's {"prompt_token_ids": [...]} / {"prompt": str}; a list of token-id lists is a
        batch. ``sampling_params``: SamplingParams, a dict of its fields, None (the model's
        generation_config defaults), or a list with one per prompt. ``use_tqdm`` is accepted
        for vLLM code and shows nothing; ``params`` is an older name of sampling_params."""
        if params is not None:
            if sampling_params is not None:
                raise ParameterError("give sampling_params or params, not both")
            sampling_params = params
        # a batch is a list of prompts; a list of numbers is one prompt of token ids
        batch = (isinstance(prompts, (list, tuple)) and bool(prompts) and all(
            isinstance(p, (str, bytes, bytearray, Mapping, list, tuple, np.ndarray))
            for p in prompts))
        if not batch:
            if isinstance(sampling_params, (list, tuple)):
                if len(sampling_params) != 1:
                    raise ParameterError(f"one prompt takes one SamplingParams, got a list of "
                                         f"{len(sampling_params)}")
                sampling_params = sampling_params[0]
            text, ids = self._prompt_ids(prompts, add_special_tokens)
            return self._run_all(text, ids, self._params(sampling_params))
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ParameterError(f"{len(prompts)} prompts but {len(sampling_params)} "
                                     f"SamplingParams (give one, or one per prompt)")
            plist = [self._params(p) for p in sampling_params]
        else:
            plist = [self._params(sampling_params)] * len(prompts)
        # check every prompt before running any
        prepared = [self._prompt_ids(p, add_special_tokens) for p in prompts]
        for _, ids in prepared:
            self.engine.check_prompt(ids)
        return self._run_batch([(text, ids, p) for (text, ids), p in zip(prepared, plist)])

    def chat(self, messages: Any, sampling_params: Any = None, *, stream: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             add_generation_prompt: bool = True, split_special_tokens: bool = True,
             use_tqdm: bool = False, params: Any = None
             ) -> Completion | Stream | list[Completion]:
        """Reply to a conversation (a list of {"role", "content"} messages; see
        ``apply_chat_template``), or to each of a list of conversations (-> list). Special
        tokens typed in message contents (``<|im_end|>``) are plain text, never control
        tokens, unless ``split_special_tokens=False``. ``stream=True`` returns a Stream."""
        if params is not None:
            sampling_params = params
        if (isinstance(messages, (list, tuple)) and messages
                and all(isinstance(m, (list, tuple)) for m in messages)):
            if stream:
                raise ParameterError("stream=True takes one conversation, got a list of "
                                     f"{len(messages)}")
            plist = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                     else [sampling_params] * len(messages))
            if len(plist) != len(messages):
                raise ParameterError(f"{len(messages)} conversations but {len(plist)} "
                                     f"SamplingParams")
            ids_list = [self.chat_prompt_ids(m, add_generation_prompt, chat_template_kwargs,
                                             split_special_tokens) for m in messages]
            return self._run_batch([(None, ids, self._params(p))
                                    for ids, p in zip(ids_list, plist)])
        ids = self.chat_prompt_ids(messages, add_generation_prompt, chat_template_kwargs,
                                   split_special_tokens)
        p = self._params(sampling_params)
        if stream:
            if p.n != 1:
                raise ParameterError(f"streaming takes n=1, got n={p.n}")
            return self._start(None, ids, p)
        return self._run_all(None, ids, p)

    def chat_prompt_ids(self, messages: Any, add_generation_prompt: bool = True,
                        chat_template_kwargs: dict[str, Any] | None = None,
                        split_special_tokens: bool = True) -> list[int]:
        """The token ids ``chat`` feeds the model for ``messages``."""
        text = self.apply_chat_template(messages, add_generation_prompt, chat_template_kwargs)
        return self._encode_chat(text, messages, split_special_tokens, add_generation_prompt,
                                 chat_template_kwargs)


def fit_conversation(llm: Any, messages: list[dict[str, Any]], reserve: int
                     ) -> tuple[list[dict[str, Any]], int]:
    """Drop the oldest turns (never a leading system message, never the last message) until
    the rendered conversation leaves ``reserve`` positions of the context for the reply.
    Returns (the kept messages, how many were dropped). Raises PromptError when even the last
    message alone does not fit."""
    head = [m for m in messages[:1] if m.get("role") == "system"]
    rest = messages[len(head):]
    limit = llm.max_seq_len - max(reserve, 1)
    dropped = 0
    while True:
        kept = head + rest
        n = len(llm.chat_prompt_ids(kept))
        if n <= limit:
            return kept, dropped
        if len(rest) <= 1:
            raise PromptError(f"the last message alone takes {n} tokens; the context holds "
                              f"{llm.max_seq_len} with {reserve} kept for the reply")
        # drop the oldest turn: a user message and the replies up to the next user message
        k = 1
        while k < len(rest) - 1 and rest[k].get("role") != "user":
            k += 1
        rest = rest[k:]
        dropped += k


__all__ = ["LLM", "Completion", "CompletionOutput", "Stream", "Delta", "TokenLogprob", "Logprob",
           "Tokenizer", "fit_conversation"]
