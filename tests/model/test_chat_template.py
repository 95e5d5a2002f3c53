"""Chat templates: the real templates of SmolLM2, Qwen2.5, Qwen3 and Llama-3.2 (tests/data/
chat_templates.json) rendered by monokernel.model.chat_template against transformers'
``apply_chat_template`` on a tokenizer built here with the same special tokens; template options
(Qwen3's enable_thinking, Llama's date_string, tools); the helpers (raise_exception,
strftime_now, tojson); and bad input."""

from __future__ import annotations

import copy
import json
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from monokernel.errors import PromptError, TokenizerError
from monokernel.model.chat_template import render_chat_template

DATA = Path(__file__).parents[1] / "data"  # tests/data
TEMPLATES = json.loads((DATA / "chat_templates.json").read_text())
MODELS = ["smollm2", "qwen2.5", "qwen3", "llama3.2"]

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> in a city, \"quoted\" & naïve",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CHATS = {
    "user": [{"role": "user", "content": "What is 2+2?"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a prime, in 日本語 too.\n"}],
    "assistant_with_thinking": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"}],
    "reasoning_field": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "small sums"}],
}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny, 21 C"}]


def hf_tokenizer(model: str):
    """A transformers tokenizer with the model's template and special tokens, built here."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    entry = TEMPLATES[model]
    specials = {k: entry[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                if entry.get(k) is not None}
    vocab = {t: i for i, t in enumerate(dict.fromkeys(["[UNK]", *specials.values()]))}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), **specials)
    tok.chat_template = entry["chat_template"]
    return tok


def theirs(model: str, messages, **kwargs) -> str:
    return hf_tokenizer(model).apply_chat_template(copy.deepcopy(messages), tokenize=False,
                                                   **kwargs)


def ours(model: str, messages, **kwargs) -> str:
    return render_chat_template(TEMPLATES[model], copy.deepcopy(messages), **kwargs)


# ==== the four real templates against transformers =================================================

@pytest.mark.parametrize("chat", CHATS, ids=CHATS.keys())
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "nogen"])
def test_matches_transformers(model, chat, gen):
    kwargs = {"date_string": "26 Jul 2024"} if model == "llama3.2" else {}
    want = theirs(model, CHATS[chat], add_generation_prompt=gen, **kwargs)
    got = ours(model, CHATS[chat], add_generation_prompt=gen, **kwargs)
    assert got == want
    assert len(got) > 20


@pytest.mark.parametrize("model", ["qwen2.5", "qwen3", "llama3.2"])
def test_tools_match_transformers(model):
    kwargs = {"date_string": "26 Jul 2024"} if model == "llama3.2" else {}
    messages = TOOL_CHAT[:1] if model == "llama3.2" else TOOL_CHAT
    want = theirs(model, messages, tools=[TOOL], add_generation_prompt=True, **kwargs)
    got = ours(model, messages, tools=[TOOL], add_generation_prompt=True, **kwargs)
    assert got == want
    # tojson as transformers defines it: no HTML escapes, non-ASCII kept
    assert 'Weather <now> in a city, \\"quoted\\" & naïve' in got


@pytest.mark.parametrize("thinking", [False, True, None])
def test_qwen3_enable_thinking(thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    got = ours("qwen3", CHATS["user"], **kwargs)
    assert got == theirs("qwen3", CHATS["user"], add_generation_prompt=True, **kwargs)
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert got.endswith(empty_think) is (thinking is False)
    assert got.endswith("<|im_start|>assistant\n") is (thinking is not False)


def test_smollm2_fixture_is_the_bundled_gguf_template():
    import gguf

    from monokernel.model.bundled import bundled_gguf_path

    reader = gguf.GGUFReader(bundled_gguf_path())
    assert TEMPLATES["smollm2"]["chat_template"] == \
        reader.fields["tokenizer.chat_template"].contents()


def test_smollm2_expected_text():
    """Spelled out once: the default system prompt, ChatML turns, the generation prompt."""
    assert ours("smollm2", CHATS["user"]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_llama_strftime_now_and_bos():
    """Without date_string, Llama-3.2's template asks strftime_now for today's date; bos_token
    comes from the tokenizer config."""
    before = datetime.now()
    got = ours("llama3.2", CHATS["user"])
    after = datetime.now() + timedelta(seconds=1)
    dates = {d.strftime("%d %b %Y") for d in (before, after)}
    assert any(f"Today Date: {d}\n" in got for d in dates)
    assert got.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert got.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_keyword_overrides_special_token():
    got = ours("llama3.2", CHATS["user"], bos_token="<BOS>", date_string="1 Jan 2025")
    assert got.startswith("<BOS><|start_header_id|>") and "Today Date: 1 Jan 2025\n" in got


# ==== helpers and bad input ========================================================================

def test_raise_exception_is_a_prompt_error():
    """Llama-3.2's template refuses two tool calls in one message, via raise_exception."""
    from jinja2.exceptions import TemplateError

    two = [TOOL_CHAT[0], dict(TOOL_CHAT[1], tool_calls=TOOL_CHAT[1]["tool_calls"] * 2)]
    with pytest.raises(TemplateError, match="single tool-calls"):
        theirs("llama3.2", two, add_generation_prompt=True, date_string="x")
    with pytest.raises(PromptError, match="rejects these messages: This model only supports "
                                          "single tool-calls at once!"):
        ours("llama3.2", two, date_string="x")


def test_tojson_filter_and_generation_block():
    tc = {"chat_template": "{% generation %}{{ x | tojson }}|{{ x | tojson(indent=2) }}"
                           "{% endgeneration %}{% for m in messages %}{% if loop.index > 1 %}"
                           "{% break %}{% endif %}{{ m.role }}{% endfor %}"}
    x = {"a": "<é>&'", "b": [1, 2]}
    got = render_chat_template(tc, [{"role": "u"}, {"role": "v"}], x=x)
    assert got == json.dumps(x, ensure_ascii=False) + "|" + \
        json.dumps(x, ensure_ascii=False, indent=2) + "u"


def test_named_templates_list_uses_default():
    tc = {"chat_template": [{"name": "tool_use", "template": "T"},
                            {"name": "default", "template": "D{{ messages|length }}"}]}
    assert render_chat_template(tc, [{"role": "user", "content": "x"}]) == "D1"
    with pytest.raises(TokenizerError, match="tool_use.*none called 'default'"):
        render_chat_template({"chat_template": tc["chat_template"][:1]}, [])


@pytest.mark.parametrize("tc", [{}, {"chat_template": ""}, {"chat_template": None}])
def test_missing_template(tc):
    with pytest.raises(TokenizerError, match="no chat template"):
        render_chat_template(tc, CHATS["user"])


def test_template_that_does_not_compile_names_the_line():
    with pytest.raises(TokenizerError, match=r"does not compile.*line 2"):
        render_chat_template({"chat_template": "ok\n{% for m in messages %}"}, CHATS["user"])


@pytest.mark.parametrize("messages,match", [
    ("hello", "list of dicts, not a str"),
    ([{"content": "no role"}], "message 0 is not a dict with a 'role'"),
    ([{"role": "user", "content": "a"}, "b"], "message 1 is not a dict"),
])
def test_bad_messages(messages, match):
    with pytest.raises(PromptError, match=match):
        ours("smollm2", messages)


def test_template_error_on_messages_is_a_prompt_error():
    """Qwen2.5's template concatenates message.content: a missing content fails in the template,
    reported as a PromptError, not a raw jinja2 traceback."""
    with pytest.raises(PromptError, match="chat template failed"):
        ours("qwen2.5", [{"role": "user", "content": None}])


@pytest.mark.parametrize("template", ["{{ messages.__class__.__mro__ }}",
                                      "{{ messages.append(1) }}"])
def test_sandboxed(template):
    """A template is downloaded code: no dunder access, no mutation of what it is given."""
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(PromptError, match="SecurityError: access to attribute"):
        render_chat_template({"chat_template": template}, messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_callers_messages_unchanged():
    messages = copy.deepcopy(CHATS["reasoning_field"])
    render_chat_template(TEMPLATES["qwen3"], messages)
    assert messages == CHATS["reasoning_field"]
