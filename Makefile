# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create (or reuse) .venv and install the project with what it needs, torch pinned by constraints.txt.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export NUMBA_CACHE_DIR ?= $(CURDIR)/.cache/numba
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0

.PHONY: install demo test bench clean browser

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/freescale demo

test: $(STAMP) browser
	$(BIN)/python -m pytest -q

# The report's browser test needs Chromium: install Debian's package when we can (root, apt); otherwise that
# one test is skipped and says so.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  timeout 600 apt-get install -y -qq chromium >/dev/null 2>&1; } || \
	echo "chromium could not be installed: the report's browser test will be skipped"

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,bench]'
	$(BIN)/python bench/balance.py --certify 30
	$(BIN)/python bench/ingest.py

clean:
	rm -rf $(VENV) .cache build *.egg-info
