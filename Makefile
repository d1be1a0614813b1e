# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create (or reuse) .venv and install the project with what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export NUMBA_CACHE_DIR ?= $(CURDIR)/.cache/numba
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/freescale demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python bench/balance.py --certify 30
	$(BIN)/python bench/loader.py

clean:
	rm -rf $(VENV) .cache build *.egg-info
