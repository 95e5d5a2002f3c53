"""The op is the unit of the kernel wing (kernel/ops/): every isa.Op has one module with its
named argument words, its tiling and its cost entry, and one section of megakernel.cu; the
kernel reads an instruction's argument words only by the names its op declares
(A_<OP>_<NAME>, rendered by header.render_header), never as W_ARGn."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from monokernel.errors import ProgramError
from monokernel.kernel import ops
from monokernel.kernel.header import render_header
from monokernel.kernel.isa import ARG_WORDS, Args, Op, Word
from monokernel.kernel.schedule import schedule
from monokernel.model.config import ModelConfig

SOURCE = (Path(ops.__file__).parent.parent / "megakernel.cu").read_text()
TINY = ModelConfig.from_name("tiny")
NAME = re.compile(r"\bA_([A-Z0-9_]+)\b")


def arg_names() -> dict[str, Op]:
    """Every rendered argument name -> its op."""
    return {f"{op.name}_{n.upper()}": op for op in Op if op != Op.NOOP
            for n in ops.args(op).names}


def sections() -> dict[str, str]:
    """The kernel's op sections ("// Op: NAME - ..." to the next section header)."""
    # a header opens with a rule after a blank line (its closing rule follows a comment line)
    parts = re.split(r"(?<=\n\n)// =+\n// (.*)\n", SOURCE)
    out = {}
    for title, body in zip(parts[1::2], parts[2::2]):
        m = re.match(r"Op: ([A-Z_]+) - ", title)
        if m:
            out[m.group(1)] = body
    return out


def prefetch_cases() -> dict[str, str]:
    """prefetch_weights' switch: op name -> the code of its case."""
    body = SOURCE[SOURCE.index("void prefetch_weights("):]
    body = body[:body.index("\n}\n")]
    parts = re.split(r"^\s*case OP_([A-Z_]+):", body, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_op_is_one_module_and_one_section():
    secs = sections()
    for op in Op:
        if op == Op.NOOP:
            continue
        m = ops.module(op)
        assert m.OP == op and isinstance(m.ARGS, Args)
        assert callable(m.tile) and callable(m.cost) and isinstance(m.SIGNALS, bool)
        assert op.name in secs, f"megakernel.cu has no section '// Op: {op.name} - '"
    assert set(secs) == {op.name for op in Op if op != Op.NOOP}


def test_the_kernel_reads_no_positional_argument_word():
    assert not re.search(r"\bW_ARG\d", SOURCE), "read arguments by name (A_<OP>_<NAME>)"


def test_each_section_reads_only_its_own_ops_arguments():
    names = arg_names()
    used = set()
    for where, code in [(f"section {k}", v) for k, v in sections().items()] + \
            [(f"prefetch case {k}", v) for k, v in prefetch_cases().items()]:
        op = where.split()[-1]
        for name in NAME.findall(code):
            assert name in names, f"{where} reads A_{name}, which no op declares"
            assert names[name].name == op, f"{where} reads A_{name}, an argument of " \
                                            f"{names[name].name}"
            used.add(name)
    # and nothing outside the op sections and their prefetch cases reads one
    outside = SOURCE
    for code in list(sections().values()) + list(prefetch_cases().values()):
        outside = outside.replace(code, "")
    assert not NAME.findall(outside), NAME.findall(outside)
    # a declared argument the kernel never reads is dead weight in every instruction
    assert used == set(names), sorted(set(names) - used)


def test_the_header_renders_every_argument_at_its_word():
    h = render_header(TINY, 64)
    for op in Op:
        if op == Op.NOOP:
            continue
        for k, n in enumerate(ops.args(op).names):
            assert f"  A_{op.name}_{n.upper()} = W_ARG{k}," in h
        assert len(ops.args(op).names) <= ARG_WORDS


def test_instructions_carry_their_ops_named_arguments():
    prog = schedule(TINY, 3, 64, attn_splits=3, merge_ticket_min=2)
    lm = prog.queues[2][-1]
    assert lm.op == Op.RMS_LM_HEAD and lm.arg("slot") == 2 and lm.arg("tickets") == 3
    assert prog.words()[2, -1, ops.args(Op.RMS_LM_HEAD).word("ticket")] == lm.arg("ticket")
    att = next(i for i in prog.queues[0] if i.op == Op.ATTENTION)
    assert att.arg("splits") == 3 and att.arg("merge_min") == prog.merge_ticket_min
    with pytest.raises(ProgramError, match="no argument 'slot'.*splits"):
        att.arg("slot")
    with pytest.raises(ProgramError, match="no argument 'bogus'"):
        ops.args(Op.ATTENTION).pack({"bogus": 1})
    with pytest.raises(ProgramError, match="this op's: none"):
        next(i for i in prog.queues[0] if i.op == Op.EMBED).arg("slot")
    assert Word.ARG0 + len(ops.args(Op.ATTENTION).names) - 1 <= Word.ARG4


@pytest.mark.parametrize("splits,min_chunk", [(1, 1), (3, 1), (8, 1), (16, 64), (16, 128)])
def test_the_split_geometry_is_one_function(splits, min_chunk):
    """isa.split_chunk / splits_used (what megakernel.cu computes, the cost model and the tests
    read): split s covers [s * chunk, (s + 1) * chunk) of n_pos; the used ones are those with a
    position; every position is in exactly one split."""
    from monokernel.kernel.isa import split_chunk, splits_used

    for n_pos in (1, 2, 7, 63, 64, 65, 128, 129, 1000, 2048):
        chunk = split_chunk(n_pos, splits, min_chunk)
        ranges = [(s * chunk, min(n_pos, (s + 1) * chunk)) for s in range(splits)]
        assert sum(max(0, b - a) for a, b in ranges) == n_pos
        assert splits_used(n_pos, splits, min_chunk) == sum(1 for a, b in ranges if b > a)
        assert chunk >= min_chunk
