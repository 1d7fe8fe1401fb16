"""Models: loading, LoRA, the optimizer, packed-sequence attention, the out-of-memory back-off, memory phases.

Loading Hugging Face causal LMs, reward/value heads and tokenizers (`loading`), LoRA (`lora`), the optimizer and
schedule (`optim`), memory-lean MLP and RMSNorm forwards (`lean`), packed-sequence attention (`attention`,
registered as ``rl_varlen``) and its kernels (`kernels`), the out-of-memory back-off of the token budget (`memory`), and the per-phase memory profile with giving freed host
memory back (`memory_phases`), and the memory plan: a model's shape from its config alone (`model_shape`), the
predicted peak per device (`memory_plan`) and the settings that would make a run fit (`memory_fit`).

May import `rl_lightning.algorithms`, `rl_lightning.assets.real` and `rl_lightning.parallel` (whose ring attention the
packed attention dispatches to, and which builds on `kernels`); never data, rewards, rollout, tasks, tracking or cli.
"""
