# Two commands do everything on a fresh clone: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: run test setup lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch before the rest: 2.13.0 resolves to the local CPU wheel; any other version is a multi-GB download.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[worker,local,dev]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/trainserve up

test: setup lint
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check core app worker trainserve bench tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: setup
	$(PY) bench/finetune.py

clean:
	rm -rf $(VENV) var
