# Two commands do everything on a fresh machine: `make report` and `make test`; `make demo`
# runs the train-rollout parity demo.
# `make setup` is the idempotent set-up both use: a .venv in the repository root with
# torch and the package installed editable with its extras (tests, report, integrations).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,dev,report,bench,megatron,examples,trl,verl
REPORT_ARGS ?=
STAMP := $(VENV)/.exactlogp-setup

.PHONY: setup test lint format report demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@# the fused CPU backend compiles its C kernels once into a cache; without a C compiler
	@# the package still works with backend="reference" (and backend="cpu" says why)
	@$(PY) -m exactlogp.backends.cpu_build >/dev/null || echo "exactlogp: backend='cpu' not built (reason above)"
	@touch $(STAMP)

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

# The conformance report with its embedded default workloads (the Qwen3-Next prior-art
# one: 1024 tokens x 151936 vocab, bf16, TP 1 and 4, 10 repeats; and for the fused LM-head
# rows 128 x 256 hidden states with a 151936 x 256 head) -> reports/prior_art.json,
# reports/prior_art.md and reports/prior_art_fused.png. REPORT_ARGS="--preset quick" for a
# run of a few minutes.
report: setup
	$(VENV)/bin/exactlogp report $(REPORT_ARGS)

# The train-rollout parity demo at its default size (examples/train_rollout_parity.py):
# a TP1 rollout decoding with its cache vs a gloo TP4 trainer with megatron-core, each with
# its own forward passes and LM head. DEMO_ARGS="--scored bf16,fp32" scores the fp32 body too.
DEMO_ARGS ?=
demo: setup
	$(PY) examples/train_rollout_parity.py $(DEMO_ARGS)

format: setup
	$(VENV)/bin/ruff format src tests examples benchmarks
	$(VENV)/bin/ruff check --fix src tests examples benchmarks

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
