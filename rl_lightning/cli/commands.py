"""The ``rl-lightning`` / ``python -m rl_lightning`` command: ``fit``, ``eval``, ``demo``, ``tune`` and the overview.

Each command imports what it runs when it runs: the overview (``--help``) and ``eval --help`` / ``demo --help`` load
no torch or Lightning, and ``fit`` loads the training stack (`rl_lightning.cli.main`, the LightningCLI).
"""

from __future__ import annotations

import os
import sys

from rl_lightning.cli.recipes import recipe_names

OVERVIEW = """usage: {program} <command> [options]

LLM post-training with PyTorch Lightning: SFT, reward models, DPO, PPO / GRPO / DAPO, on-policy distillation.

commands:
  fit    train a task from a recipe: fit --config <recipe> [--key value ...]; a recipe is your YAML file or a
         bundled one by name ({recipes})
  eval   held-out accuracy, pass@k and mean reward of a model on a data set
  demo   GRPO on a real model (SmolLM2-135M-Instruct) on a CPU: held-out accuracy before -> after
  tune   Optuna search over any recipe key

Each command has --help: fit --help lists every option, fit --config grpo --print_config shows a recipe in full.
--version prints the version.
"""


def overview() -> str:
    """The top-level help: the commands and the bundled recipes' names, the program named as it was typed."""
    program = "rl-lightning" if os.path.basename(sys.argv[0]) == "rl-lightning" else "python -m rl_lightning"
    return OVERVIEW.format(program=program, recipes=", ".join(recipe_names()))


def main(argv: list[str] | None = None) -> None:
    """Run the command `argv` names (default ``sys.argv[1:]``); no command or ``--help`` prints the overview."""
    args = sys.argv[1:] if argv is None else list(argv)
    command, rest = (args[0], args[1:]) if args else (None, [])
    if command == "tune":  # Optuna search (rl_lightning.cli.tune)
        from rl_lightning.cli.tune import main as tune_main

        tune_main(rest)
    elif command == "demo":  # make demo: GRPO on a real model, accuracy before -> after (rl_lightning.cli.demo)
        from rl_lightning.cli.demo import main as demo_main

        demo_main(rest)
    elif command == "eval":  # held-out accuracy / pass@k of a model (rl_lightning.cli.eval)
        from rl_lightning.cli.eval.command import main as eval_main

        eval_main(rest)
    elif command == "--version":
        from rl_lightning import __version__

        print(f"rl_lightning {__version__}")
    elif command in (None, "-h", "--help"):
        print(overview(), end="", file=sys.stdout if command else sys.stderr)
        raise SystemExit(0 if command else 2)
    else:  # fit and its options: the LightningCLI
        from rl_lightning.cli.main import main as cli_main

        cli_main(None if argv is None else args)  # None: the command line itself
