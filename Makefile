# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv and installs everything.
# torch is pinned here for this machine (a CPU build on local disk); pyproject keeps a normal range.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# pytest-xdist workers: one per core (tests that start processes are dealt out first; see tests/conftest.py).
TEST_WORKERS ?= auto

.PHONY: install test test-fast demo lint clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e '.[test,lint]' "$(TORCH_PIN)"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The inner loop: everything but the tests that start processes (kills, DDP, FSDP, the demo, benchmark runs) or run
# tens of seconds, on local disk, memory:// and GCS; S3 (moto: 3-4x a GCS test's time) is left to `make test`.
FAST_STORES ?= local,memory,gcs
test-fast: install
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not slow" --stores $(FAST_STORES) $(PYTEST_ARGS)

# ruff over the whole tree, mypy --strict over the package (settings in pyproject.toml); zero findings expected.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

demo: install
	$(VENV)/bin/lightning-resilient demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
