"""A NaN/Inf loss or gradient skips that optimizer step (`rl_lightning.models.optim.optimizer_step`): parameters,
optimizer state, schedule and global step stay as they were, ``train/skipped_steps`` counts it and the run goes on,
in every task and with data parallelism (where one rank's NaN makes every rank skip); ``model.lm.optim.max_skipped_steps``
in a row stop the run with one line."""

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, REPO, TINY_MODEL
from faults import NaNGradient, NaNLoss
from helpers import fit, run_on_cpu_ranks, run_ppo

from rl_lightning.cli.main import main
from rl_lightning.data import PreferenceDataModule, SFTDataModule
from rl_lightning.errors import ConfigError
from rl_lightning.models.config import LMConfig
from rl_lightning.models.optim import OptimConfig
from rl_lightning.parallel import ParallelStrategy
from rl_lightning.tasks import DPO, SFT, RewardModel

OPTIM = {"lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 1}


def _state(trainer):
    """Everything a step changes: parameters (local shards), optimizer state, schedule, global step."""
    module = trainer.lightning_module
    optimizers = trainer.optimizers
    tensors = [p.detach().clone() for p in module.parameters()]
    for optimizer in optimizers:
        for state in optimizer.state.values():
            tensors += [v.detach().clone() for v in state.values() if torch.is_tensor(v)]
    return tensors, [s.scheduler.last_epoch for s in trainer.lr_scheduler_configs], trainer.global_step


def _to_local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class Snapshots(L.Callback):
    """The state before and after training batch `at`, and after the next one."""

    def __init__(self, at: int):
        self.at, self.states = at, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            self.states["before"] = _state(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx in (self.at, self.at + 1):
            self.states["after" if batch_idx == self.at else "next"] = _state(trainer)


def _same(a, b) -> bool:
    return len(a[0]) == len(b[0]) and all(torch.equal(_to_local(x), _to_local(y)) for x, y in zip(a[0], b[0],
                                                                                                  strict=True))


class ScriptedRewards(L.Callback):
    """Rewards 0, 1, 0, 1... in every prompt group (the tiny model scores 0 on every arithmetic prompt), except in
    training batches `equal`, where every completion scores 0: every advantage is zero, as in a rollout where no
    prompt group tells its samples apart."""

    def __init__(self, equal: list[int]) -> None:
        self.equal = equal

    def on_fit_start(self, trainer, pl_module) -> None:
        step = pl_module.training_step  # the rollout is attached after every callback's on_train_batch_start

        def training_step(batch, batch_idx):
            for i, trajectory in enumerate(batch["rollout"].trajectories):
                trajectory.reward = 0.0 if batch_idx in self.equal else float(i % 2)
            return step(batch, batch_idx)

        pl_module.training_step = training_step


def _sft(callbacks, max_steps=3, **trainer_kwargs):
    L.seed_everything(0)
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4, max_length=96,
                         max_length_per_device=256)
    return fit(SFT(LMConfig(str(TINY_MODEL), optim=OptimConfig(**OPTIM))), data, max_steps, callbacks, **trainer_kwargs)


def _pairs(task):
    def run(callbacks):
        L.seed_everything(0)
        data = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4,
                                    max_length=128, shuffle=False)
        return fit(task(LMConfig(str(TINY_MODEL), optim=OptimConfig(**OPTIM))), data, 3, callbacks)
    return run


def _ppo(callbacks):  # scripted rewards: the tiny model's own are all 0, and an all-zero gradient moves nothing
    return run_ppo(rollouts=3, callbacks=[ScriptedRewards(equal=[]), *callbacks], optim=OPTIM)[1]


@pytest.mark.parametrize(("run", "poison", "steps"), [(_sft, NaNLoss, 3), (_pairs(DPO), NaNLoss, 3),
                                                      (_pairs(RewardModel), NaNLoss, 3), (_ppo, NaNGradient, 2)],
                         ids=["sft", "dpo", "rm", "ppo"])
def test_a_non_finite_step_is_skipped_and_the_run_goes_on(run, poison, steps):
    snapshots = Snapshots(at=1)
    trainer = run([poison(batches=[1]), snapshots])
    states = snapshots.states
    before, after, following = states["before"], states["after"], states["next"]
    assert _same(before, after) and before[1:] == after[1:]  # parameters, optimizer state, schedule, global step
    assert not _same(after, following) and following[2] > after[2]  # the next step trains
    assert trainer.callback_metrics["train/skipped_steps"] == 1
    # skipped steps do not count: SFT, DPO and RM still take their 3 (trainer.max_steps), PPO its 3 rollouts
    assert trainer.global_step == steps


def _dp_worker(rank, out_dir):
    snapshots = Snapshots(at=1)
    trainer = _sft([NaNLoss(batches=[1], ranks=[1]), snapshots], devices=2,
                   strategy=ParallelStrategy(data_parallel_size=2))
    before, after = snapshots.states["before"], snapshots.states["after"]
    torch.save({"same": _same(before, after) and before[1:] == after[1:], "global_step": trainer.global_step,
                "skipped": float(trainer.callback_metrics["train/skipped_steps"])}, out_dir / f"rank{rank}.pt")


def test_one_ranks_nan_makes_every_data_parallel_rank_skip(tmp_path):
    run_on_cpu_ranks(_dp_worker, 2, tmp_path)
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == {"same": True, "global_step": 3, "skipped": 1.0}, rank


@pytest.mark.parametrize("value", [0, -1, True, 2.5])
def test_max_skipped_steps_must_be_a_positive_integer(value):
    with pytest.raises(ConfigError, match=rf"model.lm.optim.max_skipped_steps must be an integer >= 1, got {value!r}"):
        OptimConfig(max_skipped_steps=value)


def test_k_skipped_steps_in_a_row_stop_the_cli_run_with_one_line(workdir, capsys):
    overlay = workdir / "nan.yaml"
    overlay.write_text("trainer:\n  callbacks:\n    - class_path: faults.NaNLoss\n")
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "recipes/sft.yaml", "--config", str(overlay), "--model.lm.optim.max_skipped_steps", "3",
              "--trainer.max_steps", "10", "--trainer.limit_val_batches", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("rl_lightning: error:")]
    assert errors == ["rl_lightning: error: 3 optimizer steps in a row had a non-finite loss or gradient (grad norm "
                      "nan) and were skipped (model.lm.optim.max_skipped_steps=3); lower model.lm.optim.lr, check the data, "
                      "or raise model.lm.optim.max_skipped_steps"], err[-3000:]
    assert "Traceback" not in err


def _resume(model, data, path, max_steps, callbacks=()):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(model, datamodule=data, ckpt_path=str(path))
    return trainer


@pytest.mark.parametrize("task", ["sft", "ppo"])
def test_skipped_step_counts_survive_a_checkpoint(task, tmp_path):
    """A run resumed from a checkpoint written after a skipped step goes on from the same count: it logs
    ``train/skipped_steps`` 1 (not 0) at its next step, and the open streak is restored; so does the count of empty
    steps (PPO: the first rollout scores every completion alike)."""
    from helpers import ppo_task, prompts

    path = tmp_path / "skipped.ckpt"

    class SaveAfterTheSkip(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                trainer.save_checkpoint(path)

    if task == "sft":
        first = _sft([NaNLoss(batches=[1]), SaveAfterTheSkip()], max_steps=2)  # batch 1 is skipped, batch 2 trains
        L.seed_everything(0)
        data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4,
                             max_length=96, max_length_per_device=256)
        resumed = _resume(SFT(LMConfig(str(TINY_MODEL), optim=OptimConfig(**OPTIM))), data, path, max_steps=3)
    else:
        first = run_ppo(rollouts=2, callbacks=[ScriptedRewards(equal=[0]), NaNGradient(batches=[1]),
                                               SaveAfterTheSkip()], optim=OPTIM)[1]
        L.seed_everything(0)
        model = ppo_task(str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py"), max_rollouts=3, optim=OPTIM)
        resumed = _resume(model, prompts(2), path, max_steps=-1, callbacks=[ScriptedRewards(equal=[])])
    empty = 1 if task == "ppo" else 0
    assert first.lightning_module.skipped_steps.total == 1
    saved = torch.load(path, weights_only=False)["skipped_steps"]
    assert saved["total"] == 1 and [n for _, n in saved["streaks"]] == [1]  # written mid-streak
    assert saved["empty"] == empty
    restored = resumed.lightning_module.skipped_steps
    assert resumed.callback_metrics["train/skipped_steps"] == 1 and restored.total == 1
    assert resumed.callback_metrics["train/empty_steps"] == empty and restored.empty == empty
    assert list(restored.streaks.values()) == [0]  # the resumed run's step trained, ending the streak


def test_a_ppo_rollout_with_nothing_to_learn_moves_no_weight():
    """A real PPO fit whose second rollout scores every completion alike: that rollout's gradient is exactly zero,
    and the parameters and AdamW's moments stay bit-equal across it (on the old code AdamW's momentum from the first
    rollout moved every weight again); the schedule and the step count advance, ``train/empty_steps`` counts it,
    and the next rollout trains."""
    snapshots = Snapshots(at=1)
    model, trainer = run_ppo(rollouts=4, callbacks=[ScriptedRewards(equal=[1]), snapshots], optim=OPTIM)
    before, after, following = snapshots.states["before"], snapshots.states["after"], snapshots.states["next"]
    assert _same(before, after)  # parameters and optimizer state
    assert after[1] == [before[1][0] + 1] and after[2] == before[2] + 1  # the schedule and global step advance
    assert not _same(after, following)  # the third rollout trains (4 rollouts: 3 would end the cosine at
    # its floor, min_lr_ratio 0.1, which still moves the weights; 4 keeps the third step well inside the schedule)
    assert trainer.callback_metrics["train/empty_steps"] == 1 and trainer.global_step == 4
