"""The ready-made callbacks in ``callbacks/`` on real tiny runs (GRPO with the HF engine, SFT) logging to a real MLflow
store (sqlite): the sample table holds the trajectories' own values, memory metrics reach MLflow, early stopping
counts its patience in rollouts, and bad arguments are one-line config errors."""

import contextlib
import io
import json
import math
import re
import types

import lightning as L
import pytest
from conftest import DEMO_DATA, REPO, TINY_MODEL
from helpers import ppo_task, prompts
from lightning.pytorch.loggers import MLFlowLogger

from rl_lightning.callbacks.early_stop import EarlyStopOnReward
from rl_lightning.callbacks.memory_stats import MemoryStats
from rl_lightning.callbacks.rollout_samples import ARTIFACT_FILE, RolloutSamples
from rl_lightning.errors import ConfigError
from rl_lightning.models.config import LMConfig

ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic_format.py")  # two reward components: correct, format
SFT_MODEL = str(REPO / "rl_lightning" / "assets" / "tiny-qwen2-sft")  # answers some prompts with a bare number
ROLLOUT = {"reward_weights": {"correct": 1.0, "format": 0.5}, "reward_workers": 0}
COLUMNS = ["rollout", "step", "prompt", "answer", "completion", "reward", "reward/correct", "reward/format",
           "completion_length", "finished"]


class RolloutRecorder(L.Callback):
    """Every rollout's trajectories (reward, components, completion, length, finished, prompt, answer) by number."""

    def __init__(self):
        self.rollouts = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rollouts[pl_module.rollouts] = [
            (t.reward, dict(t.reward_components), t.messages[-1]["content"], t.completion_length, t.finished,
             t.prompt.messages[-1]["content"], t.prompt.answer) for t in batch["rollout"].trajectories]


def mlflow_logger(root):
    return MLFlowLogger(experiment_name="callbacks", tracking_uri=f"sqlite:///{root}/mlflow.db",
                        artifact_location=str(root / "artifacts"))


def fit(model, data, max_steps, callbacks, logger=None):
    """`helpers.fit` (CPU, no checkpointing or progress bar) with `logger` (none by default), logging every step."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=logger or False,
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(model, datamodule=data)
    return trainer


def grpo(rollouts, callbacks, logger=None):
    """A tiny GRPO run (2 prompts x 4 completions of 8 tokens per rollout); returns what it printed (stdout, stderr)
    too."""
    L.seed_everything(0)
    model = ppo_task(ENV, lm={"name": SFT_MODEL}, rollout=ROLLOUT, max_rollouts=rollouts, advantage_estimator="grpo")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        trainer = fit(model, prompts(2), -1, callbacks, logger)
    return model, trainer, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """3 rollouts with every callback: samples of rollouts 1 and 2, memory stats, an unreachable early stop."""
    recorder = RolloutRecorder()
    callbacks = [RolloutSamples(every_n_rollouts=2, rows=4, print_samples=1, max_chars=30), MemoryStats(),
                 EarlyStopOnReward(threshold=1e9), recorder]
    logger = mlflow_logger(tmp_path_factory.mktemp("grpo"))
    model, trainer, printed, errors = grpo(3, callbacks, logger)
    return model, trainer, logger, printed, recorder, errors


def test_rollout_samples_appends_one_table_of_the_logged_rollouts(grpo_run, tmp_path):
    model, trainer, logger, _, recorder, _ = grpo_run
    client = logger.experiment
    assert [f.path for f in client.list_artifacts(logger.run_id)] == [ARTIFACT_FILE]
    with open(client.download_artifacts(logger.run_id, ARTIFACT_FILE, str(tmp_path))) as f:
        table = json.load(f)  # the layout MLflow's table viewer reads: {"columns": [...], "data": [[...], ...]}
    assert table["columns"] == COLUMNS
    rows = [dict(zip(COLUMNS, row, strict=True)) for row in table["data"]]
    assert len(rows) == 4 * 2 and [r["rollout"] for r in rows] == [1] * 4 + [2] * 4  # rollout 3 is not logged
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4  # the run's step: rollouts done (MLflow's chart axis)
    assert len({r["reward"] for r in rows}) > 1  # the warm-started model: some answers are bare numbers
    for row, i in zip(rows, [0, 1, 2, 3] * 2, strict=True):
        reward, components, completion, length, finished, prompt, answer = recorder.rollouts[row["rollout"]][i]
        assert row["reward"] == pytest.approx(reward, abs=1e-9) and row["reward"] == pytest.approx(
            components["correct"] + 0.5 * components["format"], abs=1e-9)
        assert row["reward/correct"] == components["correct"] and row["reward/format"] == components["format"]
        assert (row["completion"], row["completion_length"], row["finished"]) == (completion, length, finished)
        assert row["prompt"] == prompt and row["prompt"].startswith("What is ")
        assert row["answer"] == answer and isinstance(answer, str)  # "18" stays a string in every appended row
    # MLflow reads it as a table, and the UI lists it as one (the tag log_table sets)
    loaded = client.load_table(logger.experiment_id, ARTIFACT_FILE, run_ids=[logger.run_id])
    assert loaded.shape == (8, len(COLUMNS)) and list(loaded["reward"]) == [r["reward"] for r in rows]
    tags = json.loads(client.get_run(logger.run_id).data.tags["mlflow.loggedArtifacts"])
    assert tags == [{"path": ARTIFACT_FILE, "type": "table"}]
    assert model.rollouts == 3


def test_rollout_samples_prints_one_short_sample_per_logged_rollout(grpo_run):
    _, _, _, printed, recorder, errors = grpo_run
    assert "Downloading artifacts" not in errors  # MLflow's tqdm bar, off while the table is appended to
    lines = [line for line in printed.splitlines() if line.startswith("sample @ rollout ")]
    assert [line.split(":")[0] for line in lines] == ["sample @ rollout 1", "sample @ rollout 2"]
    reward = recorder.rollouts[2][0][0]
    assert f" · reward {reward:.4g}" in lines[1] and " tokens" in lines[1]
    prompt, completion = re.match(r"sample @ rollout 2: ('.*?'|\".*?\") -> ('.*?'|\".*?\")", lines[1]).groups()
    assert len(prompt) <= 30 + 2 and len(completion) <= 30 + 2  # max_chars, plus the quotes


def _trajectory(messages, reward, components, answer="18"):
    from rl_lightning.data.prompts import Prompt
    from rl_lightning.rollout.trajectory import Trajectory

    prompt = Prompt([1, 2], [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
                    answer, "row 1")
    return Trajectory(prompt, [1, 2, 3, 4], [0, 0, 1, 1], [0.0] * 4, prompt.messages + messages, True, 2, reward,
                      components)


def test_a_resumed_run_appends_to_its_table_and_multi_turn_completions_keep_their_tool_turns(tmp_path):
    from rl_lightning.rollout.trajectory import Rollout

    logger = mlflow_logger(tmp_path)
    trainer = types.SimpleNamespace(is_global_zero=True, global_step=7, loggers=[logger])
    turns = [{"role": "assistant", "content": "calc(2+2)"}, {"role": "tool", "content": "4"},
             {"role": "assistant", "content": "4"}]
    first = Rollout([_trajectory(turns, 1.0, {"correct": 1.0})], 1, ["correct"])
    RolloutSamples(every_n_rollouts=1, print_samples=0).on_train_batch_end(
        trainer, types.SimpleNamespace(rollouts=1), None, {"rollout": first}, 0)
    # a new process on the same MLflow run (resumed), whose reward has one more component
    second = Rollout([_trajectory(turns[-1:], 0.5, {"correct": 0.0, "format": 1.0}, None)], 1, ["correct", "format"])
    RolloutSamples(every_n_rollouts=1, print_samples=0).on_train_batch_end(
        trainer, types.SimpleNamespace(rollouts=2), None, {"rollout": second}, 0)
    with open(logger.experiment.download_artifacts(logger.run_id, ARTIFACT_FILE, str(tmp_path))) as f:
        table = json.load(f)
    assert table["columns"] == ["rollout", "step", "prompt", "answer", "completion", "reward", "reward/correct",
                                "completion_length", "finished", "reward/format"]
    # the step is the run's (rollouts done), not the optimizer's global step (7)
    assert table["data"] == [[1, 1, "2 + 2?", "18", "calc(2+2)\n[tool] 4\n4", 1.0, 1.0, 2, True, None],
                             [2, 2, "2 + 2?", "", "4", 0.5, 0.0, 2, True, 1.0]]


def test_memory_stats_reach_mlflow_every_step(grpo_run):
    _, _, logger, _, _, _ = grpo_run
    client = logger.experiment
    history = {name: [m.value for m in sorted(client.get_metric_history(logger.run_id, name), key=lambda m: m.step)]
               for name in ("memory/rss_mib", "memory/peak_rss_mib", "memory/rollout/rss_mib")}
    steps = [m.step for m in client.get_metric_history(logger.run_id, "memory/peak_rss_mib")]
    assert sorted(steps) == sorted(m.step for m in client.get_metric_history(logger.run_id, "train/reward"))
    assert all(len(values) == 3 for values in history.values()), history  # one per rollout
    peak, rss = history["memory/peak_rss_mib"], history["memory/rss_mib"]
    assert all(p >= r > 50 for p, r in zip(peak, rss, strict=True))  # a process with torch loaded: > 50 MiB
    assert all(later >= earlier for earlier, later in zip(peak, peak[1:], strict=False))
    assert all(p >= r > 50 for p, r in zip(peak, history["memory/rollout/rss_mib"], strict=True))
    assert not [k for k in client.get_run(logger.run_id).data.metrics if "cuda" in k]  # CPU run


def test_memory_stats_runs_right_after_the_rollout_callback(grpo_run):
    _, trainer, _, _, _, _ = grpo_run
    names = [type(c).__name__ for c in trainer.callbacks]
    assert names.index("MemoryStats") == names.index("RolloutCallback") + 1


def test_an_unreachable_threshold_runs_to_max_rollouts(grpo_run):
    model, trainer, _, printed, _, _ = grpo_run
    assert model.rollouts == 3 and trainer.global_step == 3 and "stopping" not in printed


@pytest.mark.parametrize("patience", [1, 2])
def test_early_stop_on_reward_stops_after_patience_rollouts(patience):
    stop = EarlyStopOnReward(threshold=-1e9, patience=patience)  # every rollout reaches it
    model, trainer, printed, _ = grpo(5, [stop])
    assert model.rollouts == patience and trainer.global_step == patience
    lines = [line for line in printed.splitlines() if "stopping" in line]
    assert len(lines) == 1 and f"for {patience} consecutive check(s) (patience {patience})" in lines[0]
    assert lines[0].startswith("rl_lightning.callbacks.early_stop.EarlyStopOnReward: stopping: train/reward=")


def test_sft_logs_memory_and_no_samples(tmp_path):
    from rl_lightning.data import SFTDataModule
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.tasks import SFT

    L.seed_everything(0)
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=8, max_length=64)
    model = SFT(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3, lr_schedule="constant")))
    logger = mlflow_logger(tmp_path)
    fit(model, data, 2, [RolloutSamples(every_n_rollouts=1), MemoryStats(), EarlyStopOnReward(threshold=-1e9)],
        logger)
    client = logger.experiment
    metrics = client.get_run(logger.run_id).data.metrics
    assert {"memory/rss_mib", "memory/peak_rss_mib", "train/loss"} <= set(metrics)
    assert not [k for k in metrics if k.startswith("memory/rollout/")]  # SFT has no rollout phase
    assert len(client.get_metric_history(logger.run_id, "memory/rss_mib")) == 2  # and no early stop: no train/reward
    assert client.list_artifacts(logger.run_id) == []


class FakeTrainer:
    """What `EarlyStopOnReward.check` reads: callback metrics, the strategy's vote, rank, should_stop."""

    def __init__(self):
        self.callback_metrics, self.should_stop, self.is_global_zero = {}, False, True
        self.strategy = type("Strategy", (), {"reduce_boolean_decision": staticmethod(lambda d, all: d)})()


@pytest.mark.parametrize(("mode", "values", "stops_at"), [
    ("max", [0.9, 0.2, 0.6, None, 0.7, 0.8], 5),  # 0.2 restarts the count; a missing value counts neither way
    ("max", [0.5, math.nan, 0.5, 0.5, 0.5], 4),  # NaN does not reach the threshold
    ("min", [0.6, 0.4, 0.9, 0.1, 0.7], None),  # never two in a row
    ("min", [0.5, 0.1, 0.4], 1),  # the threshold itself counts
])
def test_patience_counts_consecutive_checks(mode, values, stops_at):
    stop, trainer = EarlyStopOnReward(threshold=0.5, patience=3 if mode == "max" else 2, mode=mode), FakeTrainer()
    stopped = []
    for i, value in enumerate(values):
        trainer.callback_metrics = {} if value is None else {"train/reward": value}
        stop.on_train_batch_end(trainer, None, None, None, i)
        stopped.append(trainer.should_stop)
    assert (stopped.index(True) if True in stopped else None) == stops_at


def test_val_metrics_are_checked_at_validation_end_only():
    stop, trainer = EarlyStopOnReward(threshold=0.5, metric="val/reward", patience=1), FakeTrainer()
    trainer.callback_metrics, trainer.sanity_checking = {"val/reward": 0.9}, True
    stop.on_train_batch_end(trainer, None, None, None, 0)
    stop.on_validation_end(trainer, None)  # the sanity check does not count
    assert not trainer.should_stop
    trainer.sanity_checking = False
    stop.on_validation_end(trainer, None)
    assert trainer.should_stop


@pytest.mark.parametrize(("make", "message"), [
    (lambda: RolloutSamples(every_n_rollouts=0),
     "rl_lightning.callbacks.rollout_samples.RolloutSamples: every_n_rollouts must be >= 1, got 0"),
    (lambda: RolloutSamples(rows=0, print_samples=-1),
     "rl_lightning.callbacks.rollout_samples.RolloutSamples: rows must be >= 1, got 0; print_samples must be >= 0 (0: print "
     "none), got -1"),
    (lambda: RolloutSamples(max_chars=0), "rl_lightning.callbacks.rollout_samples.RolloutSamples: max_chars must be >= 1, got 0"),
    (lambda: EarlyStopOnReward(0.5, patience=0), "rl_lightning.callbacks.early_stop.EarlyStopOnReward: patience must be >= 1, "
                                                 "got 0"),
    (lambda: EarlyStopOnReward(0.5, mode="maximum"), "rl_lightning.callbacks.early_stop.EarlyStopOnReward: mode must be one of "
                                                     "max, min, got 'maximum'"),
    (lambda: EarlyStopOnReward(math.nan, metric=""), "rl_lightning.callbacks.early_stop.EarlyStopOnReward: threshold must be a "
                                                     "number, got nan; metric must name a logged metric (e.g. "
                                                     "train/reward), got ''"),
])
def test_bad_arguments_are_one_line_config_errors(make, message):
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value) == message and "\n" not in str(info.value)


def test_rollout_dump_writes_every_trajectory_and_rotates(tmp_path):
    """Every trajectory of every rollout is a JSONL line equal to the rollout's; files rotate by size and only the
    newest `keep_files` stay."""
    from rl_lightning.callbacks.rollout_dump import RolloutDump

    class Capture(L.Callback):
        def __init__(self):
            self.rewards = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.rewards += [t.reward for t in batch["rollout"].trajectories]

    capture = Capture()
    dump = RolloutDump(str(tmp_path / "all"))
    small = RolloutDump(str(tmp_path / "small"), max_file_mb=1e-4, keep_files=2)  # ~100 bytes: a file per rollout
    L.seed_everything(0)
    model = ppo_task(ENV, rollout=ROLLOUT, max_rollouts=3)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=-1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[capture, dump, small])
    trainer.fit(model, datamodule=prompts(2))
    (written,) = sorted((tmp_path / "all").glob("*.jsonl"))
    assert json.loads((tmp_path / "all" / "manifest.json").read_text())["format"] == 2  # replayable: test_replay
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert [r["reward"] for r in rows] == capture.rewards and len(rows) == 3 * 2 * 4
    assert [r["rollout"] for r in rows] == [1] * 8 + [2] * 8 + [3] * 8
    assert rows[0]["messages"][-1]["role"] == "assistant" and rows[0]["prompt_row"].endswith("line 1")
    kept = sorted(p.name for p in (tmp_path / "small").glob("*.jsonl"))
    assert kept == ["rollouts-rank0-1.jsonl", "rollouts-rank0-2.jsonl"]  # rollout 1's file was rotated out
    assert json.loads((tmp_path / "small" / kept[-1]).read_text().splitlines()[0])["rollout"] == 3
    with pytest.raises(ConfigError, match=r"rl_lightning.callbacks.rollout_dump.RolloutDump: max_file_mb must be > 0, got 0"):
        RolloutDump(max_file_mb=0)


def test_the_sample_line_and_table_show_the_answer_the_reward_compares_against(tmp_path, capsys):
    """A reasoning-gym row's answer field is ``{task, answer, metadata}``: the line shows ``-31``, not the dict."""
    from rl_lightning.callbacks.rollout_samples import reference_answer
    from rl_lightning.rollout.trajectory import Rollout

    row = {"task": "chain_sum", "answer": "-31", "metadata": {"source_dataset": "chain_sum", "num_terms": 2}}
    assert [reference_answer(a) for a in (row, "18", 7, None, {"x": 1})] == ["-31", "18", "7", "", "{'x': 1}"]
    trainer = types.SimpleNamespace(is_global_zero=True, global_step=1, loggers=[])
    rollout = Rollout([_trajectory([{"role": "assistant", "content": "-31"}], 1.0, {"correct": 1.0}, row)], 1,
                      ["correct"])
    RolloutSamples(every_n_rollouts=1).on_train_batch_end(trainer, types.SimpleNamespace(rollouts=1), None,
                                                          {"rollout": rollout}, 0)
    assert capsys.readouterr().out == ("sample @ rollout 1: '2 + 2?' -> '-31' (answer -31) · reward 1 (correct 1) · "
                                       "2 tokens\n")
