# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create (or reuse) .venv and install the project with what it needs, torch pinned by constraints.txt.
# `make gpu-check [OUT=out/gpu]` is for a CUDA machine: no .venv, no install, no Ray (scripts/gpu_check.sh).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export NUMBA_CACHE_DIR ?= $(CURDIR)/.cache/numba
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0

.PHONY: install demo test bench clean browser gpu-check

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/freescale demo

# -X faulthandler: a crash after the session (at interpreter exit: one CI try ended so, tests all passed) prints every
# thread's stack instead of a bare "Segmentation fault".
# Two parts: the suite without the tests marked `serial`, then those alone (they time the wall clock, or look for any
# Ray on the machine). The first part runs on TEST_WORKERS processes (pytest-xdist, one test file per process at a
# time; 0: in this process), after `freescale warm` has compiled the loader's kernels into NUMBA_CACHE_DIR once
# rather than every test process and Ray worker compiling them at once (docs/benchmarks.md, twenty-fifth session).
# numba compiles on one core: the tests marked `kernel_free` (they call none of those kernels; tests/conftest.py
# fails one that does) run meanwhile in one more process, their report printed after the first part's.
TEST_WORKERS ?= 2
KERNEL_FREE_LOG := .cache/kernel-free-tests.log
test: $(STAMP) browser
	@mkdir -p .cache
	$(BIN)/python -X faulthandler -m pytest -q -p no:cacheprovider -m "kernel_free and not serial" \
		> $(KERNEL_FREE_LOG) 2>&1 & free=$$!; \
	echo "the tests marked kernel_free run beside freescale warm (their report: after the others')"; \
	$(BIN)/freescale warm && \
	$(BIN)/python -X faulthandler -m pytest -q -m "not kernel_free and not serial" -n $(TEST_WORKERS) --dist loadfile; \
	rest=$$?; wait $$free; free_rc=$$?; \
	echo "== the tests marked kernel_free:"; cat $(KERNEL_FREE_LOG); \
	[ $$rest = 0 ] && [ $$free_rc = 0 ]
	$(BIN)/python -X faulthandler -m pytest -q -m serial

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

# On a CUDA machine (python with CUDA torch, numba, pyarrow, pytest, triton; nvcc): builds cuda_ext, runs the GPU
# tests and the GPU benches, logs and JSON under OUT, in under 10 minutes. Uses $(PYTHON), not .venv.
OUT ?= out/gpu
gpu-check:
	PYTHON="$(PYTHON)" bash scripts/gpu_check.sh "$(OUT)"

clean:
	rm -rf $(VENV) .cache build *.egg-info
