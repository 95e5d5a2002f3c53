"""The ops of the decode step, one module each: its named argument words (``ARGS``), how it
tiles over the blocks (``tile``) and what it costs (``cost``, for the cost model). Its device
code is the section of megakernel.cu named after it (``// Op: <NAME>``), with its prefetch in
``prefetch_weights``; docs/adding-an-op.md lists every place an op touches.

A module declares OP (isa.Op), ARGS (isa.Args), SIGNALS (whether its instructions signal a
counter of their own; the LM head ends the step by a ticket instead), ``tile(plan, layer)``
(one Instruction per block) and ``cost(batch, gpu, design)`` (costmodel Phases)."""

from __future__ import annotations

from types import ModuleType

from ..isa import Args, Op
from . import attention, down, embed, gate_up, lm_head, o_proj, qkv

MODULES: dict[Op, ModuleType] = {m.OP: m for m in (embed, qkv, attention, o_proj, gate_up,
                                                    down, lm_head)}
_missing = [op.name for op in Op if op != Op.NOOP and op not in MODULES]
if _missing:
    raise ImportError(f"kernel/ops has no module for op(s) {', '.join(_missing)}: every isa.Op "
                      "but NOOP is one module here")

_NO_ARGS = Args()


def module(op: Op) -> ModuleType:
    return MODULES[Op(op)]


def args(op: Op) -> Args:
    """The named argument words of ``op`` (NOOP has none)."""
    return _NO_ARGS if op == Op.NOOP else MODULES[Op(op)].ARGS
