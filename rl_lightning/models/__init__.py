"""Models: loading, LoRA, the optimizer and the memory-lean forwards.

Loading Hugging Face causal LMs, reward/value heads and tokenizers, and the per-token log-probability forward with its
chunked output head (`loading`), LoRA (`lora`), the optimizer and schedule (`optim`), the ``model.lm`` group of
every task (`config`), memory-lean MLP and RMSNorm forwards (`lean`). Packed and ring attention are
`rl_lightning.attention`; the memory plan is `rl_lightning.memory`.

May import: memory, attention, assets, algorithms, compat.
"""
