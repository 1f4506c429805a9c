# Two entry points on a fresh machine: `make demo` and `make test`. Both set everything up.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch (from local disk on the project's machines); override on GPU machines,
# e.g. `make setup TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

demo: setup
	$(BIN)/rl train configs/quickstart.yaml --run-dir runs/quickstart

test: setup
	$(BIN)/ruff check .
	$(BIN)/pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
