"""On-policy distillation in the PPO task: ``model.distill.*`` and the teacher.

The student (the policy) samples; a frozen teacher scores the student's own tokens. Two uses of the teacher
(`rl_lightning.algorithms.distill`):

- ``type: reward`` (default; prime-rl's ``opd``, Thinking Machines' on-policy distillation): each completion token's
  advantage gains ``coef`` x (log pi_teacher - log pi_student) of the sampled token (discount 0), next to the task
  reward's advantages (which may be zero: ``rollout.reward_weights`` all 0 is distillation alone). Both
  log-probabilities are taken at the rollout's temperature when the rollout is scored, so the term is fixed for
  the rollout's updates and goes through PPO's clipped surrogate like any advantage.
- ``type: loss`` (GKD): ``coef`` x the generalised Jensen-Shannon divergence JSD_beta between the teacher's and the
  student's next-token distributions over the whole vocabulary at every completion position, a token mean with the
  same global normaliser as the policy loss, added to it. It costs a second forward of the policy with full logits
  and a teacher forward per micro-batch. GKD's on-policy fraction ``lmbda`` (`DatasetCompletions`): each rollout is,
  with probability 1 - lambda (drawn per rollout from the run's seed, ``seed_everything``, and the rollout count, so
  every rank and a resumed run agree), the batch's prompts with their rows' ``completion`` text instead of sampled
  completions (repeated ``responses_per_prompt`` times, so the rollout's shape and optimizer steps are a sampled
  one's; nothing is generated or scored). Such a rollout trains on the JSD alone: the surrogate, KL and entropy
  terms are estimates over the policy's own samples and are left out. ``train/distill_on_policy`` logs 1 or 0 per
  rollout (its mean is the on-policy fraction); ``train/reward`` of a dataset rollout is 0 (not scored).

The teacher is any causal LM folder (hub name, ``asset:``) with the student's tokenizer, colocated: loaded frozen
(no gradients, no optimizer state, not in checkpoints), sharded like the reference. When it names the policy's own
``model.lm.name`` under LoRA, it is the policy with its adapters disabled (no second copy). Either way
``train/distill_reverse_kl`` logs the per-token mean of log pi_student - log pi_teacher of the sampled tokens (the
k1 estimate of KL(student || teacher) of the sampling policy). A served teacher is not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from rl_lightning.algorithms.advantages import CRITIC_ESTIMATORS
from rl_lightning.algorithms.distill import generalized_jsd, on_policy_draw
from rl_lightning.algorithms.policy import token_mean
from rl_lightning.assets.real import resolve_model
from rl_lightning.data.datamodule import run_seed
from rl_lightning.errors import ConfigError
from rl_lightning.models.head_chunks import head_inputs, head_weight, map_head_chunks
from rl_lightning.models.loading import load_causal_lm, load_tokenizer
from rl_lightning.models.logprobs import model_inputs
from rl_lightning.models.lora import AdaptersDisabled
from rl_lightning.parallel.parallelize import parallelize_for
from rl_lightning.rollout.config import RolloutConfig
from rl_lightning.rollout.trajectory import Rollout, Trajectory

DISTILL_TYPES = ("reward", "loss")


@dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation from a frozen teacher (``model.distill.*``; null: off).

    Args:
        teacher: the teacher: a causal LM folder, hub name or ``asset:<name>`` with the student's tokenizer; the
            policy's own ``model.lm.name`` under ``model.lm.lora`` means the base model (adapters disabled).
        coef: weight of the distillation term (reward or loss).
        type: ``reward`` (per-token reverse-KL reward added to the advantages) or ``loss`` (GKD's generalised JSD
            over the vocabulary, added to the policy loss).
        beta: ``type: loss``: JSD_beta's teacher weight in [0, 1]; 0 is the forward KL(teacher || student), 1 the
            reverse KL(student || teacher), 0.5 the Jensen-Shannon divergence.
        lmbda: ``type: loss``: GKD's on-policy fraction in [0, 1]: each rollout trains on the student's own samples
            with this probability, else on the prompt rows' ``completion`` texts (JSD only); 1: always on-policy.
    """

    teacher: str
    coef: float = 1.0
    type: str = "reward"
    beta: float = 0.5
    lmbda: float = 1.0

    def __post_init__(self) -> None:
        errors = []
        if not self.teacher:
            errors.append("model.distill.teacher is empty: name the teacher's folder or hub id")
        if self.coef <= 0:
            errors.append(f"model.distill.coef must be > 0, got {self.coef}")
        if self.type not in DISTILL_TYPES:
            errors.append(f"model.distill.type must be one of {', '.join(DISTILL_TYPES)}, got '{self.type}'")
        if not 0.0 <= self.beta <= 1.0:
            errors.append(f"model.distill.beta must be in [0, 1], got {self.beta}")
        if not 0.0 <= self.lmbda <= 1.0:
            errors.append(f"model.distill.lmbda must be in [0, 1], got {self.lmbda}")
        elif self.lmbda < 1.0 and self.type != "loss":
            errors.append(f"model.distill.lmbda={self.lmbda} mixes in dataset completions, which only the JSD loss "
                          "can train on: set model.distill.type loss, or lmbda 1")
        if errors:
            raise ConfigError("; ".join(errors))


def distill_config(value: Any) -> DistillConfig | None:
    """The ``distill`` argument as a `DistillConfig` (the CLI passes one, a checkpoint a dict), or None."""
    return DistillConfig(**value) if isinstance(value, dict) else value


def check_teacher(config: DistillConfig, student_tokenizer: Any, model_name: str, aggregation: str) -> None:
    """Refuse, at construction, a teacher that is missing or tokenizes differently from the student (one line)."""
    if config.type == "loss" and aggregation == "sequence_mean":
        raise ConfigError("model.distill.type=loss is a token mean and needs model.aggregation token_mean or "
                          "token_sum, got 'sequence_mean'; change one of them")
    name, fix = config.teacher, "set model.distill.teacher to a causal LM folder or hub id with the student's tokenizer"
    try:
        path = resolve_model(name)  # asset:<name> -> its built folder (or an error saying how to build it)
    except ConfigError as e:
        raise ConfigError(f"model.distill.teacher: {e}") from None
    local = path.startswith(("/", "./", "../", "~")) or path.count("/") > 1 or Path(path).expanduser().exists()
    if local and not Path(path).expanduser().is_dir():
        raise ConfigError(f"model.distill.teacher '{name}': no such model folder ({Path(path).expanduser().resolve()})"
                          f"; {fix}")
    if name == model_name:
        return
    try:
        teacher_vocab = load_tokenizer(path).get_vocab()
    except ConfigError as e:
        reason = str(e).split(": ", 1)[-1].removesuffix("; check model.lm.name")
        raise ConfigError(f"model.distill.teacher '{name}': cannot load its tokenizer ({reason}); {fix}") from None
    student_vocab = student_tokenizer.get_vocab()
    if teacher_vocab != student_vocab:
        differ = len(set(teacher_vocab.items()) ^ set(student_vocab.items()))
        raise ConfigError(f"model.distill.teacher '{name}' has a different tokenizer from model.lm.name "
                          f"'{model_name}' ({len(teacher_vocab)} vs {len(student_vocab)} tokens, {differ} entries "
                          "differ): the teacher scores the student's token ids, so pick a teacher with the same "
                          "tokenizer (token mappings are not supported)")


def load_teacher(task: Any, config: DistillConfig, student: Any) -> Any:
    """The frozen teacher of `task` (a `rl_lightning.tasks.PPO`) for its policy `student`.

    The base under LoRA (`student` with its adapters disabled), else a loaded, sharded copy.
    """
    lm = task.lm
    if config.teacher == lm.name and lm.lora is not None:
        return AdaptersDisabled(student)
    # frozen: bf16 weights when the run computes in bf16 (half the memory of fp32 masters it never updates)
    dtype = torch.bfloat16 if str(task.trainer.precision).startswith("bf16") else None
    teacher = load_causal_lm(config.teacher, dtype=dtype, attn_implementation=lm.attn_implementation)
    student_vocab, teacher_vocab = student.get_output_embeddings().weight.shape[0], teacher.config.vocab_size
    if config.type == "loss" and student_vocab != teacher_vocab:
        raise ConfigError(f"model.distill.type=loss compares full distributions, but the teacher "
                          f"'{config.teacher}' has {teacher_vocab} output logits and the student {student_vocab}; "
                          "use model.distill.type reward (it compares sampled tokens only)")
    return parallelize_for(task, teacher.eval().requires_grad_(False), trainable=False)


def jsd_loss(model: Any, teacher: Any, mb: dict[str, Any], normaliser: torch.Tensor, config: DistillConfig,
             temperature: float, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``coef`` x this micro-batch's share of the token-mean JSD_beta(teacher || student), and the JSD's token sum.

    Args:
        model: the policy (a forward with gradients and full logits at the target positions).
        teacher: the frozen teacher.
        mb: the packed micro-batch (``target_mask``).
        normaliser: the minibatch's global token normaliser (the policy loss's).
        config: ``model.distill``.
        temperature: the rollout's temperature (both distributions are taken at it).
        chunk_size: ``model.lm.lm_head_chunk``: the JSD `chunk_size` positions at a time, neither model's
            ``[K, V]`` logits whole (`chunked_jsd`); None: both models' full logits.

    Returns:
        The scalar loss and the (detached) sum of the per-token JSD over the target tokens.
    """
    mask = mb["target_mask"].float()  # (1, N)
    keep = (mask > 0).any(0).nonzero()[:, 0]
    if len(keep) == 0:  # a filler micro-batch: one position, so the backward still reaches every parameter
        keep = keep.new_zeros(1)
    if chunk_size is not None:
        per_token = chunked_jsd(model, teacher, mb, keep, config.beta, temperature, chunk_size)  # (1, K)
    else:
        student_logits = model(**model_inputs(mb), logits_to_keep=keep).logits  # (1, K, V)
        with torch.no_grad():
            teacher_logits = teacher(**model_inputs(mb), logits_to_keep=keep).logits  # (1, K, V)
        per_token = generalized_jsd(student_logits, teacher_logits, config.beta, temperature)  # (1, K)
    kept_mask = mask[:, keep]  # (1, K)
    return config.coef * token_mean(per_token, kept_mask, normaliser), (per_token.detach() * kept_mask).sum()


def chunked_jsd(model: Any, teacher: Any, mb: dict[str, Any], keep: torch.Tensor, beta: float, temperature: float,
                chunk_size: int) -> torch.Tensor:
    """(1, K) JSD_beta(teacher || student) at positions `keep`, `chunk_size` positions at a time.

    The teacher's forward stops before its head (its (1, K, H_t) hidden states, no gradient); the student's head runs
    chunk by chunk inside the student's forward (`map_head_chunks`), each chunk's teacher logits computed from the
    teacher's gathered head weight beside it, under checkpointing: the largest vocabulary tensors are (chunk, V).
    """
    with torch.no_grad():
        teacher_hidden = head_inputs(teacher, mb, keep, chunk_size)  # (1, K, H_t)
        weight, bias = head_weight(teacher)  # (V, H_t): gathered once for the micro-batch

    def per_chunk(student_logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = torch.nn.functional.linear(hidden, weight.to(hidden.dtype),
                                                        None if bias is None else bias.to(hidden.dtype))  # (C, V)
        return generalized_jsd(student_logits, teacher_logits, beta, temperature)  # (C,)

    return map_head_chunks(model, mb, keep, per_chunk, [teacher_hidden], chunk_size)


class DatasetCompletions(L.Callback):
    """GKD's lambda: before a rollout is sampled, draw whether it is on-policy; if not, attach the dataset's.

    Runs before the `rl_lightning.rollout.callback.RolloutCallback`, which keeps a rollout already attached.
    `on_policy` is the current rollout's draw (`rl_lightning.tasks.ppo.losses.MicroBatchLosses.policy` reads it).
    """

    def __init__(self, lmbda: float, seed: int, group_size: int, max_new_tokens: int) -> None:
        self.lmbda, self.seed, self.group_size, self.max_new_tokens = lmbda, seed, group_size, max_new_tokens
        self.on_policy = True

    @classmethod
    def create(cls, config: DistillConfig | None, rollout: RolloutConfig, advantage_estimator: str,
               constraints: Any) -> DatasetCompletions | None:
        """The callback of ``model.distill.type: loss`` (None otherwise); refuses what lmbda < 1 cannot run with."""
        if config is None or config.type != "loss":
            return None
        if config.lmbda < 1.0:
            clashes = {"model.advantage_estimator": advantage_estimator in CRITIC_ESTIMATORS,
                       "model.constraints": constraints.entropy_min is not None or constraints.kl_max is not None,
                       "model.rollout.async_steps": rollout.async_steps > 0,
                       "model.rollout.replay": rollout.replay is not None}
            if any(clashes.values()):
                raise ConfigError(f"model.distill.lmbda={config.lmbda} (dataset-completion rollouts train on the JSD "
                                  f"alone: no rewards, values or policy measurements) does not run with "
                                  f"{', '.join(k for k, v in clashes.items() if v)} set; use a critic-free "
                                  "estimator, no constraints, synchronous sampled rollouts, or lmbda 1")
        return cls(config.lmbda, 0, rollout.responses_per_prompt, rollout.max_new_tokens)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Take the run's seed; refuse, before any model loads, training prompts without a ``completion`` (lmbda < 1)."""
        self.seed = run_seed(getattr(trainer, "datamodule", None))
        prompts = getattr(getattr(trainer, "datamodule", None), "prompts", {}).get("train", [])
        missing = next((p for p in prompts if p.completion is None), None) if self.lmbda < 1.0 else None
        if stage == "fit" and missing is not None:
            raise ConfigError(f"model.distill.lmbda={self.lmbda} trains 1 - lambda of the rollouts on the dataset's "
                              f"completions, but {missing.where} has no 'completion' field; give every prompt row its "
                              "reference completion text as 'completion', or set model.distill.lmbda 1")

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict,
                             batch_idx: int) -> None:
        """Draw this rollout's kind (seed, rollout count); a dataset rollout is attached to the batch."""
        task: Any = pl_module
        self.on_policy = on_policy_draw(self.seed, task.rollouts, self.lmbda)
        pl_module.log("train/distill_on_policy", float(self.on_policy))
        if not self.on_policy:
            batch["rollout"] = dataset_rollout(batch["prompts"], task.tokenizer, self.group_size, self.max_new_tokens)


def dataset_rollout(prompts: list[Any], tokenizer: Any, group_size: int, max_new_tokens: int) -> Rollout:
    """The prompts with their rows' ``completion`` text (then EOS), each `group_size` times, as an unscored Rollout.

    A completion longer than `max_new_tokens` tokens is cut there (``finished`` False), as sampling would cut it.
    """
    trajectories = []
    for prompt in prompts:
        ids = (tokenizer(prompt.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        finished = len(ids) <= max_new_tokens
        ids = ids[:max_new_tokens]
        messages = [*prompt.messages, {"role": "assistant", "content": prompt.completion}]
        trajectories += [Trajectory(prompt, prompt.prompt_ids + ids, [0] * len(prompt.prompt_ids) + [1] * len(ids),
                                    [0.0] * (len(prompt.prompt_ids) + len(ids)), messages, finished)
                         for _ in range(group_size)]
    return Rollout(trajectories, group_size)
