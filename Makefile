# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv and installs everything.
# torch is pinned here for this machine (a CPU build on local disk); pyproject keeps a normal range.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: install test demo clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e '.[test]' "$(TORCH_PIN)"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/lightning-resilient demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
