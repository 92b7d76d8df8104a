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
export AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL ?= 5
export PYTHONPATH := $(CURDIR):$(CURDIR)/plugins
# `airflow standalone` spawns `airflow <component>`: the venv's bin must be on PATH.
export PATH := $(VENV)/bin:$(PATH)
export RAY_AUTH_MODE ?= disabled
export MPLBACKEND ?= Agg

.PHONY: help install demo test up airflow-db clean

help:
	@echo "make demo   - run the whole LLM lifecycle DAG locally (sets everything up first)"
	@echo "make test   - run the test suite"
	@echo "make up     - Airflow UI on :8080 and MLflow UI on :5000, to trigger runs with Params"
	@echo "make clean  - remove local state (.llmops); keeps the venv"

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

test: install
	$(PY) -m pytest tests

up: airflow-db
	$(PY) scripts/up.py

clean:
	rm -rf $(LLMOPS_HOME)
