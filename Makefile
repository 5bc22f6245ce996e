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
# Real hosts for the tests, each in its own directory under $(HOSTS) that only the
# tests' subprocesses put on their path: vLLM's wheels pin a CUDA torch (so --no-deps, plus
# exactly the modules its sampler and logprob code import, found by importing them), and
# TRL imports vLLM whenever vLLM is importable, which would break TRL here. One directory
# per version: the V2 model runner of $(VLLM_V2), the V1 sampler of $(VLLM_V1). AReaL and
# OpenRLHF pin torch and dozens of packages (ray, deepspeed, flash-attn, ...): each goes in
# with --no-deps, and its test's subprocess stubs the few imports it names (both are for
# CPython 3.11 and 3.12 only: AReaL's Requires-Python, OpenRLHF's wheel tags).
HOSTS := $(VENV)/hosts
VLLM_V2 := 0.34.0
VLLM_V1 := 0.33.0
AREAL := 1.0.4
OPENRLHF := 0.11.2
VLLM_IMPORTS := msgspec==0.23.0 pyzmq==27.3.0 pybase64==1.5.1 cachetools==8.0.2 uvloop==0.23.0 \
	py-cpuinfo==9.0.0
VLLM_V1_IMPORTS := cbor2==6.3.0 openai-harmony==0.0.8 openai==3.63.0 httpx2==2.17.0 \
	xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 fastapi==0.165.0 starlette==1.10.0 \
	partial-json-parser==0.2.1.1.post7 llguidance==1.9.1
# SkyRL (one pure-Python wheel; its training extras pin CUDA packages): --no-deps, plus the
# modules its torch_utils import needs beyond the venv's pydantic, fsspec, transformers,
# peft and megatron-core (tests/real_hosts/skyrl_run.py).
SKYRL := 0.3.0
SKYRL_IMPORTS := jaxtyping==0.3.11 wadler-lindig==0.1.8 loguru==0.7.3
HOSTS_STAMP := $(HOSTS)/.exactlogp-hosts
TARGET_INSTALL := $(PY) -m pip install -q --no-deps --no-warn-conflicts --no-compile --target

.PHONY: setup test lint format report demo clean

setup: $(STAMP) $(HOSTS_STAMP)

$(STAMP): pyproject.toml setup.py Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@# the fused CPU backend compiles its C kernels once into a cache; without a C compiler
	@# the package still works with backend="reference" (and backend="cpu" says why)
	@$(PY) -m exactlogp.backends.cpu_build >/dev/null || echo "exactlogp: backend='cpu' not built (reason above)"
	@touch $(STAMP)

$(HOSTS_STAMP): $(STAMP)
	rm -rf $(HOSTS)/vllm-$(VLLM_V2) $(HOSTS)/vllm-$(VLLM_V1) $(HOSTS)/skyrl-$(SKYRL) \
		$(HOSTS)/areal-$(AREAL) $(HOSTS)/openrlhf-$(OPENRLHF)
	$(TARGET_INSTALL) $(HOSTS)/vllm-$(VLLM_V2) vllm==$(VLLM_V2) $(VLLM_IMPORTS)
	$(TARGET_INSTALL) $(HOSTS)/vllm-$(VLLM_V1) vllm==$(VLLM_V1) $(VLLM_IMPORTS) $(VLLM_V1_IMPORTS)
	$(TARGET_INSTALL) $(HOSTS)/skyrl-$(SKYRL) skyrl==$(SKYRL) $(SKYRL_IMPORTS)
	$(TARGET_INSTALL) $(HOSTS)/areal-$(AREAL) areal==$(AREAL)
	$(TARGET_INSTALL) $(HOSTS)/openrlhf-$(OPENRLHF) openrlhf==$(OPENRLHF)
	@touch $(HOSTS_STAMP)

# EXACTLOGP_REAL_HOSTS=required: a test of a real host that `make setup` installed fails,
# rather than skips, when the host is missing. Two workers, each taking whole files (their
# module fixtures -- gloo worlds, host subprocesses -- stay with their tests):
# TEST_WORKERS=0 runs them in this process, one after the other.
TEST_WORKERS ?= 2
test: setup
	EXACTLOGP_REAL_HOSTS=required $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

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
