"""Prompt DataModule for reinforcement learning: each batch is one rollout's prompts for this data-parallel rank.

Rows are ``{"messages": [prompt...], "answer": ...}``. Prompts are rendered with the chat template and the generation
prompt (or concatenated for base models) and tokenised once at ``setup``. Prompts longer than `max_prompt_length` are
dropped, counted and logged (never truncated: a cut question has no right answer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from rl_lightning.data.curriculum import CurriculumConfig, PromptCurriculum, check_curriculum_task
from rl_lightning.data.datamodule import load_tokenizer_for_data, saved_hparams
from rl_lightning.data.loading import Rows, load_rows
from rl_lightning.data.rows import check_prompt_rows
from rl_lightning.data.steps import check_enough_rows
from rl_lightning.errors import ConfigError, DataError
from rl_lightning.parallel.reductions import process_groups

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    """A tokenised prompt with what the reward function needs (`messages`, `answer`).

    It also carries its row location, its position in the loaded prompt list (`index`, which seeds its sampling) and
    the row's optional reference ``completion`` text (GKD's dataset completions, ``model.distill.lmbda`` < 1).
    """

    prompt_ids: list[int]
    messages: list[dict]
    answer: Any
    where: str
    index: int = 0
    completion: str | None = None


def encode_prompt(tokenizer: Any, messages: list[dict], apply_chat_template: bool) -> list[int]:
    """Token ids of the prompt `messages`: chat template with the generation prompt, or the contents concatenated."""
    if apply_chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class PromptBatches(IterableDataset):
    """Yields this rank's share (a list of `Prompt`) of each rollout's global prompt batch.

    Every rank walks the same seeded permutation, and a run resumed mid-epoch continues at the next rollout. Training
    drops the last partial batch; with `keep_last` (validation) it is yielded too, split over the ranks (some shares
    may be empty).
    """

    def __init__(self, prompts: list[Prompt], per_rank: int, dp_rank: int, dp_size: int, shuffle: bool,
                 epoch_fn: Callable[[], int] = lambda: 0, start_fn: Callable[[], int] = lambda: 0,
                 keep_last: bool = False, seed: int = 0) -> None:
        self.prompts, self.per_rank, self.dp_rank, self.dp_size = prompts, per_rank, dp_rank, dp_size
        self.shuffle, self.epoch_fn, self.start_fn, self.keep_last = shuffle, epoch_fn, start_fn, keep_last
        self.seed = seed  # the run's seed: epoch e walks the permutation seeded seed + e

    def __len__(self) -> int:
        rows = self.per_rank * self.dp_size
        return -(-len(self.prompts) // rows) if self.keep_last else len(self.prompts) // rows

    def __iter__(self):
        order = self._order(self.epoch_fn())
        for step in range(self.start_fn(), len(self)):
            yield self._share(order, step)

    def share(self, epoch: int, step: int) -> list[Prompt]:
        """This rank's prompts of batch `step` of `epoch`: what iterating yields there.

        The asynchronous rollout callback reads the next batch ahead with it, without touching the dataloader.
        """
        return self._share(self._order(epoch), step)

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.prompts))
        return torch.randperm(len(self.prompts), generator=torch.Generator().manual_seed(self.seed + epoch))

    def _share(self, order: torch.Tensor, step: int) -> list[Prompt]:
        rows = self.per_rank * self.dp_size
        mine = order[step * rows + self.dp_rank * self.per_rank : step * rows + (self.dp_rank + 1) * self.per_rank]
        return [self.prompts[i] for i in mine.tolist()]


class PromptDataModule(L.LightningDataModule):
    """Prompts with reference answers for RL.

    Args:
        path: training prompts (local JSON/JSONL/CSV/Parquet/Arrow, ``save_to_disk`` folder or Hugging Face name);
            rows ``{"messages": [...], "answer": ...}``.
        tokenizer_name: tokenizer (linked from ``model.lm.name`` by the CLI).
        val_path: optional held-out prompts, scored at validation (``val/reward``).
        val_paths: several named held-out sets instead, ``{name: path}``: each is scored at validation
            (``val/<name>/reward``, ...) and ``val/reward`` is the mean over all their trajectories; not with
            `val_path`.
        split: split for Hugging Face datasets and ``DatasetDict`` folders.
        max_prompt_length: prompts with more tokens are dropped and counted (``data/train_dropped``).
        apply_chat_template: render with the chat template and generation prompt; False concatenates contents.
        batch_size: prompts per rollout per data-parallel rank (each gets ``responses_per_prompt`` completions).
        shuffle: reshuffle every epoch (seeded by the run's seed, `seed`).
        curriculum: a difficulty curriculum over the training prompts (``data.curriculum.*``, see
            `rl_lightning.data.curriculum.CurriculumConfig`): prompts the policy always or never solves are parked
            and re-admitted later; GRPO-style tasks only (``model.rollout.responses_per_prompt`` >= 2). Null: off.

    Attributes:
        seed: the run's one seed (the data order here; the rollout's sampling seeds read it too). The CLI sets it
            from ``seed_everything``; from Python, set it before ``fit`` (default 0).
    """

    seed: int = 0

    def __init__(
        self,
        path: str,
        tokenizer_name: str | None = None,
        val_path: str | None = None,
        val_paths: dict[str, str] | None = None,
        split: str = "train",
        max_prompt_length: int = 512,
        apply_chat_template: bool = True,
        batch_size: int = 8,
        shuffle: bool = True,
        curriculum: CurriculumConfig | None = None,
    ) -> None:
        super().__init__()
        if isinstance(curriculum, dict):  # from a checkpoint's hyperparameters
            curriculum = CurriculumConfig(**curriculum)
        errors = []
        if max_prompt_length < 1:
            errors.append(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        if batch_size < 1:
            errors.append(f"data.batch_size must be >= 1, got {batch_size}")
        errors += _val_paths_errors(val_path, val_paths)
        if errors:
            raise ConfigError("; ".join(errors))
        self.save_hyperparameters(logger=False)
        if curriculum is not None:  # checkpoints keep plain data
            self.hparams.update(curriculum=asdict(curriculum))
        self.tokenizer = load_tokenizer_for_data(tokenizer_name)
        self.curriculum: PromptCurriculum | None = None  # built at setup (it needs the prompts)
        self.prompts: dict[str, list[Prompt]] = {}
        self.stats: dict[str, int] = {}
        self.val_names: list[str] = list(val_paths or {})  # the named held-out sets, in dataloader order
        if val_path is None and not val_paths:
            self.val_dataloader = None  # type: ignore[method-assign,assignment]

    def _load(self, rows: Rows, name: str) -> list[Prompt]:
        hp = saved_hparams(self)
        check_prompt_rows(rows)
        prompts: list[Prompt] = []
        for i, row in enumerate(rows.rows):
            ids = encode_prompt(self.tokenizer, row["messages"], hp.apply_chat_template)
            if len(ids) <= hp.max_prompt_length:
                prompts.append(Prompt(ids, row["messages"], row["answer"], rows.locate(i), len(prompts),
                                      row.get("completion")))
        dropped = len(rows) - len(prompts)
        if not prompts:
            raise DataError(f"{rows.source}: every prompt is longer than data.max_prompt_length="
                            f"{hp.max_prompt_length}; raise it")
        if dropped:
            log.warning("%s: dropped %d of %d prompts longer than data.max_prompt_length=%d", rows.source, dropped,
                        len(rows), hp.max_prompt_length)
        self.stats.update({f"data/{name}_rows": len(rows), f"data/{name}_dropped": dropped})
        return prompts

    @override
    def setup(self, stage: str) -> None:
        hp = saved_hparams(self)
        for name, path in (("train", hp.path), ("val", hp.val_path)):
            if path and name not in self.prompts:
                self.prompts[name] = self._load(load_rows(path, hp.split), name)
        for name, path in (hp.val_paths or {}).items():
            if f"val/{name}" not in self.prompts:
                try:
                    rows = load_rows(path, hp.split)
                except DataError as e:
                    raise DataError(f"data.val_paths.{name}: {e}") from None
                self.prompts[f"val/{name}"] = self._load(rows, f"val_{name}")
        check_enough_rows(len(self.prompts["train"]), hp.batch_size, process_groups(self.trainer).dp_size, hp.path)
        if hp.curriculum is not None and self.curriculum is None:
            check_curriculum_task(getattr(self.trainer, "lightning_module", None))
            self.curriculum = PromptCurriculum(CurriculumConfig(**hp.curriculum), len(self.prompts["train"]),
                                               self.seed)

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """With a curriculum, a training batch's prompts are drawn now, from the pass rates of every rollout so far.

        Here rather than in the dataset: Lightning fetches the next batch before the current one is trained on.
        """
        if self.curriculum is None or not (self.trainer and self.trainer.training):
            return batch
        per_rank = saved_hparams(self).batch_size
        groups = process_groups(self.trainer)
        dp_rank, dp_size = groups.dp_rank, groups.dp_size
        drawn = self.curriculum.draw(per_rank * dp_size)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        return {**batch, "prompts": [self.prompts["train"][i] for i in drawn]}

    @override
    def state_dict(self) -> dict[str, Any]:
        """The curriculum's state (checkpointed by Lightning with the run)."""
        return {} if self.curriculum is None else {"curriculum": self.curriculum.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the curriculum's state (Lightning calls this after `setup`)."""
        if self.curriculum is not None and "curriculum" in state_dict:
            self.curriculum.load_state_dict(state_dict["curriculum"])

    def _loader(self, name: str, shuffle: bool) -> DataLoader:
        groups = process_groups(self.trainer)
        dp_rank, dp_size = groups.dp_rank, groups.dp_size
        trainer = self.trainer
        dataset = PromptBatches(
            self.prompts[name], saved_hparams(self).batch_size, dp_rank, dp_size, shuffle,
            lambda: trainer.current_epoch if trainer else 0,
            (lambda: trainer.fit_loop.epoch_loop.batch_progress.current.completed)
            if trainer and name == "train" else (lambda: 0),
            keep_last=name != "train", seed=self.seed,
        )
        # A dict the rollout callback can extend in place (``batch["rollout"]``); prompts stay Python objects.
        return DataLoader(dataset, batch_size=None, collate_fn=lambda prompts: {"prompts": prompts})

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", saved_hparams(self).shuffle)

    @override
    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        if self.val_names:  # one dataloader per named set: Lightning passes its index to validation_step
            return [self._loader(f"val/{name}", False) for name in self.val_names]
        return self._loader("val", False)


def _val_paths_errors(val_path: str | None, val_paths: dict[str, str] | None) -> list[str]:
    if val_paths is None:
        return []
    if val_path is not None:
        return [f"data.val_path={val_path!r} and data.val_paths are exclusive: set data.val_path to null (a recipe may "
                "set it), naming that set in val_paths to keep it"]
    if not val_paths:
        return ["data.val_paths is empty: give {name: path} pairs, or null"]
    bad = [n for n in val_paths if not n or "/" in n or n in ("reward", "completion_length")]
    if bad:
        return [f"data.val_paths names {bad} must be non-empty, without '/', and not 'reward' or 'completion_length' "
                "(they become metric names val/<name>/...)"]
    return []
