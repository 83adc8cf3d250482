# Two commands do all the set-up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
STAMP   = $(VENV)/.installed

.PHONY: install lint test test-faults test-soak test-torch-suite demo bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned to the CPU build, so that nothing resolves a CUDA build.
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests

# everything but the fault-injection jobs (~10 min on 2 cores); `pytest` alone runs both tiers
test: $(STAMP) lint
	$(PY) -m pytest -q -m "not faults" --durations=25

# the jobs whose trainers, servers or machines are killed, stopped or cut off (~19 min on 2 cores); CI runs both
test-faults: $(STAMP)
	$(PY) -m pytest -q -m faults --durations=25

# minutes: 30 torchrun launches of the example script, each must exit cleanly
test-soak: $(STAMP)
	COCOSYNC_SOAK=1 $(PY) -m pytest -q tests/soak

# PyTorch's generic backend suite on gloo and on cocosync (tests/torch_suite/compare.py; WORLDS="2 3" by default,
# SUITE_PATTERNS= for the whole suite): not in `make test`, it takes ~10 min per world size for the default selection
test-torch-suite: $(STAMP)
	$(PY) tests/torch_suite/compare.py $(WORLDS)

demo: $(STAMP)
	$(VENV)/bin/cocosync demo

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
