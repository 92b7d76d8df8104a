# Two commands on a fresh machine: `make demo` and `make test`. Each does its own set-up.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV   := $(CURDIR)/.venv
PY     := $(VENV)/bin/python

# Local state (Airflow DB, MLflow store, job dirs, stage outputs) stays inside the checkout.
export LLMOPS_HOME ?= $(CURDIR)/.llmops
export AIRFLOW_HOME ?= $(LLMOPS_HOME)/airflow
export MLFLOW_TRACKING_URI ?= sqlite:///$(LLMOPS_HOME)/mlflow.db
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER := $(CURDIR)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES := False
export AIRFLOW__CORE__PARALLELISM ?= 4
export PYTHONPATH := $(CURDIR):$(CURDIR)/plugins
# `airflow standalone` spawns `airflow <component>`: the venv's bin must be on PATH.
export PATH := $(VENV)/bin:$(PATH)
export RAY_AUTH_MODE ?= disabled
export MPLBACKEND ?= Agg
# Every setting above, for `make shell-env` (scripts/airflow): keep the two lists together.
LOCAL_ENV := LLMOPS_HOME AIRFLOW_HOME MLFLOW_TRACKING_URI AIRFLOW__CORE__DAGS_FOLDER \
  AIRFLOW__CORE__PLUGINS_FOLDER AIRFLOW__CORE__LOAD_EXAMPLES AIRFLOW__CORE__PARALLELISM \
  PYTHONPATH PATH RAY_AUTH_MODE MPLBACKEND

.PHONY: help install browser demo test test-slow test-matrix chaos up shell-env airflow-db clean bench-data \
  mwaa-bundle mwaa-check screenshots

help:
	@echo "make demo   - run the whole LLM lifecycle DAG locally (sets everything up first)"
	@echo "make test   - run the test suite, then the slow runs (make test-slow), then the fault matrix (make test-matrix)"
	@echo "make chaos  - only the fault matrix; writes benchmarks/results/fault_matrix.json"
	@echo "make up     - Airflow UI on :8080 and MLflow UI on :5000 (AIRFLOW_PORT, MLFLOW_PORT; 127.0.0.1 unless BIND_HOST), to trigger runs with Params"
	@echo "make clean  - remove local state (.llmops); keeps the venv"
	@echo "make bench-data - data prep throughput against datatrove (creates .llmops/bench-venv)"
	@echo "make mwaa-bundle - dags/, plugins.zip, requirements.txt, startup.sh for Amazon MWAA in dist/mwaa"
	@echo "make screenshots - the run page's pictures in docs/images/, from real runs in Chromium (~8 min)"

$(VENV)/.installed: requirements.txt requirements-dev.txt docker/requirements-job.txt
	@test -n "$(PYTHON)" || { echo "Python 3.11 or 3.12 is required"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

install: $(VENV)/.installed

airflow-db: install
	@mkdir -p $(AIRFLOW_HOME)
	airflow db migrate >/dev/null

demo: airflow-db
	$(PY) scripts/demo.py

# The browser tests/test_browser.py drives: Debian's Chromium (Playwright cannot download its own
# here). Installed when missing, with sudo when not root.
CHROMIUM := /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { echo "Installing Debian's chromium for tests/test_browser.py"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# The suite on TEST_WORKERS processes (pytest-xdist; 0 runs it in this process), then the slow runs
# and the fault matrix as targets of their own, one after the other: run beside the slow runs
# (load 8-17 on 2 cores), the matrix's tasks waited over 10 min for a slot and its rows failed.
TEST_WORKERS ?= 2
# The slow runs are mostly waits (DAG runs, simulated jobs): three at a time.
SLOW_WORKERS ?= 3
SLOW_MATRICES := tests/test_multiweek.py tests/test_fault_matrix.py
test: install browser
	$(PY) -m pytest tests $(SLOW_MATRICES:%=--ignore=%) -n $(TEST_WORKERS) --dist loadgroup \
	  --no-loadscope-reorder --durations=25
	$(MAKE) --no-print-directory test-slow
	$(MAKE) --no-print-directory test-matrix

# The slow runs alone, three at a time (each is mostly waits): the promotion gate and a lifecycle
# run paused, resumed and forked, through the DAG (one worker, sharing the tiny lifecycle run they
# build on, started first: six DAG runs in all), every page a researcher reads on `make up`, in
# Chromium (tests/test_browser.py, ~10 min), a multi-week pretraining compressed to minutes on
# SageMaker, Batch and HyperPod (against the simulators), a node lost mid-run on each of them for
# pretraining, fine-tuning and distillation, and the scaling-ladder DAG end to end on the tiny
# recipe (the suite skips them: LLMOPS_SLOW_TESTS).
test-slow: install browser
	LLMOPS_SLOW_TESTS=1 $(PY) -m pytest tests/test_lifecycle_gate.py tests/test_pause_resume_dag.py \
	  tests/test_browser.py tests/test_multiweek.py tests/test_node_loss_every_stage.py \
	  tests/test_ladder.py::test_the_ladder_dag_publishes_a_recommendation \
	  -n $(SLOW_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=8

# tests/test_fault_matrix.py alone: the fault matrix as a test (asserts every fault landed where
# its row claims and every cell is zero), on a PostgreSQL-backed deployment as MWAA's.
test-matrix: install
	$(PY) -m pytest tests/test_fault_matrix.py

# The fault matrix alone: a real Airflow deployment (PostgreSQL metadata DB in a temp dir)
# against moto behind a fault-injecting proxy and job simulator (tests/chaos/); prints the table,
# writes benchmarks/results/fault_matrix.json (a full run only; ARGS="--only ..." for a subset).
chaos: install
	$(PY) -m tests.chaos.matrix $(ARGS)

up: airflow-db
	$(PY) scripts/up.py

# The run page's pictures in docs/images/ (finished, gate, refused, cached, running, paused), from
# real tiny runs on a `make up` of their own (free ports, a temp LLMOPS_HOME), in Chromium.
screenshots: install browser
	$(PY) scripts/screenshots.py

# The settings above as shell `export` lines. A plain shell has none of them, so `.venv/bin/airflow`
# there talks to ~/airflow, not this deployment: scripts/airflow evaluates these first.
shell-env:
	@for name in $(LOCAL_ENV); do printf 'export %s=%q\n' "$$name" "$${!name}"; done

clean:
	rm -rf $(LLMOPS_HOME)

# Data prep throughput against datatrove, which gets a venv of its own (~1 min to create).
BENCH_VENV := $(LLMOPS_HOME)/bench-venv
$(BENCH_VENV)/.installed:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q "datatrove[io,processing]==0.10.1" "spacy==3.8.18"
	touch $@

bench-data: install $(BENCH_VENV)/.installed
	$(PY) benchmarks/data_prep_bench.py --datatrove-python $(BENCH_VENV)/bin/python --out benchmarks/results/data_prep_throughput.json

# Amazon MWAA: what the environment takes, in $(MWAA_OUT). MWAA_TRACKING_URI=... (not
# MLFLOW_TRACKING_URI, which is this checkout's local store above) and STORAGE_ROOT=s3://... are
# written into startup.sh; the build warns when either is missing and refuses a local store.
MWAA_OUT ?= $(CURDIR)/dist/mwaa
mwaa-bundle: install
	$(PY) scripts/mwaa_bundle.py --tracking-uri "$(MWAA_TRACKING_URI)" --storage-root "$(STORAGE_ROOT)" \
	  --out "$(MWAA_OUT)"

# The bundle's DAGs import with only its requirements.txt (MWAA's constraints, no torch, no
# ray): a venv of its own in ~/.cache/llmops/, ~1-2 min to create the first time, then cached.
mwaa-check: install
	$(PY) -m pytest tests/test_mwaa.py -q
