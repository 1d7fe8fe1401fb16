"""`HFEngine`: sampling with transformers on the policy model itself (colocated by construction, so its weights are
always the trainer's current ones). Slow, simple, exact; the reference the vLLM engine is tested against."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rl_lightning.algorithms import token_logprobs
from rl_lightning.rollout.engine import Completion, SamplingParams


class HFEngine:
    """Generate with ``model.generate`` (left-padded batches, no cache sharing between prompts).

    Args:
        model: the policy (a transformers causal LM), used in eval mode during generation.
        pad_token_id: filler for left padding.
    """

    def __init__(self, model: Any, pad_token_id: int) -> None:
        self.model, self.pad_token_id = model, pad_token_id

    def wake(self) -> None:
        pass

    def sleep(self) -> None:
        pass

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """No-op: the engine samples from the policy module itself."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        was_training = self.model.training
        self.model.eval()
        try:
            return [self._generate_one(prompt, params, index) for index, prompt in enumerate(prompts)]
        finally:
            self.model.train(was_training)

    def _generate_one(self, prompt: list[int], params: SamplingParams, index: int) -> list[Completion]:
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([prompt] * params.n, device=device)  # (n, P): one prompt, no padding needed
        generator_state, seed = None, params.request_seed(index)
        if seed is not None:  # per-request seeds: reproducible whatever else was sampled before
            generator_state = torch.random.get_rng_state()
            torch.manual_seed(seed)
        greedy = params.temperature == 0
        sampling = {} if greedy else {"temperature": params.temperature, "top_p": params.top_p,
                                      "top_k": params.top_k or None}
        try:
            out = self.model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=not greedy,
                max_new_tokens=params.max_new_tokens, eos_token_id=params.stop_token_ids or None,
                pad_token_id=self.pad_token_id, output_scores=True, return_dict_in_generate=True, use_cache=True,
                **sampling,
            )
        finally:
            if generator_state is not None:
                torch.random.set_rng_state(generator_state)
        new_tokens = out.sequences[:, input_ids.shape[1] :]  # (n, L)
        # Processed scores (after temperature/top-k/top-p): the distribution the tokens were sampled from.
        scores = torch.stack(out.scores, dim=1)  # (n, L, V)
        logprobs = token_logprobs(scores, new_tokens)  # (n, L)
        return [self._completion(new_tokens[i], logprobs[i], params) for i in range(params.n)]

    def _completion(self, tokens: torch.Tensor, logprobs: torch.Tensor, params: SamplingParams) -> Completion:
        ids = tokens.tolist()
        stops = set(params.stop_token_ids)
        end = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
        if end is None:
            return Completion(ids, logprobs.tolist(), finished=False)
        return Completion(ids[:end], logprobs[:end].tolist(), finished=True)
