"""The rollout callback's Pareto archive (``model.rollout.pareto_archive_size``) on a tiny GRPO run with a
two-component reward logging to a real MLflow store (sqlite): the logged
``train/hypervolume`` is the hypervolume of the archive rebuilt from each rollout's mean components, the
``pareto_archive.json`` table lists exactly the non-dominated rollouts, the archive is checkpointed, and bad settings
are one-line config errors; under two data-parallel ranks both hold the same archive of global means."""

import json

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from conftest import REPO
from helpers import Metrics, ppo_task, prompts, run_on_cpu_ranks
from lightning.pytorch.loggers import MLFlowLogger

from rl_lightning.algorithms.pareto import exclusive_contributions, hypervolume, non_dominated, update_archive
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.callback import RolloutCallback, RolloutConfig
from rl_lightning.rollout.pareto_archive import ARTIFACT_FILE

ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic_format.py")  # two reward components: correct, format
SFT_MODEL = str(REPO / "rl_lightning" / "assets" / "tiny-qwen2-sft")  # answers some prompts with a bare number
# A strict trade-off: a score in [0, 1] hashed from the conversation's text, and its complement. Every rollout's means
# lie on left + right = 1, so no rollout dominates another (unless equal) and 4 distinct rollouts overflow an archive
# of 3. (The demo's correct/format pair gives the tiny model a one-point front: it never answers right here.)
TRADE_OFF_ENV = """
def reward_fn(messages, answer):
    text = "".join(m["content"] for m in messages)  # the prompt too: the tiny model often writes the same words
    left = sum(i * ord(c) for i, c in enumerate(text)) % 997 / 996
    return {"left": left, "right": 1.0 - left}
"""
NAMES = ["left", "right"]  # the components in the archive's order (sorted)
ROLLOUT = {"reward_weights": {"left": 1.0, "right": 1.0}, "reward_workers": 0, "pareto_archive_size": 3}


class ComponentMeans(L.Callback):
    """Each rollout's mean reward components (rollout number -> [correct, format]) and the global step it was sampled
    at, read from ``batch["rollout"]``."""

    def __init__(self):
        self.means, self.steps = {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps[pl_module.rollouts + 1] = trainer.global_step  # before this rollout's update, as the callback sees

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trajectories = batch["rollout"].trajectories  # summed in float32, as the all-reduce does
        self.means[pl_module.rollouts] = [float(torch.tensor([t.reward_components[n] for t in trajectories]).sum())
                                          / len(trajectories) for n in NAMES]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pareto")
    logger = MLFlowLogger(experiment_name="pareto", tracking_uri=f"sqlite:///{root}/mlflow.db",
                          artifact_location=str(root / "artifacts"))
    means, metrics = ComponentMeans(), Metrics(["train/hypervolume", "train/pareto_size"])
    (root / "trade_off.py").write_text(TRADE_OFF_ENV)
    L.seed_everything(0)
    model = ppo_task(root / "trade_off.py", lm={"name": SFT_MODEL}, rollout=ROLLOUT, max_rollouts=4, advantage_estimator="grpo")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=-1, logger=logger, log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[means, metrics])
    trainer.fit(model, datamodule=prompts(2))
    return model, trainer, logger, means, metrics, root


def _archives(means, size):
    """The bounded archive after each rollout, rebuilt from the captured means (rollout numbers)."""
    archive, history = [], []
    for number in sorted(means):
        candidates = [*archive, number]
        kept = update_archive(torch.tensor([means[n] for n in candidates], dtype=torch.float64), torch.zeros(2), size)
        archive = [candidates[i] for i in kept.tolist()]
        history.append(archive)
    return history


def test_logged_hypervolume_is_the_archives_hypervolume_of_the_rollout_means(run):
    model, _, logger, means, metrics, _ = run
    assert model.rollouts == 4 and sorted(means.means) == [1, 2, 3, 4]
    expected = [hypervolume(torch.tensor([means.means[n] for n in archive]), torch.zeros(2))
                for archive in _archives(means.means, 3)]
    logged = [h["train/hypervolume"] for h in metrics.history]
    assert logged == pytest.approx(expected, abs=1e-6)  # means are all-reduced in float32
    assert [h["train/pareto_size"] for h in metrics.history] == [len(a) for a in _archives(means.means, 3)]
    # the name MLflow got is train/hypervolume, one value per rollout
    history = logger.experiment.get_metric_history(logger.run_id, "train/hypervolume")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(expected, abs=1e-6)


def test_archive_table_lists_the_non_dominated_rollouts(run, tmp_path):
    """All 4 rollouts are non-dominated (the trade-off env); the bound of 3 evicts the least exclusive contributor."""
    _, _, logger, means, _, _ = run
    client = logger.experiment
    with open(client.download_artifacts(logger.run_id, ARTIFACT_FILE, str(tmp_path))) as f:
        table = json.load(f)
    assert table["columns"] == ["rollout", "step", "reward/left", "reward/right", "hypervolume_contribution"]
    numbers = sorted(means.means)
    points = torch.tensor([means.means[n] for n in numbers], dtype=torch.float64)
    assert non_dominated(points).all() and len(set(map(tuple, points.tolist()))) == 4  # the front: every rollout
    contributions = exclusive_contributions(points, torch.zeros(2)).tolist()
    evicted = numbers[min(range(4), key=lambda i: (contributions[i], -i))]  # least contribution, newest on ties
    archived = [row[0] for row in table["data"]]
    assert archived == [n for n in numbers if n != evicted] == _archives(means.means, 3)[-1]
    for row in table["data"]:
        assert row[1] == means.steps[row[0]] and row[2:4] == pytest.approx(means.means[row[0]], abs=1e-6)
    kept = torch.tensor([row[2:4] for row in table["data"]], dtype=torch.float64)
    assert [row[4] for row in table["data"]] == pytest.approx(exclusive_contributions(kept, torch.zeros(2)).tolist())
    tags = json.loads(client.get_run(logger.run_id).data.tags["mlflow.loggedArtifacts"])
    assert {"path": ARTIFACT_FILE, "type": "table"} in tags


def test_a_resumed_run_continues_the_archive(run):
    """The checkpoint holds the archive (the callback's state); a run resumed from it for a 5th rollout logs the
    hypervolume of the archive rebuilt from all 5 rollouts' means."""
    model, trainer, _, means, _, root = run
    trainer.save_checkpoint(root / "last.ckpt")
    checkpoint = torch.load(root / "last.ckpt", weights_only=False)
    state = next(v for k, v in checkpoint["callbacks"].items() if k.startswith("RolloutCallback"))
    assert state["pareto"]["entries"] == model.rollout_callback.pareto.entries
    resumed_means, metrics = ComponentMeans(), Metrics(["train/hypervolume", "train/pareto_size"])
    L.seed_everything(0)
    resumed = ppo_task(root / "trade_off.py", lm={"name": SFT_MODEL}, rollout=ROLLOUT, max_rollouts=5,
                       advantage_estimator="grpo")
    L.Trainer(accelerator="cpu", devices=1, max_steps=-1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[resumed_means, metrics],
              ).fit(resumed, datamodule=prompts(2), ckpt_path=root / "last.ckpt")
    assert sorted(resumed_means.means) == [5] and resumed.rollouts == 5
    all_means = {**means.means, **resumed_means.means}
    archive = _archives(all_means, 3)[-1]
    expected = hypervolume(torch.tensor([all_means[n] for n in archive]), torch.zeros(2))
    assert [h["train/hypervolume"] for h in metrics.history] == pytest.approx([expected], abs=1e-6)
    assert [e["rollout"] for e in resumed.rollout_callback.pareto.entries] == archive


@pytest.mark.parametrize("settings, message", [
    ({"pareto_archive_size": 3},
     "model.rollout.pareto_archive_size=3 needs a size >= 1 and >= 2 reward components in reward_weights (got []); "
     "name the components in model.rollout.reward_weights or set pareto_archive_size: null"),
    ({"pareto_archive_size": 3, "reward_weights": {"correct": 1.0}},
     "model.rollout.pareto_archive_size=3 needs a size >= 1 and >= 2 reward components in reward_weights (got "
     "['correct']); name the components in model.rollout.reward_weights or set pareto_archive_size: null"),
    ({"pareto_archive_size": 0, "reward_weights": {"correct": 1.0, "format": 0.5}},
     "model.rollout.pareto_archive_size=0 needs a size >= 1 and >= 2 reward components in reward_weights (got "
     "['correct', 'format']); name the components in model.rollout.reward_weights or set pareto_archive_size: null"),
    ({"pareto_archive_size": 3, "reward_weights": {"correct": 1.0, "format": 0.5}, "pareto_reference": {"x": 0.0}},
     "model.rollout.pareto_reference={'x': 0.0} must give a finite value for each component of reward_weights "
     "['correct', 'format']"),
])
def test_bad_pareto_settings_are_one_line_config_errors(settings, message):
    with pytest.raises(ConfigError) as info:
        RolloutConfig(ENV, **settings)
    assert str(info.value) == message and "\n" not in str(info.value)


def _two_ranks(rank, env_path, results):
    """Rank 0 scores 1 trajectory, rank 1 three: the archive's points are the global means (count-weighted)."""
    import types

    import torch.distributed as dist

    dist.init_process_group("gloo")

    def reduce(value, reduce_op):
        dist.all_reduce(value)
        return value

    callback = RolloutCallback(RolloutConfig(env_path, **ROLLOUT))
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(reduce=reduce), world_size=2, global_step=0,
                                    global_rank=rank, is_global_zero=rank == 0, loggers=[])
    from rl_lightning.parallel.reductions import process_groups

    callback.groups = process_groups(trainer)  # what the callback's setup builds (the reductions take the groups)
    module = types.SimpleNamespace(device=torch.device("cpu"), rollouts=0)
    share = {0: [(1.0, 0.0)], 1: [(0.0, 1.0)] * 3}[rank], {0: [(0.5, 0.5)] * 2, 1: [(0.5, 0.5)]}[rank]
    metrics = []
    for rollout, values in enumerate(share):
        trajectories = [types.SimpleNamespace(reward_components=dict(zip(NAMES, v, strict=True))) for v in values]
        metrics.append(callback._track_pareto(trainer, module, trajectories))
        module.rollouts, trainer.global_step = rollout + 1, rollout + 1
    results[rank] = (metrics, callback.pareto.entries)


def test_data_parallel_ranks_hold_the_same_archive_of_global_means(tmp_path):
    """Global means: rollout 1 (1*(1,0) + 3*(0,1)) / 4 = (0.25, 0.75) (not the mean of rank means, (0.5, 0.5));
    rollout 2 (0.5, 0.5). HV vs (0,0) = 0.5*0.5 + 0.25*(0.75-0.5) = 0.3125."""
    (tmp_path / "trade_off.py").write_text(TRADE_OFF_ENV)
    with mp.Manager() as manager:
        results = manager.dict()
        run_on_cpu_ranks(_two_ranks, 2, str(tmp_path / "trade_off.py"), results)
        results = dict(results)
    assert results[0] == results[1]
    metrics, entries = results[0]
    assert metrics == [{"train/hypervolume": 0.1875, "train/pareto_size": 1.0},
                       {"train/hypervolume": 0.3125, "train/pareto_size": 2.0}]
    assert entries == [{"rollout": 1, "step": 0, "means": [0.25, 0.75]}, {"rollout": 2, "step": 1, "means": [0.5, 0.5]}]
