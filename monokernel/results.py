"""What a generation returns: ``Completion`` (with vLLM's shape too: ``outputs[0].text``),
``CompletionOutput``, the stream's ``Delta``, ``TokenLogprob`` and vLLM's ``Logprob``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: one token's log-probability, its 1-based rank in the model's
    distribution (1: the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(eq=False)
class TokenLogprob(Mapping):
    """One position's log-probabilities: the token there (``token`` is its text), its logprob
    under the model's raw distribution and its rank in it (1: the most likely), and the top-N
    alternatives (token_id, text, logprob), best first (the token itself is among them when it
    ranks in the top N).

    It also reads as vLLM's entry, a dict of token id -> :class:`Logprob` holding the token
    and its alternatives, so that code written for vLLM runs as pasted:
    ``out.logprobs[i][token_id].logprob``, ``.items()``, ``in``, ``len``."""

    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)
    rank: int | None = None

    def __getitem__(self, token_id: int) -> Logprob:
        if token_id == self.token_id:
            return Logprob(self.logprob, self.rank, self.token)
        for k, (t, text, lp) in enumerate(self.top):
            if t == token_id:
                return Logprob(lp, k + 1, text)
        raise KeyError(f"token {token_id} is neither the token at this position "
                       f"({self.token_id}) nor among its top {len(self.top)} alternatives")

    def __iter__(self) -> Iterator[int]:  # vLLM's order: the token, then the alternatives
        return iter(dict.fromkeys([self.token_id] + [t for t, _, _ in self.top]))

    def __len__(self) -> int:
        return len(dict.fromkeys([self.token_id] + [t for t, _, _ in self.top]))

    def __eq__(self, other: object) -> bool:  # as a dataclass, not as a dict of Logprobs
        if not isinstance(other, TokenLogprob):
            return NotImplemented
        return (self.token_id, self.token, self.logprob, self.top, self.rank) == \
            (other.token_id, other.token, other.logprob, other.top, other.rank)

    __hash__ = None  # mutable, as a dataclass with eq


@dataclass
class Delta:
    """One step of a stream: the new text piece (may be "": text is held back while it could
    still be a split character, grapheme or the start of a stop string), the tokens generated
    in this step, and one TokenLogprob per token when logprobs were asked for (else None)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass
class CompletionOutput:
    """One completion of a prompt, as vLLM's ``RequestOutput.outputs[i]``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    generated_tokens: int = 0  # tokens the model produced, a final stop token included


@dataclass
class Completion:
    """The result of one prompt.

    - ``text``, ``token_ids`` (generated, without a final stop token), ``finish_reason``
      ("stop": EOS, a stop id or a stop string; "length": max_new_tokens or the context end;
      "abort": the stream was closed), ``stop_reason``: the stop string or stop token id that
      ended it (None for EOS and for "length"), as vLLM means it.
    - ``prompt`` (the text, None for a token-id prompt), ``prompt_token_ids``.
    - ``logprobs``: one TokenLogprob per generated token, when SamplingParams.logprobs is set;
      ``prompt_logprobs``: one per prompt token (None for the first), when prompt_logprobs is.
    - ``outputs``: the vLLM shape, one CompletionOutput per sample (``n``); the fields above are
      ``outputs[0]``'s. ``usage()``: OpenAI's token counts.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int] = field(default_factory=list)
    backend: str = ""
    elapsed_s: float = 0.0
    decode_tokens_per_s: float = float("nan")
    prompt: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: str | int | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    reused_prompt_tokens: int = 0  # prompt tokens whose K/V came from the previous sequence
    launches: int = 0  # kernel launches of the generation (one for the whole of it when the
    #                    kernel samples; numpy: 0)

    def __str__(self) -> str:
        return self.text

    # vLLM returns a list even for one prompt; so that pasted code which indexes or iterates
    # that result (``llm.generate("Hi", sp)[0].outputs[0].text``) runs, a Completion also
    # reads as a list holding itself.
    def __getitem__(self, i: int) -> "Completion":
        if i in (0, -1):
            return self
        raise IndexError(f"a single prompt's Completion holds one result, not index {i}")

    def __len__(self) -> int:
        return 1

    def __iter__(self):
        return iter((self,))

    @property
    def finished(self) -> bool:
        return all(o.finish_reason != "abort" for o in self.outputs)

    def usage(self) -> dict[str, int]:
        """{"prompt_tokens", "completion_tokens", "total_tokens"}; completion tokens count a
        final stop token (the model generated it) over all outputs."""
        p = len(self.prompt_token_ids)
        c = sum(o.generated_tokens for o in self.outputs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
