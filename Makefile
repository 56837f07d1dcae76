# Two entry points: `make demo` and `make test`. Both create or reuse .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
DEPS_STAMP := $(VENV)/.deps-stamp

.PHONY: demo test install soak-hostile lint typecheck specs-check unit fuzz diagrams docs chromium vllm-env vllm-tier bench-vllm wheel-check

# The vLLM test tier runs in its own environment: vLLM 0.33.0 installed slim (the CPU torch,
# vllm itself without its dependencies, then its pure-Python dependencies pinned in
# tests_vllm/requirements.txt), plus kvhandoff. Rebuilt only when the pins change.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.deps-stamp

$(DEPS_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]' --config-settings editable_mode=strict
	touch $(DEPS_STAMP)

$(VLLM_STAMP): tests_vllm/requirements.txt
	rm -rf $(VLLM_VENV)
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip setuptools
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q --no-deps vllm==0.33.0
	$(VLLM_PY) -m pip install -q --no-deps -r tests_vllm/requirements.txt
	$(VLLM_PY) -m pip install -q --no-deps pytest==9.2.0 pytest-timeout==2.4.0 iniconfig==2.3.1 pluggy==1.7.0
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)
	$(VLLM_PY) -m pip install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict

# vLLM's real Scheduler and worker-side connector lifecycle around kvhandoff (and stock vLLM
# peers for interop), each engine part in its own process.
vllm-tier: vllm-env
	$(VLLM_PY) -m pytest -q -rs -o pythonpath=tests_vllm tests_vllm

# The scheduler-side connector cost against vLLM's own push connector, under vLLM's real
# Scheduler, from a fresh clone: builds the vLLM environment first, prints one JSON line.
bench-vllm: vllm-env
	$(VLLM_VENV)/bin/kvhandoff bench vllm --json

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

# Issue 27: 60 s of legitimate push and encoder-cache traffic while attackers flood every
# listener; one JSON line, non-zero exit if any legitimate request failed.
soak-hostile: install
	$(BIN)/kvhandoff soak --hostile --seconds 60

test: lint typecheck specs-check docs vllm-env wheel-check unit vllm-tier

# The package as a user gets it: `python -m build` makes the sdist and, from it, the wheel
# (in an isolated build environment, as pip would); the wheel goes into a fresh venv (the
# CPU torch first, then the wheel with its declared dependencies: the demo needs them all),
# and from outside the tree tools/wheel_check.py checks the archives' contents, py.typed,
# the console script and the [gpu] extra's metadata, that every module imports (those
# needing vLLM with the vLLM tier's site-packages on the path) and that the vLLM
# integration's lazy names resolve; then the installed `kvhandoff demo` runs.
WHEEL_DIST := build/dist
WHEEL_VENV := build/wheel-venv
VLLM_SITE = $(wildcard $(abspath $(VLLM_VENV))/lib/python3*/site-packages)

wheel-check: install
	rm -rf $(WHEEL_DIST) $(WHEEL_VENV)
	$(PY) -m build --outdir $(WHEEL_DIST) .
	python3 -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(WHEEL_VENV)/bin/python -m pip install -q $(WHEEL_DIST)/kvhandoff-*.whl
	cd $(WHEEL_VENV) && bin/python $(CURDIR)/tools/wheel_check.py $(CURDIR)/$(WHEEL_DIST) "$(VLLM_SITE)"
	cd $(WHEEL_VENV) && bin/kvhandoff demo

# Coverage-guided fuzzing of every decoder (atheris), 1,000,000 inputs; not part of CI.
fuzz: install
	$(PY) -m pip install -q atheris
	$(PY) fuzz/decoders.py -runs=1000000 -max_len=4096

diagrams: install
	$(BIN)/kvhandoff diagrams

# Render every diagram of specs/ to SVG with a real renderer (mermaid-cli on Debian's
# chromium, offline): a diagram that does not render, renders wider than a page allows or
# draws a timeout's label twice fails the build. node_modules is cached in .cache/mermaid
# (keyed by the lock file); the SVGs land in build/docs, and the ones the README shows are
# refreshed in specs/svg when their diagram changed.
MERMAID := tools/mermaid
MERMAID_CACHE := .cache/mermaid
DOCS_OUT := build/docs

$(MERMAID_CACHE)/.stamp: $(MERMAID)/package.json $(MERMAID)/package-lock.json
	mkdir -p $(MERMAID_CACHE)
	cp $(MERMAID)/package.json $(MERMAID)/package-lock.json $(MERMAID_CACHE)/
	cd $(MERMAID_CACHE) && PUPPETEER_SKIP_DOWNLOAD=1 npm ci --no-audit --no-fund --ignore-scripts --loglevel=error
	touch $@

chromium:
	@command -v chromium >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -q chromium fonts-liberation fonts-dejavu-core; }

docs: install chromium $(MERMAID_CACHE)/.stamp
	rm -rf $(DOCS_OUT) && mkdir -p $(DOCS_OUT)
	cp $(MERMAID)/render.mjs $(MERMAID_CACHE)/render.mjs
	node $(MERMAID_CACHE)/render.mjs $(MERMAID)/puppeteer-config.json $(DOCS_OUT) specs/*.md
	$(BIN)/kvhandoff diagrams --svg $(DOCS_OUT)
