"""Chat that lasts: the K/V cache of the prefix shared with the previous sequence is reused
(counted prefill tokens, equal outputs with and without reuse, on numpy and the emulator),
chat_template_kwargs reach the template, the conversation is trimmed when the context fills,
and in ``monokernel chat`` Ctrl-C stops the reply and returns to the prompt (a fake LLM for
the loop, and a real SIGINT to a real process)."""

from __future__ import annotations

import io
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from monokernel import LLM, ParameterError, PromptError, SamplingParams
from monokernel.cli import chat_loop
from monokernel.llm import fit_conversation

from helpers.kernel import MAX_SEQ  # the emulator build of this length is shared
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(synth_dir):
    # page_size=1: every prompt position is a page of the prefix cache, so reuse is counted
    # in tokens; the default pages of 16 are tests/api/test_prefix_reuse.py's
    return LLM(synth_dir("tiny"), backend="numpy", max_seq_len=MAX_SEQ, progress=False,
               page_size=1)


# ==== prefix reuse ==============================================================================

def test_chat_turns_prefill_only_the_new_tokens(bundled_llm):
    llm = bundled_llm
    p = SamplingParams(max_tokens=8)
    turn1 = [{"role": "user", "content": "What is the capital of France?"}]
    c1 = llm.chat(turn1, p)
    turn2 = turn1 + [{"role": "assistant", "content": c1.text},
                     {"role": "user", "content": "And of Italy?"}]
    c2 = llm.chat(turn2, p)
    st = llm.engine.stats
    # the numpy backend reuses the whole K/V pages of the first prompt (the prefix cache keeps
    # prompt pages only: the reply's K/V came from decode steps, which may run alone)
    chunk = llm.engine.batcher.pool.page_size
    n1 = len(c1.prompt_token_ids)
    assert n1 >= chunk
    assert c2.reused_prompt_tokens == st.reused_tokens == n1 - n1 % chunk
    assert st.prefill_tokens == len(c2.prompt_token_ids) - st.reused_tokens
    assert st.prefill_tokens < len(c2.prompt_token_ids) // 2
    # the same answer without reuse
    llm.engine.prefix_caching = False
    try:
        again = llm.chat(turn2, p)
    finally:
        llm.engine.prefix_caching = True
    assert again.reused_prompt_tokens == 0 and llm.engine.stats.prefill_tokens == \
        len(c2.prompt_token_ids)
    assert again.token_ids == c2.token_ids


def test_reuse_on_the_kernel_backend_gives_the_same_logprobs(synth_dir):
    emu = LLM(synth_dir("tiny"), backend="emulator", blocks=2, max_seq_len=MAX_SEQ,
              progress=False)
    p = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2)
    a = [5, 6, 7, 300, 41]
    first = emu.generate(a, p)
    longer = a + first.token_ids + [77, 78]
    reused = emu.generate(longer, p)
    assert reused.reused_prompt_tokens == len(a) + 2  # 2 of the 3 tokens were fed
    assert emu.engine.stats.prefill_tokens == 3
    emu.engine.prefix_caching = False
    fresh = emu.generate(longer, p)
    assert fresh.reused_prompt_tokens == 0
    assert fresh.token_ids == reused.token_ids
    # bit for bit: every position of the kernel's cache is computed by the same one-token step
    assert [t.logprob for t in fresh.logprobs] == [t.logprob for t in reused.logprobs]


def test_the_executor_s_own_steps_do_not_touch_the_engine_s_pages(tiny):
    """The batched engine's cache is its page pool: the executor's one-sequence ``step`` (a
    tool's, a test's) writes its own pages, so the prefix cache stays right and is reused."""
    a = [5, 6, 7, 300, 41]
    want = tiny.generate(a, GREEDY)
    tiny.engine.executor.step(9, 0)  # position 0 of the executor's own sequence
    got = tiny.generate(a, GREEDY)
    # the same prompt reuses all but its last token (pages of one position here)
    assert got.reused_prompt_tokens == len(a) - 1 and got.token_ids == want.token_ids


def test_prompt_logprobs_prefill_everything(tiny):
    a = [5, 6, 7, 300, 41]
    tiny.generate(a, GREEDY)
    c = tiny.generate(a, GREEDY.replace(prompt_logprobs=1))
    assert c.reused_prompt_tokens == 0 and len(c.prompt_logprobs) == len(a)


def test_a_divergent_prompt_reuses_the_common_part(tiny):
    tiny.generate([5, 6, 7, 8, 9], GREEDY)
    c = tiny.generate([5, 6, 70, 8, 9], GREEDY)
    assert c.reused_prompt_tokens == 2
    tiny.engine.prefix_caching = False
    try:
        assert tiny.generate([5, 6, 70, 8, 9], GREEDY).token_ids == c.token_ids
    finally:
        tiny.engine.prefix_caching = True


# ==== chat template variables ===================================================================

def test_chat_template_kwargs_reach_the_template(synth_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(synth_dir("tiny"), d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
        "{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    llm = LLM(d, backend="numpy", max_seq_len=64, progress=False)
    msgs = [{"role": "user", "content": "hi"}]
    assert not llm.apply_chat_template(msgs).endswith("<think></think>")
    off = llm.apply_chat_template(msgs, chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("assistant\n<think></think>")
    c = llm.chat(msgs, GREEDY, chat_template_kwargs={"enable_thinking": False})
    assert llm.detokenize(c.prompt_token_ids) == off
    with pytest.raises(ParameterError, match="add_generation_prompt"):
        llm.apply_chat_template(msgs, chat_template_kwargs={"add_generation_prompt": False})


def test_template_errors_are_prompt_errors(synth_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(synth_dir("tiny"), d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = ("{% if messages[0].role != 'user' %}"
                           "{{ raise_exception('the first message must be the user') }}"
                           "{% endif %}{{ messages[0].content }}")
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    llm = LLM(d, backend="numpy", max_seq_len=64, progress=False)
    with pytest.raises(PromptError, match="first message must be the user"):
        llm.chat([{"role": "assistant", "content": "x"}], GREEDY)


# ==== a conversation that outgrows the context ==================================================

def test_fit_conversation_drops_the_oldest_turns(synth_dir):
    llm = LLM(synth_dir("tiny"), backend="numpy", max_seq_len=64, progress=False)
    sys_msg = {"role": "system", "content": "be brief"}
    turns = []
    for i in range(6):
        turns += [{"role": "user", "content": f"question {i} " * 2},
                  {"role": "assistant", "content": f"answer {i}"}]
    msgs = [sys_msg] + turns + [{"role": "user", "content": "last one"}]
    kept, dropped = fit_conversation(llm, msgs, reserve=8)
    assert dropped > 0 and dropped % 2 == 0  # whole turns
    assert kept[0] == sys_msg and kept[-1] == msgs[-1] and kept[1:] == msgs[1 + dropped:]
    assert len(llm.chat_prompt_ids(kept)) <= 64 - 8
    # one turn fewer dropped would not have fitted
    assert len(llm.chat_prompt_ids([sys_msg] + msgs[dropped - 1:])) > 64 - 8
    # a short conversation is left alone
    assert fit_conversation(llm, msgs[-1:], 8) == (msgs[-1:], 0)
    with pytest.raises(PromptError, match="last message alone"):
        fit_conversation(llm, [{"role": "user", "content": "word " * 80}], 8)


class FakeStream:
    def __init__(self, pieces, interrupt_at=None):
        self.pieces, self.interrupt_at = pieces, interrupt_at
        self.shown, self.completion, self.closed = [], None, False

    def __iter__(self):
        for i, p in enumerate(self.pieces):
            if i == self.interrupt_at:
                raise KeyboardInterrupt  # what Ctrl-C raises in the middle of a reply
            self.shown.append(p)
            yield p
        self.completion = SimpleNamespace(text="".join(self.shown))

    def close(self):
        self.closed = True
        self.completion = SimpleNamespace(text="".join(self.shown))


class FakeLLM:
    """One token per character; the first reply is interrupted after two pieces."""

    def __init__(self, max_seq_len=1000, interrupt=True):
        self.max_seq_len = max_seq_len
        self.calls, self.streams = [], []
        self.interrupt = interrupt

    def chat_prompt_ids(self, messages):
        return [0] * sum(len(m["content"]) for m in messages)

    def chat(self, messages, params, stream=False):
        assert stream
        self.calls.append([dict(m) for m in messages])
        first = self.interrupt and len(self.calls) == 1
        s = FakeStream(["Once", " upon", " a", " time"], 2 if first else None)
        self.streams.append(s)
        return s


def lines(*xs):
    it = iter(xs)

    def read(prompt):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return read


def test_ctrl_c_stops_the_reply_and_returns_to_the_prompt():
    llm, out, err = FakeLLM(), io.StringIO(), io.StringIO()
    rc = chat_loop(llm, SamplingParams(max_tokens=10), "sys", read=lines("hello", "again"),
                   out=out, err=err)
    assert rc == 0
    assert llm.streams[0].closed and "[stopped]" in err.getvalue()
    assert out.getvalue() == "Once upon\nOnce upon a time\n"
    # the part shown is kept as the assistant's turn; the next question follows it
    assert llm.calls[1] == [{"role": "system", "content": "sys"},
                            {"role": "user", "content": "hello"},
                            {"role": "assistant", "content": "Once upon"},
                            {"role": "user", "content": "again"}]


def script(*xs):
    """A read() that plays ``xs``: a str is a line typed, KeyboardInterrupt a Ctrl-C; EOF after."""
    it = iter(xs)

    def read(prompt):
        x = next(it, EOFError)
        if isinstance(x, str):
            return x
        raise x
    return read


def test_ctrl_c_at_the_prompt_asks_and_a_second_one_leaves():
    llm, err = FakeLLM(interrupt=False), io.StringIO()
    read = script(KeyboardInterrupt, KeyboardInterrupt, "never read")
    assert chat_loop(llm, SamplingParams(), read=read, out=io.StringIO(), err=err) == 0
    assert "leave the chat? Ctrl-C again" in err.getvalue() and llm.calls == []


def test_ctrl_c_at_the_prompt_then_typing_goes_on():
    """A stray Ctrl-C (one meant for a reply that had just ended) keeps the conversation; the
    question is asked again after every answer, not only the first time."""
    llm, err = FakeLLM(interrupt=False), io.StringIO()
    read = script(KeyboardInterrupt, "hello", KeyboardInterrupt, "again", KeyboardInterrupt)
    assert chat_loop(llm, SamplingParams(max_tokens=10), read=read, out=io.StringIO(),
                     err=err) == 0  # the EOF after the last Ctrl-C leaves
    assert [c[-1]["content"] for c in llm.calls] == ["hello", "again"]
    assert err.getvalue().count("leave the chat?") == 3


def test_a_full_context_drops_the_oldest_turn_with_a_notice():
    # 40 positions, 10 kept for the reply: 30 characters of conversation
    llm, out, err = FakeLLM(max_seq_len=40, interrupt=False), io.StringIO(), io.StringIO()
    chat_loop(llm, SamplingParams(max_tokens=10), read=lines("a" * 12, "b" * 12, "c" * 40),
              out=out, err=err)
    assert llm.calls[0] == [{"role": "user", "content": "a" * 12}]
    # turn 2 would be 12 + 16 + 12 = 40 > 30: the first question and answer go
    assert llm.calls[1] == [{"role": "user", "content": "b" * 12}]
    assert "[context full: dropped the 2 oldest messages]" in err.getvalue()
    # a message that cannot fit alone is not sent, and the loop goes on
    assert len(llm.calls) == 2 and "message not sent" in err.getvalue()


def test_sigint_to_monokernel_chat_stops_the_reply(bundled_dir):
    """A real Ctrl-C (SIGINT) to a real ``monokernel chat`` in the middle of a reply, twice:
    each time the reply stops and the prompt comes back; Ctrl-D then leaves with 0."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]),
           "PYTHONUNBUFFERED": "1"}
    # The chat as a terminal starts it: SIGINT raising KeyboardInterrupt. A process started in
    # the background of a non-interactive shell (a CI script's `cmd &`) inherits SIGINT
    # ignored, and Python then leaves it ignored: the reply ran to its end and " [stopped]"
    # never came (seen twice; the faulthandler dump below showed the chat back at its prompt).
    # -X faulthandler: on a timeout the test aborts the chat, which then writes every thread's
    # stack to stderr.
    start_chat = ("import runpy, signal, sys; "
                  "signal.signal(signal.SIGINT, signal.default_int_handler); "
                  "sys.argv = ['monokernel', 'chat', '--backend', 'numpy', "
                  "'--max-new-tokens', '400']; "
                  "runpy.run_module('monokernel', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", start_chat],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    chunks: dict[str, queue.Queue] = {"out": queue.Queue(), "err": queue.Queue()}

    def pump(f, q):
        for b in iter(lambda: os.read(f.fileno(), 4096), b""):
            q.put(b.decode("utf-8", "replace"))

    for name, f in (("out", proc.stdout), ("err", proc.stderr)):
        threading.Thread(target=pump, args=(f, chunks[name]), daemon=True).start()
    got = {"out": "", "err": ""}

    def wait_for(name, pred, timeout=120):
        deadline = time.monotonic() + timeout
        while not pred(got[name]):
            try:
                got[name] += chunks[name].get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                proc.send_signal(signal.SIGABRT)  # faulthandler: the stacks, on stderr
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                time.sleep(0.5)  # the pumps' last reads
                for k in got:
                    while not chunks[k].empty():
                        got[k] += chunks[k].get()
                pytest.fail(f"timed out waiting on {name}: {got}")
    try:
        for k, line in enumerate([b"Write a very long story about a dragon who learns to fly.\n",
                                  b"Tell me more about the dragon, in detail.\n"], start=1):
            proc.stdin.write(line)
            proc.stdin.flush()
            start = len(got["out"])
            wait_for("out", lambda s: len(s[start:].replace("> ", "").strip()) >= 8)
            proc.send_signal(signal.SIGINT)
            wait_for("err", lambda s: s.count("[stopped]") == k)
            wait_for("out", lambda s: s.endswith("> "))  # back at the prompt
            assert proc.poll() is None
        proc.stdin.close()  # Ctrl-D at the prompt leaves
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    while not chunks["err"].empty():
        got["err"] += chunks["err"].get()
    assert "Traceback" not in got["err"]


def test_an_interrupted_reply_keeps_the_prefix_for_the_next_turn(tiny, monkeypatch):
    """Ctrl-C in the middle of a step: the prompt's pages are intact and reused (the
    prefix cache keeps prompt pages; the reply's tokens run again)."""
    a = [5, 6, 7, 300, 41]
    want = tiny.generate(a + [9], GREEDY)
    ex = tiny.engine.executor
    real, calls = ex.run_table, []

    def run_table(table):
        calls.append(len(table))
        if len(calls) == 4:  # the prompt's step, two decode steps, then Ctrl-C
            raise KeyboardInterrupt
        return real(table)

    monkeypatch.setattr(ex, "run_table", run_table)
    s = tiny.stream(a, GREEDY)
    with pytest.raises(KeyboardInterrupt):
        list(s)
    assert s.completion.finish_reason == "abort" and len(s.completion.token_ids) == 3
    monkeypatch.undo()
    fed = s.completion.token_ids[:2]
    got = tiny.generate(a + fed + [9], GREEDY)
    assert got.reused_prompt_tokens == len(a)
    assert tiny.engine.batcher.pool.in_use == 0  # the interrupted sequence gave its pages back
    tiny.engine.prefix_caching = False
    try:
        assert tiny.generate(a + fed + [9], GREEDY).token_ids == got.token_ids
    finally:
        tiny.engine.prefix_caching = True
    assert tiny.generate(a + [9], GREEDY).token_ids == want.token_ids
