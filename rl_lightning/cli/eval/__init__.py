"""``python -m rl_lightning eval``: held-out accuracy, pass@k and mean reward of a model on a data set.

`rl_lightning.cli.eval.inputs` resolves what the user names (model folder, data path, environment) with one-line
errors; `rl_lightning.cli.eval.evaluate` generates and scores (`EvalConfig`, `evaluate`); `rl_lightning.cli.eval.report`
prints the table and logs to MLflow; `rl_lightning.cli.eval.command` is the command line. Nothing is imported here,
so ``eval --help`` loads no torch: ``from rl_lightning.cli.eval.evaluate import EvalConfig, evaluate``.
"""
