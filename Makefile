# swerve — `make run` sets up and runs the service on embedded defaults; `make test` runs the tests.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test test-fast bench install db clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

db: $(STAMP)
	$(BIN)/swerve db upgrade

run: db
	$(BIN)/swerve serve --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(BIN)/pytest -q -x -m "not slow and not vllm and not docker and not gpu"

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python bench/ingest.py
	$(BIN)/python bench/sandbox.py

clean:
	rm -rf $(VENV) var .pytest_cache .hypothesis
