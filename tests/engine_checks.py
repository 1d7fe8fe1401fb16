"""What the vLLM engine tests share (tests/engines/test_vllm.py, test_lora_sync.py, tests/assets/test_real_model.py).

The trainer-side references an engine is held to: the tiny model, demo prompts in a model's chat template, real
optimizer steps so the weights move, and the check that an engine generates what HF generate does on the trainer's
weights with the trainer's log-probabilities. `EngineCheck` (a callback recipes name as ``engine_checks.EngineCheck``)
and `cli_fit_worker` run a whole fit through the CLI in a spawned process.
"""

import gc
import json
import sys

import lightning as L
import torch
from conftest import DEMO_DATA, TINY_MODEL, assert_close

from rl_lightning.algorithms import token_logprobs
from rl_lightning.engines.protocol import SamplingParams

KV_CACHE = 64 << 20
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=10)




def load_model(model_dir=TINY_MODEL):
    from rl_lightning.models.loading import load_causal_lm

    return load_causal_lm(str(model_dir))


def prompts_for(model_dir, count, offset=0):
    """Token ids of `count` demo arithmetic prompts, rendered with `model_dir`'s chat template."""
    from rl_lightning.data.prompts import encode_prompt
    from rl_lightning.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    rows = [json.loads(line) for line in (DEMO_DATA / "arithmetic.jsonl").read_text().splitlines()]
    return [encode_prompt(tokenizer, r["messages"], True) for r in rows[offset : offset + count]]


def train_steps(model, steps, offset=0, lr=3e-2, model_dir=TINY_MODEL):
    """`steps` AdamW steps of next-token NLL on demo SFT conversations (a real loss, so the weights move)."""
    from rl_lightning.data.prompts import encode_prompt
    from rl_lightning.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    rows = [json.loads(line) for line in (DEMO_DATA / "sft.jsonl").read_text().splitlines()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        ids = torch.tensor([encode_prompt(tokenizer, rows[offset + step]["messages"], False)])
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = -token_logprobs(logits, ids[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def recomputed(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[:, len(prompt) - 1 : -1]
    return token_logprobs(logits, ids[:, len(prompt) :], temperature)[0]


def check_against_trainer(engine, reference, prompts, stop_token, pad_token_id=257, model_dir=TINY_MODEL):
    """Greedy: same tokens as HF generate on the trainer's weights, and the trainer's log-probabilities. Sampling at
    temperature 0.7: the engine's processed log-probabilities are the trainer's at that temperature."""
    from rl_lightning.engines.hf import HFEngine

    hf = HFEngine(reference, pad_token_id=pad_token_id)
    greedy = engine.generate(prompts, GREEDY)
    assert [g[0].token_ids for g in greedy] == [g[0].token_ids for g in hf.generate(prompts, GREEDY)]
    untrained = HFEngine(load_model(model_dir), pad_token_id=pad_token_id).generate(prompts, GREEDY)
    assert [g[0].token_ids for g in greedy] != [g[0].token_ids for g in untrained]  # the pushed weights matter
    sampled = engine.generate(prompts, SamplingParams(n=3, temperature=0.7, max_new_tokens=10, seed=11,
                                                      stop_token_ids=[stop_token]))
    checked = 0
    for prompt, group_greedy, group in zip(prompts, greedy, sampled, strict=True):
        assert_close(torch.tensor(group_greedy[0].logprobs), recomputed(reference, prompt, group_greedy[0], 1.0),
                     atol=1e-4)
        assert len(group) == 3
        for completion in group:
            assert_close(torch.tensor(completion.logprobs), recomputed(reference, prompt, completion, 0.7),
                         atol=1e-4)
            assert completion.finished == (completion.token_ids[-1] == stop_token)  # stop token kept
            assert completion.finished or len(completion.token_ids) == 10
            checked += len(completion.token_ids)
    return greedy, checked


class EngineCheck(L.Callback):
    """After the rollout callback: the engine's log-probabilities of the sampled tokens equal the policy's (the
    weights the engine was given); after each step: the logged metrics. Written to `path` at the end."""

    def __init__(self, path: str, temperature: float = 1.0):
        self.path, self.temperature, self.history, self.logprob_diffs = path, temperature, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._batch = batch  # the task's rollout callback runs after this one and adds batch["rollout"]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # the policy that sampled, before its update
        batch, self._batch = self._batch, None
        diffs = []
        for t in batch["rollout"].trajectories:
            ids = torch.tensor([t.input_ids])
            with torch.no_grad():
                logits = pl_module.model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None],
                                         use_cache=False).logits[:, :-1]
            logprobs = token_logprobs(logits, ids[:, 1:], self.temperature)[0]
            mask = torch.tensor(t.completion_mask[1:], dtype=torch.bool)
            diffs.append((logprobs[mask] - torch.tensor(t.engine_logprobs[1:])[mask]).abs().max().item())
        self.logprob_diffs.append(max(diffs))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.history.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_train_end(self, trainer, pl_module):
        with open(self.path, "w") as f:
            json.dump({"history": self.history, "logprob_diffs": self.logprob_diffs}, f)


def cli_fit_worker(rank, config_path):
    """Spawned-process target: ``fit`` through the real CLI with `config_path` (a rank of `run_on_cpu_ranks`)."""
    from rl_lightning.cli.main import main

    sys.argv = ["rl_lightning"]
    main(["fit", "--config", config_path])
    gc.collect()  # shuts the engine down (and the process group with it) before interpreter exit
