# Pollen — `make run` runs the default federated simulation (into ./runs, where `pollen runs` looks),
# `make test` runs the full test suite, `make test-fast` everything but the slow end-to-end (`e2e`) tests,
# `make coverage` the full suite with a coverage report for `pollen`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pollen-installed

# Flower: project-local home, no telemetry, no update check, no per-run `uv sync`.
export FLWR_HOME ?= $(CURDIR)/.flwr-home
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
# Full MNIST / Fashion-MNIST for the tests that need them (skipped when absent).
export POLLEN_DATA_ROOT ?= $(if $(wildcard $(CURDIR)/../shared/data/MNIST),$(abspath $(CURDIR)/../shared/data),)

NUM_SUPERNODES ?=
RAY_CPUS ?=
RUN_CONFIG ?=
OUT_DIR ?= $(CURDIR)/runs
PYTEST_ARGS ?=

.PHONY: install run test test-fast coverage lint fleet clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	$(PY) -m pip install -e ".[train,tracking,test]"
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pollen run $(if $(NUM_SUPERNODES),--num-supernodes $(NUM_SUPERNODES)) \
		$(if $(RAY_CPUS),--ray-cpus $(RAY_CPUS)) --run-config "out-dir='$(OUT_DIR)' $(RUN_CONFIG)"

# The full suite (what CI runs), in two passes: the tests that launch nothing, one pytest-xdist worker
# per core (they share only the read-only datasets); then the `e2e` tests, E2E_WORKERS at a time, test by
# test (each launch has its own free ports, private FLWR_HOME and private Ray). `--dist worksteal`: an idle
# worker takes queued tests from a busy one, so the pass ends with its slowest test, not with a whole file
# (test_fleet.py and test_documented_commands.py hold ~950 s each; file by file, one worker carried each).
# Each worker starts with a contiguous share of the collection and gives away the end of its queue, so a
# module's tests mostly stay together; a module-scoped launch (test_cluster.py's loopback cluster, the
# hostile external run) starts once per worker that runs its tests. Two workers: an e2e test waits about
# half its time (process start-ups, Flower's 3 s SuperNode poll, heartbeats; a 2-node 1-round fleet: 48 s
# wall, 25 CPU-s), so E2E_WORKERS=3 fills a machine with spare CPU, but on one loaded to 30-46 by other
# work it failed 2 of 91 in 4,727 s (a GLFC fleet's SuperLink answered 'database is locked' and lost two
# nodes; bench.gpu's 1-step throughput rounded to 0.0 images/s).
# E2E_WORKERS=1 runs them one at a time. Coverage, when asked for, adds up over both passes; each pass
# lists its slowest tests, so CI's log says where the time goes.
E2E_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -m "not e2e" -n auto --durations=15 $(PYTEST_ARGS)
	$(PY) -m pytest -q -m e2e $(if $(filter-out 1,$(E2E_WORKERS)),-n $(E2E_WORKERS) --dist worksteal) --durations=25 \
		$(if $(findstring --cov,$(PYTEST_ARGS)),--cov-append) $(PYTEST_ARGS)

# Everything but the `e2e` tests (no SuperLink, SuperNode, `flwr run` or Ray launches), one worker
# process per core (pytest-xdist): these tests share nothing but the read-only datasets.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not e2e" -n auto $(PYTEST_ARGS)

# The full suite with a per-file coverage report for the `pollen` package (what .ci/run prints).
coverage: $(STAMP)
	$(MAKE) test PYTEST_ARGS="--cov=pollen --cov-report=term $(PYTEST_ARGS)"

# The linter and the type checker, both configured in pyproject.toml (CI runs this after the tests).
lint: $(STAMP)
	$(PY) -m ruff check pollen deploy bench
	$(PY) -m mypy --explicit-package-bases pollen deploy/*.py

clean:
	rm -rf .flwr-home runs .pytest_cache

# Local fleet: one SuperLink + NUM_SUPERNODES SuperNodes (deploy/README.md). Options: METHOD=fedprox
# ROUNDS=2 TLS=1 RUN_CONFIG="local-epochs=1" FLEET_ARGS="--keep-logs --models ... --gpus 0,1 --timeout 900".
fleet: $(STAMP)
	$(VENV)/bin/pollen fleet --num-supernodes $(or $(NUM_SUPERNODES),5) --out-dir "$(OUT_DIR)" \
		$(if $(METHOD),--method $(METHOD)) $(if $(ROUNDS),--rounds $(ROUNDS)) $(if $(TLS),--tls) \
		--run-config "$(RUN_CONFIG)" $(FLEET_ARGS)
