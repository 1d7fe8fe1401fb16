"""Ready-made optional Lightning callbacks: reference one from a recipe, or copy one to write your own.

Nothing here is needed to train. Callbacks the tasks cannot run without live in the package (PPO's rollout callback,
`rl_lightning.rollout.callback.RolloutCallback`, which the task adds itself through ``configure_callbacks``); this
package holds the optional ones: `rollout_samples.RolloutSamples` (a table of sampled completions in MLflow),
`memory_stats.MemoryStats` (host and CUDA memory per step), `memory_profile.MemoryProfile` (each phase's own
memory peak: generation, weight sync, scoring, forward, backward, optimizer step, checkpoint, export),
`early_stop.EarlyStopOnReward` (stop once a metric reaches a threshold) and `rollout_dump.RolloutDump` (every trajectory as JSONL, rotated by size).

**Using one.** A recipe or an overlay lists it under ``trainer.callbacks`` by dotted path (they ship with the package,
so this works from any folder; the CLI also puts the working directory on ``sys.path``, so your own modules next to
the recipe import the same way)::

    trainer:
      callbacks:
        - class_path: rl_lightning.callbacks.rollout_samples.RolloutSamples
          init_args: {every_n_rollouts: 10, rows: 8}

In this project a recipe's or overlay's ``callbacks:`` list adds to the default callbacks (progress bar,
checkpointing, Hugging Face export). From the command line, ``--trainer.callbacks+=rl_lightning.callbacks.memory_stats.MemoryStats``
appends one.

**Which hook.** ``on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)`` runs after the training step.
For the PPO-family tasks (PPO, GRPO, DAPO, ...) one training batch is one rollout and ``batch["rollout"]`` is a
`rl_lightning.rollout.trajectory.Rollout`:

- ``trajectories``: this rank's scored `Trajectory` objects, grouped by prompt (``group_size`` consecutive
  completions each); each has ``messages`` (the prompt's messages, then what was generated: assistant turns and, in
  multi-turn rollouts, the environment's tool messages), ``prompt`` (``messages``, ``answer``), ``reward``,
  ``reward_components`` (``{name: value}``), ``completion_length`` (generated tokens), ``finished`` (ended with a
  stop token, not cut at ``max_new_tokens``) and ``turns``;
- ``group_size``, ``reward_names`` (the reward's component names), ``metrics`` (``rollout/generate_s``, ...);
- ``pl_module.rollouts`` counts the completed rollouts (this one included, after the training step).

Other tasks' batches have no ``"rollout"`` key: check before reading it. The metrics the task logged for the step
(``train/reward``, ``train/loss``, ...) are in ``trainer.callback_metrics`` by then, already reduced over ranks.
The rollout callback runs in ``on_train_batch_start``, after the Trainer's own callbacks (Lightning runs callbacks a
module adds last), so another callback's ``on_train_batch_start`` sees the batch before its rollout.

May import: rollout, memory, compat.
"""
