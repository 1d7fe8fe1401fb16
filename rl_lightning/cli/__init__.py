"""The command line: what a user runs and sees.

- `main`: ``python -m rl_lightning fit|validate|test --config ...``, the LightningCLI subclass and its defaults;
- `config_check`, `config_errors`, `moved_paths`, `renamed_keys`: a bad config as one line naming the key, the value
  and the fix, found from the parser's structure (message text only as the fallback); old dotted paths and renamed
  keys name their new home;
- `device_check`: the devices a config asks for against the machine's CUDA devices, before any model loads;
- `resume_check`: ``--ckpt_path`` of another run (task, model, rollout mode) refused in one line before anything
  loads; ``--load_weights_only`` takes a checkpoint's weights alone;
- `progress`: the terminal progress line; `outputs`: each run's own output folder; `run_names`: what a run is
  called (``grpo lr=2e-05``) in MLflow, on the terminal and on disk;
- `tune` and `search_space`: ``python -m rl_lightning tune``, the Optuna search over recipe keys.

The top of the import order: nothing of ours imports it.

May import: every package of ours.
"""
