# gearshift: every target creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/gearshift/v1/*.proto)

.PHONY: demo test test-sklearn proto lint bench clean check-proto fuzz promtool guidellm image image-emulator image-engines test-containers podman-setup

# pip's and the build backend's chatter goes to .venv/install.log, shown only on failure.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	@echo "installing gearshift and its dependencies into $(VENV) (log: $(VENV)/install.log)"
	@$(BIN)/pip install --quiet --upgrade pip > $(VENV)/install.log 2>&1 \
		&& $(BIN)/pip install --quiet -e '.[dev]' >> $(VENV)/install.log 2>&1 \
		|| { tail -50 $(VENV)/install.log; exit 1; }
	touch $(STAMP)

# DEMO_ARGS=--containers: engines as containers of the emulated images (podman set up and
# the images built first, as `make image-engines` does).
demo: $(STAMP)
	$(if $(findstring --containers,$(DEMO_ARGS)),$(call PODMAN_ENV,--with-base) \
		mkdir -p build && echo "building the emulated engine images (log: build/engine-images.log)" && \
		{ CONTAINER=podman AGENT_BASE_IMAGE=$(LOCAL_BASE_IMAGE) scripts/build-engine-images.sh \
		  >/dev/null 2>build/engine-images.log || { tail -30 build/engine-images.log; exit 1; }; } &&) \
		$(BIN)/gearshift demo $(DEMO_ARGS)

# The container test (tests/integration/test_containers.py) needs podman: installed and
# configured here where that is possible (root on Debian/Ubuntu), else it is skipped.
test: $(STAMP) promtool guidellm
	$(BIN)/python scripts/gen_proto.py --check
	-@scripts/podman-setup.sh --with-base >/dev/null
	$(BIN)/pytest -q -p no:cacheprovider tests

# promtool (Debian's `prometheus` package) checks and unit-tests the alert rules
# (tests/unit/test_prometheus_rules.py). Installed when missing and apt-get can (as root,
# or with sudo without a password); otherwise those tests skip and say why.
promtool:
	@command -v promtool >/dev/null 2>&1 || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); \
		export DEBIAN_FRONTEND=noninteractive; \
		$$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
		|| { $$SUDO apt-get update -qq >/dev/null 2>&1 \
		     && $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; } \
		|| echo "promtool could not be installed (apt-get install prometheus needs root):" \
		        "the alert rule tests will be skipped"; }

# GuideLLM (PyPI's `guidellm`), a client written for vLLM, benchmarks the gateway in
# tests/integration/test_gateway_guidellm.py. It needs PyTorch, transformers and datasets
# (about 1.5 GB) that gearshift does not, so it gets a venv of its own under build/ and runs
# as a command. torch==2.13.0: pip takes its CPU build where one lies on disk (the
# project's machines) and PyPI's CUDA build elsewhere. When it does not install, the
# install log's tail is shown and the test skips, naming the log.
GUIDELLM_VENV := build/guidellm
GUIDELLM_PINS := 'guidellm>=0.8.1,<0.9' 'torch==2.13.0'
GUIDELLM_LOG := build/guidellm-install.log
guidellm: $(GUIDELLM_VENV)/.installed

$(GUIDELLM_VENV)/.installed: Makefile
	@mkdir -p build && rm -f $@
	@echo "installing GuideLLM into $(GUIDELLM_VENV) (log: $(GUIDELLM_LOG))"
	@{ $(PY) -m venv $(GUIDELLM_VENV) \
		&& $(GUIDELLM_VENV)/bin/pip install --quiet --upgrade pip \
		&& $(GUIDELLM_VENV)/bin/pip install --quiet $(GUIDELLM_PINS); } > $(GUIDELLM_LOG) 2>&1 \
		&& touch $@ \
		|| { tail -20 $(GUIDELLM_LOG); echo "GuideLLM did not install ($(GUIDELLM_LOG)):" \
		     "tests/integration/test_gateway_guidellm.py will be skipped"; }

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

# The numpy quantile trees (policies/quantile_trees.py) are pinned to scikit-learn's trees by
# their tests: run them on the newest patch of each scikit-learn minor release that
# pyproject.toml allows, each installed alone under build/ in front of .venv's own. (1.5 to
# 1.8 bin a column of over 255 distinct values at other thresholds: those trees differ.)
SKLEARN_RELEASES := 1.9.1
test-sklearn: $(STAMP)
	@mkdir -p build && for v in $(SKLEARN_RELEASES); do \
		echo "scikit-learn $$v"; \
		$(BIN)/pip install --quiet --no-deps --target build/sklearn-$$v "scikit-learn==$$v" \
			> build/sklearn-install.log 2>&1 || { tail -20 build/sklearn-install.log; exit 1; }; \
		PYTHONPATH=build/sklearn-$$v $(BIN)/python -c \
			'import sys, sklearn; assert sklearn.__version__ == sys.argv[1], sklearn.__file__' $$v \
			|| exit 1; \
		PYTHONPATH=build/sklearn-$$v $(BIN)/pytest -q -p no:cacheprovider \
			tests/unit/policies/test_quantile_trees.py tests/unit/policies/test_quantile_gbm.py \
			|| exit 1; \
	done

lint: $(STAMP)
	$(BIN)/ruff check common controller agents policies cli gateway devfleet bench tests scripts
	$(BIN)/mypy common controller agents policies cli gateway devfleet

# Container images (deploy/images/). `make image` builds the control plane on Debian and the
# agent on an engine's official serving image (ENGINE_IMAGE; vLLM by default): both bases are
# pulled from their registries. `make image-emulator` needs no registry: both images on a
# Debian base made here with debootstrap, the agent's engines being the emulator (the
# container test's images). With podman, scripts/podman-setup.sh first installs and
# configures it (idempotent; root on Debian/Ubuntu).
CONTAINER ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)
ENGINE ?= vllm
ENGINE_IMAGE ?=
CONTROL_BASE_IMAGE ?=
LOCAL_BASE_IMAGE := localhost/gearshift-debian:bookworm
PODMAN_ENV = $(if $(filter podman,$(CONTAINER)),eval "$$(scripts/podman-setup.sh $(1))" &&,)

podman-setup:
	scripts/podman-setup.sh

image:
	$(call PODMAN_ENV) CONTAINER=$(CONTAINER) ENGINE=$(ENGINE) ENGINE_IMAGE=$(ENGINE_IMAGE) \
		CONTROL_BASE_IMAGE=$(CONTROL_BASE_IMAGE) scripts/build-images.sh

image-emulator:
	$(call PODMAN_ENV,--with-base) CONTAINER=$(CONTAINER) ENGINE=emulator ENGINE_IMAGE=$(LOCAL_BASE_IMAGE) \
		CONTROL_BASE_IMAGE=$(LOCAL_BASE_IMAGE) scripts/build-images.sh

# Emulated engine images (deploy/images/engine-emulated.Containerfile): vLLM, TensorRT-LLM
# and SGLang serving images whose engine is the emulator, FROM the emulator agent image
# (built first when missing), for running engines as containers without GPUs.
image-engines:
	$(call PODMAN_ENV,--with-base) CONTAINER=$(CONTAINER) AGENT_BASE_IMAGE=$(LOCAL_BASE_IMAGE) \
		scripts/build-engine-images.sh

# The container test alone (it is part of `make test` too, where podman can run).
test-containers: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider tests/integration/test_containers.py

clean:
	rm -rf $(VENV) build *.egg-info
