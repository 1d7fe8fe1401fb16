#!/usr/bin/env bash
# Download into DIR the wheels `benchmarks/gpu/run.sh --wheels DIR` installs on a CUDA machine that has torch,
# transformers and lightning (and their own requirements) but no internet. Run it here, where pip reaches PyPI:
#
#   bash benchmarks/gpu/wheels.sh DIR
#
# What is needed: the checks themselves import nothing beyond those three (rl_lightning's training path loads
# datasets, pyarrow and mlflow lazily, and only for data formats and loggers the checks do not use; verified by
# running `run.sh --dry` with nothing else importable). The wheels here are the LightningCLI stack, so that a recipe
# also runs by hand on that machine: `python -m rl_lightning fit --config recipes/sft.yaml --trainer.logger false`
# (jsonargparse[signatures] and its docstring-parser and typeshed-client, omegaconf for the `omegaconf+` parser
# mode). MLflow, the CLI's default logger, stays out: mlflow-skinny alone pulls in some 40 packages.
#
# Versions are the ones in the repo's .venv (PYTHON overrides it); the wheels are pure Python (py3-none-any), and
# the flags below would also take manylinux builds for CPython 3.12 on x86_64 should one be added.
set -euo pipefail

DIR=${1:?usage: bash benchmarks/gpu/wheels.sh DIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
PACKAGES=(jsonargparse docstring-parser typeshed-client omegaconf)

mkdir -p "$DIR"
for name in "${PACKAGES[@]}"; do
    version=$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$DIR" "$name==$version"
done
ls -1 "$DIR"/*.whl
du -ch "$DIR"/*.whl | tail -n 1
