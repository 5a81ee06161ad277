# The two commands the README opens with. Each sets itself up (virtual environment,
# dependencies, tiny model) and is quick when that is already done.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEPS := pyproject.toml Makefile

.PHONY: run test lint typecheck setup bench docs clean

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is required ($(PYTHON) not found)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch is pinned to 2.13.0, the CPU build this machine image provides.
$(STAMP): $(PY) $(DEPS)
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[server,test,ray,loadtest,bench,docs]"
	@touch $(STAMP)

setup: $(STAMP)

# A local cluster (Redis, a prefill and a decode worker, the router) with the tiny model:
# streams one completion through it, then serves until Ctrl-C.
run: $(STAMP)
	$(PY) -m pdserve up --demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

test: lint typecheck
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -m bench.engine

# the user guide, served at http://127.0.0.1:8000 while you edit it
docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) build *.egg-info
