# gearshift: every target creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/gearshift/v1/*.proto)

.PHONY: demo test proto lint bench clean check-proto

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gearshift demo $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python scripts/gen_proto.py --check
	$(BIN)/pytest -q -p no:cacheprovider tests

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

lint: $(STAMP)
	$(BIN)/ruff check common controller agents policies cli gateway bench tests scripts
	$(BIN)/mypy common controller agents policies cli gateway

clean:
	rm -rf $(VENV) build *.egg-info
