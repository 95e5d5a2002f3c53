"""kernel/includes.py: the kernel's own quoted includes inlined, so NVRTC, nvcc, the emulator and
the strict build all get one self-contained text whose #line directives name real lines."""

import shutil
import subprocess

import pytest

from monokernel.kernel.header import SOURCE_PATH, kernel_source
from monokernel.kernel.includes import inline_includes
from monokernel.model.config import ModelConfig


def test_header_inlined_once_with_line_directives(tmp_path):
    (tmp_path / "a.cuh").write_text('#pragma once\n#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("#pragma once\nint b;\n")
    src = 'int x;\n#include "a.cuh"\n#include <cstdio>\n#include "b.cuh"\n#include "absent.h"\nint y;\n'
    assert inline_includes(src, tmp_path, "main.cu") == (
        'int x;\n'
        '#line 1 "a.cuh"\n\n#line 1 "b.cuh"\n\nint b;\n#line 3 "a.cuh"\nint a;\n'
        '#line 3 "main.cu"\n'
        '#include <cstdio>\n'
        '#line 5 "main.cu"\n'  # b.cuh again: already inlined, only the line directive stays
        '#include "absent.h"\n'  # not beside the source: left to the compiler
        'int y;\n')


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_errors_point_at_the_header_and_the_source_lines(tmp_path):
    """g++ names the header's line for an error inside it and the source's after the include."""
    (tmp_path / "h.cuh").write_text("#pragma once\nint ok;\nint broken_in_header = ;\n")
    src = '#include "h.cuh"\nint fine;\nint broken_in_source = ;\n'
    unit = tmp_path / "unit.cpp"
    unit.write_text('#line 1 "main.cu"\n' + inline_includes(src, tmp_path, "main.cu"))
    err = subprocess.run(["g++", "-fsyntax-only", str(unit)], capture_output=True, text=True).stderr
    assert "h.cuh:3:" in err and "main.cu:3:" in err, err


def test_kernel_source_is_megakernel_with_its_includes_inlined():
    src = kernel_source(ModelConfig.from_name("tiny"), 64)
    assert src.endswith(inline_includes(SOURCE_PATH.read_text(), SOURCE_PATH.parent, "megakernel.cu"))
    local = [line for line in src.splitlines() if line.lstrip().startswith('#include "')
             and (SOURCE_PATH.parent / line.split('"')[1]).is_file()]
    assert local == []
