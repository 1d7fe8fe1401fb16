"""``python -m rl_lightning``: ``tune``/``eval`` run `rl_lightning.cli.tune`/`rl_lightning.cli.eval`, else LightningCLI."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["tune"]:  # Optuna search (rl_lightning.cli.tune); everything else is the LightningCLI
        from rl_lightning.cli.tune import main

        main(sys.argv[2:])
    elif sys.argv[1:2] == ["eval"]:  # held-out accuracy / pass@k of a model (rl_lightning.cli.eval)
        from rl_lightning.cli.eval.command import main as eval_main

        eval_main(sys.argv[2:])
    else:
        from rl_lightning.cli.main import main

        main()
