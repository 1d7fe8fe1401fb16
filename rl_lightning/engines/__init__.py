"""Rollout engines: token ids in, token ids (and their log-probabilities) out, and the weights that keep them current.

- `protocol`: the `RolloutEngine` protocol, `SamplingParams` and `Completion`; `registry`: ``engine:`` kinds to their
  settings, builders and traits (adding an engine is one module and one line there);
- `hf`: sampling with transformers on the policy itself; `vllm`: vLLM colocated in the trainer's processes;
  `vllm_kinds`: the ``vllm`` and ``vllm_process`` kinds' settings and builders;
  `process`: vLLM in a process of its own, `restart`: one that comes back, `shared`: one process for every rank;
- `weights`: streaming gathered weights into an engine; `lora_sync`: adapter-only sync; `segmented`: generation in
  segments that take new weights between them (in-flight updates); `lockstep`: rounds in step across ranks;
  `local_channels`: the engine process's loopback-only channels.

Nothing here knows a task, a Trainer or an environment: an engine takes tensors, token ids and plain settings.

May import: parallel, assets, compat.
"""
