# `make demo` and `make test` set up .venv themselves (torch 2.13.0 first: an unpinned torch would
# pull a multi-GB CUDA build), then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DUMP ?= demo_dump

.PHONY: install demo lint test test-matrix bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

demo: install
	rm -rf $(DEMO_DUMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/gan_demo.py --steps 5 --dump-dir $(DEMO_DUMP)
	$(VENV)/bin/graphzero-dump $(DEMO_DUMP)

lint: install
	$(VENV)/bin/ruff check graphzero passes tools tests examples

test: install lint
	$(PY) -m pytest -q tests

# The full randomized config matrix (tests/test_matrix.py; `make test` runs its fixed 20-case sample).
test-matrix: install
	GRAPHZERO_MATRIX=full $(PY) -m pytest -q tests/test_matrix.py

bench: install
	$(VENV)/bin/graphzero-compare --model mlp --stage 2 --json bench-mlp-z2.json

clean:
	rm -rf $(VENV) $(DEMO_DUMP) *.egg-info
