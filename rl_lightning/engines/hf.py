"""`HFEngine`: sampling with transformers on the policy model itself.

Colocated by construction, so its weights are always the trainer's current ones. Simple and exact; the reference the
vLLM engine is tested against.

All prompts of a `generate` call decode together, in one left-padded batch over one KV cache, with a decode loop of
our own rather than ``model.generate``: ``generate`` draws every row's token from one random stream, so batching
prompts would make a prompt's completions depend on what else is in the batch (and on the rank it lands on). Here
each completion samples from its own generator, seeded with ``params.sample_seed(index, sample)``: a completion is
the same alone, in any batch, on any rank and whatever ``n`` is, and no two completions share a random stream. One
completion decoded here samples what ``model.generate`` samples for its prompt after ``torch.manual_seed(seed)``
with its sample's seed.

Under a sharded policy (FSDP2 / tensor parallel), every forward is a collective: all ranks run the same number of
decode steps (one all-reduce of "anyone still decoding?" per step), whatever their own completions do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rl_lightning.engines.protocol import Completion, SamplingParams


class HFEngine:
    """Generate with the policy module itself: one batched decode over all prompts of a call.

    Args:
        model: the policy (a transformers causal LM), used in eval mode during generation.
        pad_token_id: filler for left padding.
        device: where the policy computes: the strategy's root device, where the prompts, the sampled tokens and the
            per-prompt generators live. Under ``strategy.cpu_offload`` the parameters stay on the CPU while FSDP2
            computes on the root device, so the parameters cannot say. Default: the first parameter's device (an
            unsharded model used outside a Trainer).
    """

    def __init__(self, model: Any, pad_token_id: int, device: torch.device | str | None = None) -> None:
        self.model, self.pad_token_id = model, pad_token_id
        self.device = None if device is None else torch.device(device)

    def wake(self) -> None:
        """No-op: the engine is the policy module, always resident."""

    def sleep(self) -> None:
        """No-op: the engine is the policy module, which training keeps."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """No-op: the engine samples from the policy module itself."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per prompt, in prompt order, sampled in eval mode (the training mode is restored)."""
        was_training = self.model.training
        self.model.eval()
        try:
            tokens, logprobs = self._decode(prompts, params)
        finally:
            self.model.train(was_training)
        rows = [self._completion(t, lp, params) for t, lp in zip(tokens.tolist(), logprobs.tolist(), strict=True)]
        return [rows[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _decode(self, prompts: list[list[int]], params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, steps) sampled tokens and their log-probabilities; row ``i * n + j`` is prompt i's j-th sample.

        A prompt's rows leave the batch (and the KV cache) once all of them have stopped; until then a stopped row
        keeps decoding, so the prompt's draws stay exactly ``generate``'s, and `_completion` cuts it at its stop.
        """
        device = self.device if self.device is not None else next(self.model.parameters()).device
        n, width, steps = params.n, max(len(p) for p in prompts), params.max_new_tokens
        input_ids = torch.full((len(prompts) * n, width), self.pad_token_id, dtype=torch.long)  # built on the host
        attention_mask = torch.zeros_like(input_ids)
        for i, prompt in enumerate(prompts):
            input_ids[i * n : (i + 1) * n, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[i * n : (i + 1) * n, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)  # then moved, once
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        generators = [self._generator(params.sample_seed(i, j), device) for i in range(len(prompts)) for j in range(n)]
        stops = torch.tensor(params.stop_token_ids or [-1], device=device)
        sharded = _sharded(self.model)
        tokens = torch.full((len(prompts) * n, steps), self.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(tokens.shape, device=device)
        rows = torch.arange(tokens.shape[0], device=device)  # the batch's rows, as rows of `tokens`
        done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=device)
        cache, step = None, 0
        for step in range(steps):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            scores = process_logits(out.logits[:, -1].float(), params)  # what the token is sampled from
            token = sample(scores, generators) if params.temperature > 0 else scores.argmax(-1)
            tokens[rows, step] = token
            logprobs[rows, step] = scores.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
            done |= torch.isin(token, stops)
            if step + 1 == steps or _all_done(done, sharded):
                break
            input_ids, positions = token[:, None], positions[:, -1:] + 1
            attention_mask = torch.cat([attention_mask, torch.ones_like(input_ids)], dim=1)
            going = ~done.view(-1, n).all(1)  # per prompt of the batch
            if 0 < int(going.sum()) < len(generators) // n:  # (a rank whose prompts all stopped keeps one in lockstep)
                kept = going.repeat_interleave(n)
                keep = kept.nonzero()[:, 0]
                cache.batch_select_indices(keep)
                input_ids, positions, attention_mask = input_ids[keep], positions[keep], attention_mask[keep]
                rows, done = rows[keep], done[keep]
                generators = [g for g, on in zip(generators, kept.tolist(), strict=True) if on]
        return tokens[:, : step + 1], logprobs[:, : step + 1]

    @staticmethod
    def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
        return None if seed is None else torch.Generator(device=device).manual_seed(seed)

    def _completion(self, ids: list[int], logprobs: list[float], params: SamplingParams) -> Completion:
        stops = set(params.stop_token_ids)
        end = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
        if end is None:
            return Completion(ids, logprobs, finished=False)
        return Completion(ids[:end], logprobs[:end], finished=True)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(rows, vocab) fp32 logits -> the scores sampled from, as transformers' warpers make them.

    Divided by the temperature, then all but the `top_k` largest set to -inf, then the smallest tokens whose
    probabilities sum to at most ``1 - top_p`` (the most likely one always stays). Greedy (temperature 0) keeps the raw
    logits.
    """
    if params.temperature == 0:
        return logits
    scores = logits / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - params.top_p
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores


def sample(scores: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row; row i draws from ``generators[i]`` (the default stream if None)."""
    probs = scores.softmax(-1)
    return torch.cat([torch.multinomial(probs[i : i + 1], 1, generator=g).squeeze(-1)
                      for i, g in enumerate(generators)])


def _sharded(model: Any) -> bool:
    """Whether the policy's forward is a collective (FSDP2 / tensor-parallel DTensor parameters)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _all_done(done: torch.Tensor, sharded: bool) -> bool:
    """Every row stopped, on every rank when the forward is a collective.

    A rank that stopped early would leave its peers waiting in the next forward's all-gather.
    """
    pending = (~done).any().float()
    if sharded:
        import torch.distributed as dist

        dist.all_reduce(pending, op=dist.ReduceOp.MAX)
    return pending.item() == 0
