# `make demo` and `make test` set up .venv themselves (torch 2.13.0 first: an unpinned torch would
# pull a multi-GB CUDA build), then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DUMP ?= demo_dump
# DeepSpeed's JIT-built ops per venv (tests/conftest.py says why)
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: install demo lint test test-full test-torch test-matrix test-parity test-docs bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	# DeepSpeed's JIT-built CPU ops the suite loads (about a minute on 2 cores), built here once per
	# venv rather than inside the first test that needs them
	DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.accelerator import get_accelerator; \
		get_accelerator().create_op_builder('FusedAdamBuilder').load(); \
		from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $@

install: $(VENV)/.installed

demo: install
	rm -rf $(DEMO_DUMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/gan_demo.py --steps 5 --dump-dir $(DEMO_DUMP)
	$(VENV)/bin/graphzero-dump $(DEMO_DUMP)

lint: install
	$(VENV)/bin/ruff check graphzero passes tools tests examples

test: install lint
	$(PY) -m pytest -q --durations=40 tests

# The second CI leg: the suite's torch-sensitive core on another supported torch, e.g.
# `make test-torch TORCH=2.15.0`, in a venv cached outside the clone (tools/torch_venv.sh: keyed by
# torch version and pyproject.toml, its own pip.conf and TORCH_EXTENSIONS_DIR). Runs the matrix's
# fixed sample (GRAPHZERO_MATRIX unset). pytest's exit code 5 (nothing collected) fails it too.
TORCH_LEG_TESTS ?= tests/test_inductor_overlap.py tests/test_registration.py tests/test_passes.py tests/test_multi_engine.py \
	tests/test_first_step.py tests/test_zero3.py tests/test_lean_step.py tests/test_autograd_semantics.py \
	tests/test_matrix.py tests/test_accelerate.py tests/test_layout.py tests/test_collectives.py \
	tests/test_zero3_once_per_step.py tests/test_compile_leftovers.py

test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.15.0" >&2; exit 2; }
	venv=$$(PYTHON=$(PYTHON) tools/torch_venv.sh $(TORCH)) && \
	env -u GRAPHZERO_MATRIX DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$$venv/torch_extensions \
		$$venv/bin/python -m pytest -q $(TORCH_LEG_TESTS)

# Every case of every parametrized test, not only the default suite's fixed sample
# (tests/suite_sample.py), with the examples compiled by inductor and the full matrix: hours on 2 cores.
test-full: install lint
	GRAPHZERO_MATRIX=full $(PY) -m pytest -q tests

# The full randomized config matrix (tests/test_matrix.py; `make test` runs its fixed sample: 12 drawn cases and 3 explicit ones).
test-matrix: install
	GRAPHZERO_MATRIX=full $(PY) -m pytest -q tests/test_matrix.py

# DeepSpeed's own gradient-path unit tests, each against a DeepSpeed-eager twin (tests/test_parity.py;
# `make test` runs its fixed sample). docs/reliability.md, "DeepSpeed parity suite".
test-parity: install
	GRAPHZERO_PARITY=full $(PY) -m pytest -q tests/test_parity.py

# Every command README.md and docs/ show, run exactly as written (tests/test_doc_commands.py: the
# examples under torchrun and accelerate launch, make demo and its dump, graphzero-compare, the UNet
# repro; about an hour on 2 CPU cores). `make test` checks that each documented command is run by a
# test, CI or make demo, and runs the short ones.
test-docs: install
	GRAPHZERO_DOC_COMMANDS=full $(PY) -m pytest -q tests/test_doc_commands.py

bench: install
	$(VENV)/bin/graphzero-compare --model mlp --stage 2 --json bench-mlp-z2.json

clean:
	rm -rf $(VENV) $(DEMO_DUMP) *.egg-info .cache
