# gearshift: every target creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/gearshift/v1/*.proto)

.PHONY: demo test proto lint bench clean check-proto fuzz

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

# Coverage-guided (atheris, the optional `fuzz` extra) for FUZZ_SECONDS per parser when it
# installs; otherwise the hypothesis properties with many more examples. Bounded either way.
FUZZ_SECONDS ?= 30
FUZZ_EXAMPLES ?= 2000
fuzz: $(STAMP)
	@if $(BIN)/pip install --quiet -e '.[dev,fuzz]'; then \
		FUZZ_SECONDS=$(FUZZ_SECONDS) $(BIN)/python scripts/fuzz.py; \
	else \
		echo "atheris did not install: running the hypothesis properties with $(FUZZ_EXAMPLES) examples each"; \
		GEARSHIFT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/pytest -q -p no:cacheprovider tests/unit/fuzz; \
	fi

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

lint: $(STAMP)
	$(BIN)/ruff check common controller agents policies cli gateway devfleet bench tests scripts
	$(BIN)/mypy common controller agents policies cli gateway devfleet

clean:
	rm -rf $(VENV) build *.egg-info
