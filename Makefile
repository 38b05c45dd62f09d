# `make demo` and `make test` set up .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.xckpt-installed

.PHONY: venv demo test lint docs bench bench-formats clean soak notebooks

venv: $(STAMP)

# torch==2.13.0 first, so pip takes the CPU build from local disk; then the
# project (editable, all extras) pinned to the tested versions; then torchrec
# for the managed-collision tests (its metadata names the CUDA fbgemm, so
# --no-deps, with the CPU fbgemm and its real needs beside it).
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[torch,jax,notebook,dev]'
	$(BIN)/pip install -q --no-deps torchrec==1.9.2 fbgemm-gpu-cpu==1.8.0
	$(BIN)/pip install -q -c constraints.txt tensordict torchmetrics==1.0.3 pyre-extensions
	touch $(STAMP)

DEMO_DIR ?= /tmp/xckpt-demo

demo: venv
	$(BIN)/python examples/demo_core.py $(DEMO_DIR)
	$(BIN)/python examples/demo_torch.py $(DEMO_DIR)/torch
	$(BIN)/python examples/demo_value_groups.py
	$(BIN)/python examples/demo_jax.py $(DEMO_DIR)/torch
	$(BIN)/python examples/demo_formats.py $(DEMO_DIR)/formats

# ruff; the layers contract (import-linter, pyproject [tool.importlinter]); mypy on
# the package (pyproject [tool.mypy]).
lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

test: venv lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The user guide and API reference as a site (mkdocs-material + mkdocstrings); `make
# test` builds it with --strict through tests/test_docs.py. `mkdocs serve` to browse.
docs: venv
	$(BIN)/mkdocs build --strict -d build/site

# Regenerate notebooks/*.ipynb from notebooks/build.py, executed, with their outputs.
notebooks: venv
	$(BIN)/python notebooks/build.py

bench: venv
	$(BIN)/python bench/io.py

bench-formats: venv
	$(BIN)/python bench/formats.py

# Not in CI: the reliability, fuzz and object-storage tests with many more trials
# (killed saves, byte flips, races, hypothesis examples); prints the figures.
soak: venv
	XCKPT_SOAK=1 $(BIN)/python -m pytest -q -s -p no:cacheprovider --timeout=3600 tests/test_reliability.py tests/test_manifest_fuzz.py tests/test_s3.py

clean:
	rm -rf $(VENV) build *.egg-info
