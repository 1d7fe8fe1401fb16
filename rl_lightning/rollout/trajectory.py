"""Turning prompts into scored trajectories with an engine: single- or multi-turn, token-in/token-out.

Generated tokens are kept exactly as sampled (never re-tokenised) and are the only training targets; text the
environment adds (tool results, the chat template's turn markers) is tokenised and appended with mask 0. Each turn's
context text is the difference between the chat template's rendering of the conversation before and after the tool
messages, so the token sequence is what the template would produce.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from rl_lightning.data.prompts import Prompt
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.engines.lockstep import Lockstep, generate
from rl_lightning.engines.protocol import Completion, RolloutEngine, SamplingParams, derive_seed
from rl_lightning.envs.environment import Environment
from rl_lightning.errors import DataError
from rl_lightning.memory.phases import phase


@dataclass
class Trajectory:
    """One sampled conversation.

    Its tokens, which the loss trains on (`completion_mask`: the generated ones, or none of a cut completion that
    overlong filtering dropped; `completion_length` counts what was generated either way), the engine's
    log-probabilities of the generated tokens (0 elsewhere), the decoded conversation and its reward. With in-flight
    weight updates (`rl_lightning.rollout.inflight`) also the policy version that sampled each token
    (`policy_versions`, -1 on tokens not generated) and the version of the policy the trainer updates with it
    (`trained_version`, set when the rollout is handed over): each token's lag between the two rides along into the
    loss (``policy_lags``).
    """

    prompt: Prompt
    input_ids: list[int]
    completion_mask: list[int]
    engine_logprobs: list[float]
    messages: list[dict]
    finished: bool
    turns: int = 1
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    policy_versions: list[int] | None = None
    trained_version: int | None = None
    generated_tokens: int | None = None  # set where the loss stops counting them all (overlong filtering)

    @property
    def completion_length(self) -> int:
        """The number of generated tokens (all turns), whether or not the loss counts them (`loss_tokens`)."""
        return self.loss_tokens if self.generated_tokens is None else self.generated_tokens

    @property
    def loss_tokens(self) -> int:
        """The generated tokens the loss counts: all of them, or none where overlong filtering dropped a cut one."""
        return sum(self.completion_mask)

    def example(self, **values: list[float]) -> TokenizedExample:
        """As a packing unit: targets are the generated tokens; per-token `values` (e.g. advantages) ride along."""
        if self.policy_versions is not None and self.trained_version is not None:
            values = {"policy_lags": [float(self.trained_version - v) if m else 0.0
                                      for v, m in zip(self.policy_versions, self.completion_mask, strict=True)],
                      **values}
        return TokenizedExample(self.input_ids, self.completion_mask, values={"engine_logprobs": self.engine_logprobs,
                                                                              **values})


@dataclass
class Rollout:
    """What the rollout callback hands the task for one batch of prompts (``batch["rollout"]``).

    Attributes:
        trajectories: this rank's scored trajectories, grouped by prompt (`group_size` consecutive completions each).
        group_size: completions per prompt.
        reward_names: names of the reward's components (empty for a scalar reward_fn).
        reward_failures: reward_fn failures scored 0 so far in the run (``on_error: zero``).
        refills: dynamic-sampling refill rounds so far in the run.
        metrics: this rollout's timings and counters, logged as they are (``rollout/generate_s``, ...).
    """

    trajectories: list[Trajectory]
    group_size: int
    reward_names: list[str] = field(default_factory=list)
    reward_failures: int = 0
    refills: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _start(prompt: Prompt, completion: Completion, tokenizer: Any) -> Trajectory:
    logprobs = completion.logprobs or [0.0] * len(completion.token_ids)
    text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    versions = None if completion.versions is None else [-1] * len(prompt.prompt_ids) + list(completion.versions)
    return Trajectory(
        prompt, prompt.prompt_ids + completion.token_ids, [0] * len(prompt.prompt_ids) + [1] * len(completion.token_ids),
        [0.0] * len(prompt.prompt_ids) + list(logprobs), prompt.messages + [{"role": "assistant", "content": text}],
        completion.finished, policy_versions=versions,
    )


def _context_tokens(tokenizer: Any, trajectory: Trajectory, tool_messages: list[dict], generated: list[int]) -> list[int]:
    """Tokens between the last generated token and the next generation.

    The rest of the assistant turn as the template renders it (e.g. the newline after the end-of-turn token), the tool
    messages, the generation prompt.
    """
    before = _render(tokenizer, trajectory.messages[:-1], True) + tokenizer.decode(generated)
    after = _render(tokenizer, trajectory.messages + tool_messages, True)
    if not after.startswith(before):
        raise DataError(
            f"{trajectory.prompt.where}: the chat template does not render the generated assistant turn as a prefix of "
            "the conversation with the tool messages, so tool tokens cannot be appended token-in/token-out"
        )
    return tokenizer(after[len(before) :], add_special_tokens=False)["input_ids"]


def continuation_seeds(params: SamplingParams, active: list[int], turn: int) -> list[int] | None:
    """Each continuation its own seed, ``derive_seed(its prompt's seed, turn, its sample)`` (None: unseeded).

    `active` are trajectory indices (prompt ``i // n``, sample ``i % n``); the turn-0 samples draw from
    ``params.sample_seed(prompt, sample)``, a hash of other keys, so no two turns of a rollout share a random stream.
    """
    if params.request_seed(0) is None:
        return None
    seeds = []
    for i in active:
        seed = params.request_seed(i // params.n)
        assert seed is not None  # seeded sampling seeds every prompt (`seeds` or `seed`)
        seeds.append(derive_seed(seed, turn, i % params.n))
    return seeds


def rollout(engine: RolloutEngine, prompts: list[Prompt], env: Environment, tokenizer: Any, params: SamplingParams,
            max_turns: int = 1, lockstep: Lockstep | None = None, max_model_len: int | None = None
            ) -> list[Trajectory]:
    """`params.n` scored trajectories per prompt (grouped: prompt 0's first).

    Multi-turn when `max_turns` > 1 and the environment has ``interact``: a turn ends at a stop token;
    ``interact(messages)`` returns tool messages to append (``[]`` ends the conversation), then generation continues,
    up to `max_turns` assistant turns. Truncated turns (no stop token) end the conversation. ``interact`` runs in the
    environment's workers when it has them (`rl_lightning.envs.environment.Environment.interact_all`: a call that fails or
    times out ends its conversation or stops the run, as ``on_error`` says). With `lockstep` (an engine whose forward
    is a collective), a turn runs on every rank while any rank has a conversation going; the others generate a
    filler (`rl_lightning.engines.lockstep`). A conversation whose next turn would not fit the engine's context
    (its tokens, the tool messages' and `max_new_tokens` past `max_model_len`; None: the engine's own
    ``max_model_len`` attribute, if any) ends before the tool messages, counted in the environment's
    ``overlong_conversations``: the engine never gets a prompt it would refuse.
    """
    limit = max_model_len if max_model_len is not None else getattr(engine, "max_model_len", None)
    with phase("rollout/generate"):
        groups = generate(engine, [p.prompt_ids for p in prompts], params, lockstep)
    trajectories = [_start(p, c, tokenizer) for p, group in zip(prompts, groups, strict=True) for c in group]
    last_generated = [c.token_ids for group in groups for c in group]
    for turn in range(1, max_turns):
        if env.interact is None:  # single-turn environment
            break
        active = [i for i, t in enumerate(trajectories) if t.finished and t.turns == turn]
        replies = env.interact_all([(trajectories[i].messages, trajectories[i].prompt.where) for i in active])
        tool_messages = dict(zip(active, replies, strict=True))
        contexts = {i: _context_tokens(tokenizer, trajectories[i], tool_messages[i], last_generated[i])
                     for i in active if tool_messages[i]}
        fits = {i for i, context in contexts.items()
                if limit is None or len(trajectories[i].input_ids) + len(context) + params.max_new_tokens <= limit}
        env.overlong_conversations += len(contexts) - len(fits)
        active = [i for i in active if i in fits]
        if not (active if lockstep is None else lockstep.any(bool(active))):
            break
        for i in active:
            context = contexts[i]
            t = trajectories[i]
            t.input_ids += context
            t.completion_mask += [0] * len(context)
            t.engine_logprobs += [0.0] * len(context)
            if t.policy_versions is not None:
                t.policy_versions += [-1] * len(context)
            t.messages = t.messages + tool_messages[i]
        seeded = replace(params, n=1, seed=None, seeds=continuation_seeds(params, active, turn))
        with phase("rollout/generate"):
            continuations = generate(engine, [trajectories[i].input_ids for i in active], seeded, lockstep)
        for i, (completion,) in zip(active, continuations, strict=True):
            t = trajectories[i]
            t.input_ids += completion.token_ids
            t.completion_mask += [1] * len(completion.token_ids)
            t.engine_logprobs += completion.logprobs or [0.0] * len(completion.token_ids)
            if t.policy_versions is not None and completion.versions is not None:
                t.policy_versions += completion.versions
            text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            t.messages = t.messages + [{"role": "assistant", "content": text}]
            t.finished, t.turns = completion.finished, turn + 1
            last_generated[i] = completion.token_ids
    with phase("rollout/score"):
        scores = env.score_all([(t.messages, t.prompt.answer, t.prompt.where) for t in trajectories])
    for t, (reward, components) in zip(trajectories, scores, strict=True):
        t.reward, t.reward_components = reward, components
    return trajectories
