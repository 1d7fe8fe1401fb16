"""``python -m rl_lightning``: ``tune``/``eval``/``demo`` run `rl_lightning.cli.tune`/`eval`/`demo`, else LightningCLI."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["tune"]:  # Optuna search (rl_lightning.cli.tune); everything else is the LightningCLI
        from rl_lightning.cli.tune import main

        main(sys.argv[2:])
    elif sys.argv[1:2] == ["demo"]:  # make demo: GRPO on a real model, accuracy before -> after (rl_lightning.cli.demo)
        from rl_lightning.cli.demo import main as demo_main

        demo_main(sys.argv[2:])
    elif sys.argv[1:2] == ["eval"]:  # held-out accuracy / pass@k of a model (rl_lightning.cli.eval)
        from rl_lightning.cli.eval.command import main as eval_main

        eval_main(sys.argv[2:])
    else:
        from rl_lightning.cli.main import main

        main()
