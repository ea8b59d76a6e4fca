# The two commands: `make run` (set up, start everything, run the default RL run) and
# `make test` (lint + the whole suite). Everything else here serves those two;
# `make test-fast` is the unit and integration tiers alone, for the edit-test loop.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
SEED   ?= 0
STEPS  ?= 0
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test test-fast lint typecheck pytest venv clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

# veRL, for tests/unit/test_algorithms_verl.py (every algorithm against veRL's own functions).
# Its metadata pins transformers below ours, so no extra can hold it: it and what its CPU
# imports need go in without dependency resolution, for the test tiers only (not make run).
VERL_CPU := verl==0.9.1 ray==2.60.0 tensordict==0.10.0 omegaconf==2.4.0 codetiming==1.4.0 \
            pyvers==0.2.3 msgpack==1.2.4 attrs==26.1.0 jsonschema==4.26.0 \
            jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
$(BIN)/.verl: $(BIN)/.installed Makefile
	$(BIN)/pip install -q --no-deps $(VERL_CPU)
	touch $@

run: venv
	$(BIN)/rlboost up --seed $(SEED) --steps $(STEPS)

# ruff, mypy strict, and the architecture contracts of pyproject.toml [tool.importlinter]
lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy shared manager_svc trainer_svc rollout_svc weight_svc rlboost sim benchmarks
	$(BIN)/lint-imports --no-logo --no-cache

# Cheapest tier first, so a broken unit fails in seconds rather than after the stack tests.
TIERS  := tests/unit tests/integration tests/system
PYTEST := $(BIN)/pytest -q -p no:cacheprovider --durations=25

pytest: venv $(BIN)/.verl
	$(PYTEST) $(TIERS)

test: lint pytest

test-fast: venv $(BIN)/.verl
	$(PYTEST) tests/unit tests/integration

.PHONY: run-ha test-ha
# The same on clustered brokers (rlboost.ha_stack): a 3-node NATS JetStream cluster with the
# chunk stream at R3, and a Redis Cluster of 3 primaries with a replica each, from the venv's
# binaries. run-ha: `make run` on them; test-ha: the system tier with every test's brokers
# clustered (RLBOOST_TEST_BROKERS=ha), outside CI, which runs the clustered fault campaign
# (tests/system/test_ha_faults.py) and the Redis Cluster tests on their own.
run-ha: venv
	$(BIN)/rlboost up --ha --seed $(SEED) --steps $(STEPS)

test-ha: venv $(BIN)/.verl
	RLBOOST_TEST_BROKERS=ha $(PYTEST) tests/system

clean:
	rm -rf .rlboost .mypy_cache .ruff_cache

.PHONY: browser
# Debian's chromium for the dashboard tests (headless; Playwright drives it, never downloads
# one). apt-get needs root; where it cannot install, those tests skip and say so.
browser:
	@if [ -x /usr/bin/chromium ]; then echo "chromium: $$(/usr/bin/chromium --version 2>/dev/null)"; \
	else (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
	  || echo "chromium could not be installed: the dashboard tests will skip"; fi

.PHONY: bench-preempt
bench-preempt: venv
	$(BIN)/python -m benchmarks.preempt

.PHONY: bench-weights
bench-weights: venv
	$(BIN)/python -m benchmarks.weights

.PHONY: bench-seeding
bench-seeding: venv
	$(BIN)/python -m benchmarks.seeding

.PHONY: bench-control-plane
# Manager ingest (live and drain) vs raw NATS and the Redis-only bound, one vs two replicas,
# overhead at 32/128 instances (~6 min idle; 18 min measured beside two other benchmarks)
bench-control-plane: venv
	$(BIN)/python -m benchmarks.control_plane

.PHONY: bench-wan
# One rollout instance streaming its tokens over an emulated 40 ms link vs the LAN
bench-wan: venv
	$(BIN)/python -m benchmarks.wan

.PHONY: bench-algorithms
# Every algorithm (grpo ... gspo) end to end through REST on the embedded task: reward first-5
# vs last-5 per algorithm
bench-algorithms: venv
	$(BIN)/python -m benchmarks.algorithms

.PHONY: bench-lora
# LoRA runs of tiny-chat through REST, three seeds: reward first-5 vs last-5, and the adapter's
# bytes against the merged model's
bench-lora: venv
	$(BIN)/python -m benchmarks.lora

.PHONY: bench-async
# Asynchronous mode: trained tokens/s at staleness 0/1/2 under a spot trace (emu), then reward
# on tiny-chat at 0/1/2 with the off-policy corrections on and off, three seeds
bench-async: venv
	$(BIN)/python -m benchmarks.staleness

.PHONY: bench-paper
# The paper's comparison, emulated GPU time on the real services; writes docs/results/
bench-paper: venv
	$(BIN)/python -m benchmarks.paper

.PHONY: gpu-check
# End to end with the SGLang engine on a GPU and a real small HF model: make gpu-check MODEL=dir
gpu-check: venv
	scripts/gpu-check.sh $(MODEL)

.PHONY: bench-sim-check
# The headline regime on the real services (emu) and in the simulator, side by side (~26 min)
bench-sim-check: venv
	$(BIN)/python -m benchmarks.sim_check

.PHONY: chaos
# The fault campaign at scale, outside CI (CI runs its bounded default of 50 faults):
# process, broker and link faults until FAULTS have hit, every run equal to the fault-free one;
# then agentic runs (multi-turn, a tool per turn) under a fifth as many, the trainer killed too,
# and asynchronous runs (staleness 1 and 2) under a tenth each
FAULTS ?= 1000
chaos: venv
	RLBOOST_CHAOS_FAULTS=$(FAULTS) $(PYTEST) -s -k "faulted_run or agentic or async" \
		tests/system/test_faults.py tests/system/test_agentic.py tests/system/test_async.py

.PHONY: bench-paper-sim
# The paper's figure set at the paper's scale in the simulator: docs/results/ and the page
# docs/results-simulated.md
bench-paper-sim: venv
	$(BIN)/python -m benchmarks.paper_sim

.PHONY: bench-trainer
# Step time, peak and activation memory per rank at 1k-8k tokens: the replicated trainer vs
# FSDP2 (1 and 2 ranks, and with activation checkpointing), FSDP2 hooks timed by phase (~6 min)
bench-trainer: venv
	$(BIN)/python -m benchmarks.trainer

.PHONY: docs
# The documentation site (mkdocs.yml, pages under docs/) into site/; any warning fails it
docs: venv
	$(BIN)/mkdocs build --strict --site-dir site
