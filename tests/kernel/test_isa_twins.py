"""The Python twins in isa.py of megakernel.cu's integer helpers give the kernel's values.

The scheduler, the verifier and the cost model decide where a step's attention units run and
which block merges what from isa.py's functions; the kernel decides it from its own helpers of
the same names. Each pair is one rule written twice across the Python/CUDA boundary, so here
the kernel's helpers, in the source as rendered for a model (its macros: MK_GROUP, D,
MK_SLOTS, MK_ROW_PARTS), are compiled for the CPU with a main that calls them over a grid of
inputs, and every value is compared with the twin's. The other tests hold the pairs together
only through whole steps (bitwise logits, the verifier), where a difference on an input no
test step reaches would go unseen."""

from __future__ import annotations

import itertools
import subprocess

import pytest

from monokernel.kernel import isa
from monokernel.kernel.emulator.build import compile_unit
from monokernel.kernel.executor import kernel_source
from monokernel.model.config import ModelConfig

# shapes with KV groups of 2 (head_dim 128), 3 and 4 (head_dim 64)
SHAPES = ("qwen3-0.6b", "smollm2-135m", "llama-3.2-1b")
ROTATIONS = ((1,), (3, 1, 4), (8, 8, 2), (5, 7, 3, 3, 6, 1), (2,) * 9)


def _cases(splits_max: int = 16) -> list[tuple[str, tuple[int, ...]]]:
    """(helper, arguments) over the inputs the scheduler and the kernel meet, edges included."""
    cases: list[tuple[str, tuple[int, ...]]] = []
    for n_pos, splits, least in itertools.product((0, 1, 2, 7, 16, 33, 100, 1023, 4096),
                                                  (1, 2, 3, 8, 13, 32), (1, 4, 16)):
        cases += [("split_chunk", (n_pos, splits, least)), ("splits_used", (n_pos, splits, least))]
    for used in range(1, 40):
        cases += [("merge_ways", (used,)), ("merge_row_lanes", (used,))]
        for least in (0, 1, 2, 5):
            cases += [("merge_by_ticket", (used, least)), ("unit_finishes", (used, least))]
            cases += [("row_finishes", (used, least, rot)) for rot in (0, 1)]
    for used, rows, splits in itertools.product(range(1, 9), (1, 2, 3, 5, 8, 13, 16, 31, 64, 128),
                                                range(1, splits_max + 1)):
        if used <= splits:
            cases.append(("segment_parts", (used, rows, splits)))
    for rows in (1, 2, 5, 16, 31, 128):
        for parts in range(1, min(rows, 9) + 1):
            cases += [("segment_part_of", (i, parts, rows)) for i in range(rows)]
    return cases


def _main(cases: list[tuple[str, tuple[int, ...]]]) -> str:
    """A main that prints each case's value, then each ROTATIONS sequence's rotations
    (split_slot / next_rotation at 16 splits), one line each."""
    lines = ["#include <cstdio>", "int main() {"]
    for name, args in cases:
        lines.append(f'  std::printf("%d\\n", (int){name}({", ".join(map(str, args))}));')
    for used in ROTATIONS:
        lines.append("  { int off = 0; for (int u : {%s}) { std::printf(\"%%d \", off); "
                     "off = next_rotation(off, u, 16); } std::printf(\"\\n\"); }" % ", ".join(map(str, used)))
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def _twin(cfg: ModelConfig, most_mtiles: int, name: str, args: tuple[int, ...]) -> int:
    """isa.py's value of the helper ``name`` (megakernel.cu segment_part_of: the part whose
    segment_part_rows hold row i)."""
    if name == "segment_parts":
        return isa.segment_parts(*args, cfg.group_size, most_mtiles)
    if name == "segment_part_of":
        i, parts, rows = args
        (part,) = [p for p in range(parts) if isa.segment_part_rows(p, parts, rows)[0] <= i
                   < isa.segment_part_rows(p, parts, rows)[1]]
        return part
    if name == "merge_row_lanes":
        return isa.merge_row_lanes(cfg, *args)
    return int(getattr(isa, name)(*args))


def _kernel_values(tmp_path, cfg: ModelConfig, cases, defines: tuple[str, ...] = ()) -> list[str]:
    """The kernel's values of ``cases`` (then the rotation lines), from a kernel of slots on
    tensor cores rendered for ``cfg``, compiled with ``defines``."""
    source = kernel_source(cfg, 64, tokens=16, slots=4, page_size=16, mma=True)
    exe = tmp_path / "twins"
    compile_unit(f'{source}\n#line 1 "twins_main"\n{_main(cases)}', ["-std=c++20", "-O0", "-pthread", *defines],
                 exe, "the isa twins driver", executable=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines()


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_helpers_give_their_python_twins_values(tmp_path, shape):
    cfg = ModelConfig.from_name(shape)
    cases = _cases()
    lines = _kernel_values(tmp_path, cfg, cases)
    assert len(lines) == len(cases) + len(ROTATIONS)
    wrong = [(name, args, got, _twin(cfg, isa.ROW_PART_MTILES, name, args))
             for (name, args), got in zip(cases, lines)
             if int(got) != _twin(cfg, isa.ROW_PART_MTILES, name, args)]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ (helper, args, kernel, isa), e.g. {wrong[:8]}"
    for used, line in zip(ROTATIONS, lines[len(cases):]):
        assert [int(v) for v in line.split()] == isa.row_rotations(list(used), 16), used


@pytest.mark.parametrize("most_mtiles", [0, 1, 2, 8])
def test_segment_parts_follow_the_row_parts_override(tmp_path, most_mtiles):
    """-DMK_ROW_PARTS (0: no parts) is isa.segment_parts' most_mtiles."""
    cfg = ModelConfig.from_name("smollm2-135m")
    cases = [c for c in _cases() if c[0] == "segment_parts"]
    lines = _kernel_values(tmp_path, cfg, cases, (f"-DMK_ROW_PARTS={most_mtiles}",))
    got = [int(v) for v in lines[:len(cases)]]
    assert got == [_twin(cfg, most_mtiles, name, args) for name, args in cases]
    # the override is live: with parts of at most one m-tile, some segment splits in several
    assert most_mtiles == 0 or max(got) > 1


MUTANTS = {  # a rule changed on the kernel's side only (the negative controls)
    "segment_parts": ("* MK_GROUP + 15) / 16 <= MK_ROW_PARTS", "* MK_GROUP + 15) / 16 < MK_ROW_PARTS"),
    "segment_part_of": ("return ((i + 1) * parts - 1) / rows;", "return (i * parts) / rows;"),
    "split_slot": ("s + off >= splits ? s + off - splits", "s + off > splits ? s + off - splits"),
}


@pytest.mark.parametrize("helper", sorted(MUTANTS))
def test_a_kernel_helper_changed_alone_is_caught(tmp_path, monkeypatch, helper):
    """The comparison fails when only the kernel's side of a rule changes."""
    from monokernel.kernel import executor

    old, new = MUTANTS[helper]
    rendered = executor.kernel_source

    def mutated(*args, **kwargs):
        source = rendered(*args, **kwargs)
        assert source.count(old) == 1, helper
        return source.replace(old, new)

    monkeypatch.setattr(f"{__name__}.kernel_source", mutated)
    cfg = ModelConfig.from_name("smollm2-135m")
    cases = _cases()
    lines = _kernel_values(tmp_path, cfg, cases)
    caught = {name for (name, args), got in zip(cases, lines)
              if int(got) != _twin(cfg, isa.ROW_PART_MTILES, name, args)}
    if any([int(v) for v in line.split()] != isa.row_rotations(list(used), 16)
           for used, line in zip(ROTATIONS, lines[len(cases):])):
        caught.add("split_slot")  # through next_rotation
    assert helper in caught, caught


def test_the_packed_words_fields_read_in_the_kernel_as_python_packs_them(tmp_path):
    """isa.PACKED_WORDS (Word.GROUP, Word.GROUP_TILE, O_PROJ's keys) is written once: Python
    packs a word (isa.pack), the kernel reads each field with the header's MK_<WORD>_<FIELD>
    accessor. Words of each field at 0, 1 and its largest value, beside the other fields at
    theirs, compiled with the rendered header: every field the value packed. A value past its
    bits is refused."""
    import random

    from monokernel.kernel.header import render_header

    rng = random.Random(0)
    cases = []  # (word, {field: value})
    for word, fields in isa.PACKED_WORDS.items():
        for f in fields:
            for v in (0, 1, f.most):
                values = {g.name.lower(): rng.randrange(1 << g.bits) for g in fields}
                cases.append((word, {**values, f.name.lower(): v}))
    lines = ["#include <cstdio>", "int main() {"]
    for word, values in cases:
        w = isa.pack(word, **values)
        assert 0 <= w < 1 << 31
        lines += [f'  std::printf("%d\\n", (int)MK_{word}_{name.upper()}({w}));'
                  for name in values]
    lines += ["  return 0;", "}"]
    header = render_header(ModelConfig.from_name("qwen3-0.6b"), 64, tokens=16, slots=4,
                           page_size=16, mma=True)
    exe = tmp_path / "packed"
    compile_unit(header + "\n".join(lines) + "\n", ["-std=c++20", "-O0"], exe,
                 "the packed words driver", executable=True)
    got = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    want = [v for _, values in cases for v in values.values()]
    assert [int(x) for x in got] == want
    for word, values in cases[:3]:
        assert isa.unpack(word, isa.pack(word, **values)) == values
    with pytest.raises(ValueError, match="does not fit"):
        isa.pack("O_PROJ_KEYS", part=128)
    with pytest.raises(ValueError, match="has no field"):
        isa.pack("GROUP", parts=2)
