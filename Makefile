# Two entry points: `make demo` and `make test`. Both create or reuse .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
DEPS_STAMP := $(VENV)/.deps-stamp

.PHONY: demo test install lint typecheck specs-check unit fuzz diagrams

$(DEPS_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]' --config-settings editable_mode=strict
	touch $(DEPS_STAMP)

# Strict editable installs link each file; re-link so newly added modules are seen.
install: $(DEPS_STAMP)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict

demo: install
	$(BIN)/kvhandoff demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy -p kvhandoff

specs-check: install
	$(BIN)/kvhandoff diagrams --check

unit: install
	$(BIN)/pytest -q -rs

test: lint typecheck specs-check unit

# Coverage-guided fuzzing of every decoder (atheris), 1,000,000 inputs; not part of CI.
fuzz: install
	$(PY) -m pip install -q atheris
	$(PY) fuzz/decoders.py -runs=1000000 -max_len=4096

diagrams: install
	$(BIN)/kvhandoff diagrams
