# The two commands of the README: `make demo` (run the main job) and `make test` (run the tests).
# Both create .venv and install everything on first use; nothing else is needed on the machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_ARGS ?= --ranks 32 --iterations 40 --fault slow_gpu:7:1.5

.PHONY: setup demo test lint typecheck clean

# torch (a CPU build): the PyTorch integration's tests train a real 2-process job.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/fleetscope demo $(DEMO_ARGS)

# Lint, format and types first (seconds), then the tests: the unit tests (CPU-bound, no shared service) one
# process per core; then the integration tests that mostly wait (on brokers, workers, session timeouts: a
# third of a core each, measured) six at a time (1.2 cores in all; 226 s against 370 s three at a time, and
# eight at a time gain nothing more); then those marked `alone` (real torch jobs, runs that
# load both cores) one at a time, so that no other test shares the cores with them.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) --no-print-directory typecheck
	$(BIN)/python -m pytest -q -n auto tests/unit
	$(BIN)/python -m pytest -q -n 6 -m "not alone" --durations=15 tests/integration
	$(BIN)/python -m pytest -q -m alone --durations=10 tests/integration

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy reads the packages under the names they are imported by (fleetscope.<folder>) through a link tree.
typecheck: $(STAMP)
	rm -rf build/typecheck && mkdir -p build/typecheck/fleetscope
	for f in fleetscope/*.py $$(find fleetscope -mindepth 1 -maxdepth 1 -type d ! -name __pycache__); do \
		ln -s ../../../$$f build/typecheck/fleetscope/; done
	for d in producers streams schemas sinks; do ln -s ../../../$$d build/typecheck/fleetscope/$$d; done
	MYPYPATH=build/typecheck $(BIN)/mypy -p fleetscope

clean:
	rm -rf $(VENV) .fleetscope .pytest_cache .ruff_cache
