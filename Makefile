# Two commands on a fresh machine: `make train` and `make test`. Both create .venv if it is missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch is pinned and installed first: 2.13.0 is the CPU build on this disk; an unpinned torch pulls a CUDA build.
TORCH  ?= torch==2.13.0
WORKERS ?= 2

.PHONY: install train lint test clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/lit-lm fit --config configs/default.yaml

# ruff, then the import layering (pyproject.toml's [tool.importlinter]: strategies/ and kernels/ never import
# lit_lm/ or callbacks/, no import cycle among strategies/); run from the repo root, where the packages import.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# pytest exits 5 when it collects no tests: that is not a failure of the suite. PYTHONDONTWRITEBYTECODE emptied: where
# the environment sets it (this machine does), each of the suite's hundreds of processes and ranks compiled lit-lm's
# and the tests' modules again (~0.2 s each); with it empty the first one writes __pycache__ (git-ignored).
test: lint
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(WORKERS) --dist worksteal --durations=30 tests; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

clean:
	rm -rf $(VENV) runs data/cache .pytest_cache
