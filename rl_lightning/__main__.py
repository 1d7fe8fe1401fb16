"""``python -m rl_lightning``: ``tune ...`` runs `rl_lightning.cli.tune`, anything else the LightningCLI."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["tune"]:  # Optuna search (rl_lightning.cli.tune); everything else is the LightningCLI
        from rl_lightning.cli.tune import main

        main(sys.argv[2:])
    else:
        from rl_lightning.cli.main import main

        main()
