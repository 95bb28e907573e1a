# Two commands on a fresh machine: `make train` and `make test`. Both create .venv if it is missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch is pinned and installed first: 2.13.0 is the CPU build on this disk; an unpinned torch pulls a CUDA build.
# On a GPU machine TORCH may name your CUDA build of the lock's version (PyPI's torch==2.13.0 on Linux is one): torch's
# own dependencies (nvidia-*, the triton it pins) then come from your index, not from the lock. Another version of
# torch needs a new lock first: `make lock TORCH=torch==<version>`.
TORCH  ?= torch==2.13.0
WORKERS ?= 2
# every distribution `make install` installs, at exact versions (`make lock` writes it)
LOCK   := requirements/lock.txt
LOCK_VENV := .venv-lock
LATEST := .venv-latest

# The lock as pip constraints, less torch and what torch itself pins with `==` (a CUDA build's triton and nvidia-*):
# $(TORCH) decides those. On the CPU build that is the lock less its torch line.
CONSTRAINTS = $(PY) -c 'import re, sys; from importlib.metadata import requires; \
    name = lambda s: re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9._-]*)", s).group(1)).lower(); \
    own = {"torch"} | {name(r) for r in requires("torch") or [] if "==" in r.split(";")[0]}; \
    sys.stdout.writelines(x for x in open(sys.argv[1]) if x.startswith("\#") or name(x) not in own)' $(LOCK)

# The suite's commands, for the venv named by $(1): ruff and the import layering (pyproject.toml's [tool.importlinter]:
# lit_lm/strategies/ and lit_lm/kernels/ never import lit_lm/ or lit_lm/callbacks/, no import cycle among
# lit_lm/strategies/), run from the repo root; then pytest on $(WORKERS) workers. pytest exits 5 when it collects no
# tests: that is not a failure of the suite. PYTHONDONTWRITEBYTECODE emptied: where the environment sets it (this
# machine does), each of the suite's hundreds of processes and ranks compiled lit-lm's and the tests' modules again
# (~0.2 s each); with it empty the first one writes __pycache__ (git-ignored).
LINT_IN = $(1)/bin/ruff check . && $(1)/bin/lint-imports
TEST_IN = PYTHONDONTWRITEBYTECODE= $(1)/bin/python -m pytest -n $(WORKERS) --dist worksteal --durations=30 tests; \
    rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

.PHONY: install lock train lint test test-latest clean

install: $(STAMP)

# The locked install: pip, setuptools and wheel at the lock's versions, $(TORCH), then lit-lm and its dev extra under
# the lock's constraints, built by the locked setuptools (--no-build-isolation: not the newest one from the index).
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$$(grep '^pip==' $(LOCK))"
	$(PY) -m pip install -q -c $(LOCK) setuptools wheel
	$(PY) -m pip install -q "$(TORCH)"
	$(CONSTRAINTS) > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt --no-build-isolation -e ".[dev]"
	touch $(STAMP)

# Writes $(LOCK): `pip freeze --all` of a throwaway venv given $(TORCH) and the newest versions pyproject's ranges
# allow, less lit-lm and torch's local label (+cpu: any build of the version fits). Then `make test`; commit the lock.
lock:
	rm -rf $(LOCK_VENV)
	python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(LOCK_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(LOCK_VENV)/bin/python -m pip install -q -e ".[dev]"
	{ echo "# Every distribution \`make install\` installs, exactly: resolved from pyproject.toml (torch pinned by"; \
	  echo "# TORCH, the rest the newest its ranges allowed) on Linux x86_64, Python 3.11."; \
	  echo "# Regenerate it with one command: make lock"; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable | grep -v -i -e '^#' -e '^lit[-_]lm==' \
	    | sed 's/+[A-Za-z0-9.]*$$//' | LC_ALL=C sort -f -t = -k 1,1; } > $(LOCK_VENV)/lock.txt
	grep -q '^torch==' $(LOCK_VENV)/lock.txt && mkdir -p $(dir $(LOCK)) && mv $(LOCK_VENV)/lock.txt $(LOCK)
	rm -rf $(LOCK_VENV)

train: $(STAMP)
	$(VENV)/bin/lit-lm fit --config configs/default.yaml

# ruff, then the import layering (LINT_IN above).
lint: $(STAMP)
	$(call LINT_IN,$(VENV))

# lint, then the whole suite (TEST_IN above).
test: lint
	$(call TEST_IN,$(VENV))

# lint and the suite on the newest versions pyproject allows (no lock; printed, and how they differ from it), in
# .venv-latest; torch stays at 2.13.0, the CPU build on this disk (a newer one is a CUDA build from PyPI).
# LIT_LM_TEST_UNLOCKED=1 skips the one test that holds the environment to the lock (tests/test_packaging.py).
test-latest:
	test -x $(LATEST)/bin/python || python3 -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager torch==2.13.0 -e ".[dev]"
	$(LATEST)/bin/python -m pip freeze --all --exclude-editable | grep -v '^#' | sed 's/+[A-Za-z0-9.]*$$//' \
	    > $(LATEST)/freeze.txt
	cat $(LATEST)/freeze.txt
	@echo "--- not as in $(LOCK):"; grep -v -x -i -F -f $(LOCK) $(LATEST)/freeze.txt || echo "(none)"
	$(call LINT_IN,$(LATEST))
	LIT_LM_TEST_UNLOCKED=1 $(call TEST_IN,$(LATEST))

# every venv, the runs and the caches
clean:
	rm -rf $(VENV) $(LATEST) $(LOCK_VENV) runs data/cache .pytest_cache
