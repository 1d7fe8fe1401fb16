"""``python -m rl_lightning``: the ``rl-lightning`` command (`rl_lightning.cli.commands`): fit, eval, demo, tune."""

from rl_lightning.cli.commands import main

if __name__ == "__main__":
    main()
