"""GKD's on-policy fraction ``model.distill.lmbda`` in the PPO task: per rollout, with probability 1 - lambda, the
prompt rows' ``completion`` texts replace sampled completions and the JSD alone trains on them.

Checked: lambda = 1 is the run without the draw bit for bit; lambda = 0 trains only on the dataset's completions (the
token ids the loss saw are the rows' tokenised completions, and the logged JSD is TRL's GKD loss on exactly those
tokens); a mixed run's kinds follow the seeded draw (``train/distill_on_policy``), also on two data-parallel ranks
(gloo) and after a resume from a checkpoint; the one-line start-up errors.
"""

import json

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, REPO, TINY_MODEL
from helpers import Metrics, fit, ppo_task, run_on_cpu_ranks
from test_ppo_distill import TEACHER, ZERO_ENV, Trajectories, _logits

from rl_lightning.algorithms.distill import on_policy_draw
from rl_lightning.data import PromptDataModule
from rl_lightning.errors import ConfigError, DataError
from rl_lightning.tasks.ppo.distill import DistillConfig

ROWS = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A zero-reward env and 8 easy prompts whose rows carry the teacher's answer style as 'completion'."""
    folder = tmp_path_factory.mktemp("lmbda")
    (folder / "zero.py").write_text(ZERO_ENV)
    rows = [json.loads(line) for line in (DEMO_DATA / "easy.jsonl").read_text().splitlines()[:ROWS]]
    (folder / "with_completions.jsonl").write_text(
        "".join(json.dumps({**row, "completion": f"The answer is {row['answer']}."}) + "\n" for row in rows))
    return {"env": str(folder / "zero.py"), "data": str(folder / "with_completions.jsonl"), "rows": rows}


def _data(path, batch_size=2):
    return PromptDataModule(path, tokenizer_name=str(TINY_MODEL), batch_size=batch_size, shuffle=False)


def _run(files, lmbda, rollouts, callbacks=(), without_draw=False, dp=1, **trainer_kwargs):
    """A seeded GKD run (type loss, beta 0.3) of `rollouts` rollouts on the rows with completions (<= 18 tokens)."""
    from rl_lightning.parallel import ParallelStrategy

    L.seed_everything(0)
    model = ppo_task(files["env"], max_rollouts=rollouts, rollout={"max_new_tokens": 20},
                     distill=DistillConfig(str(TEACHER), type="loss", beta=0.3, lmbda=lmbda))
    if without_draw:  # today's code path: no draw, every rollout sampled
        model.distill_mix = None
    strategy = {} if dp == 1 else {"strategy": ParallelStrategy(data_parallel_size=dp)}
    trainer = fit(model, _data(files["data"], 2 // dp), -1, callbacks, devices=dp, **strategy, **trainer_kwargs)
    return model, trainer


def _dataset_ids(tokenizer, row):
    """(input ids, completion mask) of a row with its completion: prompt, completion tokens, EOS."""
    from rl_lightning.data.prompts import encode_prompt

    prompt = encode_prompt(tokenizer, row["messages"], True)
    completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + completion, [0] * len(prompt) + [1] * len(completion)


def test_lambda_one_is_the_run_without_the_draw_bit_for_bit(files):
    """lmbda = 1 draws 'on-policy' every rollout and touches no global random state: two rollouts give exactly the
    weights and logged values of the same run with the draw removed (today's behaviour)."""
    runs = []
    for without in (False, True):
        metrics = Metrics()
        model, _ = _run(files, 1.0, 2, [metrics], without_draw=without)
        runs.append((model.model.state_dict(), metrics.history))
    (weights, logged), (weights_before, logged_before) = runs
    assert all(torch.equal(weights[k], weights_before[k]) for k in weights_before)
    assert [h.pop("train/distill_on_policy") for h in logged] == [1.0, 1.0]
    timings = ("_s", "memory/")  # wall-clock seconds and memory readings differ between any two runs
    values = [{k: v for k, v in h.items() if not any(t in k for t in timings)} for h in logged]
    assert values == [{k: v for k, v in h.items() if not any(t in k for t in timings)} for h in logged_before]
    assert len(values[0]) > 15  # the update's metrics are compared, not only counters


def test_lambda_zero_trains_only_on_the_dataset_completions(files):
    """lmbda = 0: both rollouts are the rows' completions (responses_per_prompt copies each, nothing sampled), the
    logged JSD is TRL's GKD loss over exactly those tokens (both models' logits from plain forwards), no policy-loss
    term is logged, and the JSD moves the student."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDTrainer

    metrics, batches = Metrics(), Trajectories()
    model, _ = _run(files, 0.0, 2, [metrics, batches])
    rows = [{**r, "completion": f"The answer is {r['answer']}."} for r in files["rows"]]
    for rollout, batch in enumerate(batches.batches):
        expected = [_dataset_ids(model.tokenizer, row) for row in rows[2 * rollout : 2 * rollout + 2] for _ in range(4)]
        assert batch == expected
    assert [h["train/distill_on_policy"] for h in metrics.history] == [0.0, 0.0]
    assert "train/policy_loss" not in metrics.history[0] and "train/entropy" not in metrics.history[0]
    student, teacher, labels = [], [], []
    for ids, completion_mask in batches.batches[0]:
        student.append(_logits(TINY_MODEL, ids))
        teacher.append(_logits(TEACHER, ids))
        labels.append(torch.tensor([i if m else -100 for i, m in zip(ids[1:], completion_mask[1:], strict=True)]))
    expected_jsd = GKDTrainer.generalized_jsd_loss(torch.cat(student)[None], torch.cat(teacher)[None],
                                                   labels=torch.cat(labels)[None], beta=0.3)
    assert metrics.history[0]["train/distill_jsd"] == pytest.approx(float(expected_jsd), abs=1e-5)
    initial = AutoModelForCausalLM.from_pretrained(str(TINY_MODEL), dtype=torch.float32).state_dict()
    assert any(not torch.equal(v, initial[k]) for k, v in model.model.state_dict().items())


SEED_MIX = [on_policy_draw(0, k, 0.5) for k in range(4)]  # the run's seed 0 (DataModule default): [T, F, T, T]


def _kinds(batches, tokenizer, rows):
    """Per rollout: whether its trajectories are sampled (not the rows' dataset completions)."""
    rows = [{**r, "completion": f"The answer is {r['answer']}."} for r in rows]
    return [batch != [_dataset_ids(tokenizer, row) for row in rows[2 * k : 2 * k + 2] for _ in range(4)]
            for k, batch in enumerate(batches)]


def test_a_mixed_run_follows_the_seeded_draw_and_a_resumed_run_draws_the_same(files, tmp_path):
    """lmbda = 0.5 over 4 rollouts: train/distill_on_policy is the seeded draw of each rollout and the trajectories
    are sampled exactly there; a run stopped after 2 rollouts and resumed from its checkpoint draws the same."""
    assert True in SEED_MIX and False in SEED_MIX  # both kinds occur (else the test proves little)
    metrics, batches = Metrics(), Trajectories()
    model, _ = _run(files, 0.5, 4, [metrics, batches])
    assert [h["train/distill_on_policy"] for h in metrics.history] == [float(d) for d in SEED_MIX]
    assert _kinds(batches.batches, model.tokenizer, files["rows"]) == SEED_MIX
    logged = sum(h["train/distill_on_policy"] for h in metrics.history) / 4
    assert logged == sum(SEED_MIX) / 4
    # stop after 2, resume for 2 more: the resumed rollouts draw 2 and 3
    first, _ = _run(files, 0.5, 2, [])
    ckpt = tmp_path / "two.ckpt"
    first.trainer.save_checkpoint(ckpt)
    resumed = Metrics()
    L.seed_everything(0)
    again = ppo_task(files["env"], max_rollouts=4, rollout={"max_new_tokens": 20},
                     distill=DistillConfig(str(TEACHER), type="loss", beta=0.3, lmbda=0.5))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=-1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[resumed])
    trainer.fit(again, datamodule=_data(files["data"]), ckpt_path=str(ckpt))
    assert [h["train/distill_on_policy"] for h in resumed.history] == [float(d) for d in SEED_MIX[2:]]


def _dp_worker(rank, files, out):
    metrics = Metrics(["train/distill_on_policy", "train/distill_jsd"])
    _run(files, 0.5, 4, [metrics], dp=2)
    torch.save({"metrics": metrics.history}, out / f"rank{rank}.pt")


@pytest.mark.slow
def test_two_data_parallel_ranks_draw_alike_and_match_one_process(files, tmp_path):
    """dp = 2 (FSDP2 on gloo), each rank one prompt per rollout: both ranks log the same draws, the single process's,
    and the same JSD as one process on the same global batch (1e-5: FSDP2 reduce-scatters gradients in another
    summation order than one process sums them, float32 rounding, as in test_ppo_parallel.py)."""
    single = Metrics(["train/distill_on_policy", "train/distill_jsd"])
    _run(files, 0.5, 4, [single])
    run_on_cpu_ranks(_dp_worker, 2, files, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    expected = [float(d) for d in SEED_MIX]
    for rank in ranks:
        assert [h["train/distill_on_policy"] for h in rank["metrics"]] == expected
        for got, want in zip(rank["metrics"], single.history, strict=True):
            assert got["train/distill_jsd"] == pytest.approx(want["train/distill_jsd"], abs=1e-5)


def test_lambda_below_one_refuses_prompts_without_completions_at_start_up(files):
    """The demo prompts have no 'completion': refused in one line naming the key, the row and the fix, before any
    model loads."""
    model = ppo_task(files["env"], max_rollouts=1, distill=DistillConfig(str(TEACHER), type="loss", lmbda=0.5))
    with pytest.raises(ConfigError, match=r"^model.distill.lmbda=0.5 trains 1 - lambda of the rollouts on the "
                                          r"dataset's completions, but .*arithmetic.jsonl.* has no 'completion' "
                                          r"field; .* or set model.distill.lmbda 1$") as error:
        fit(model, _data(str(DEMO_DATA / "arithmetic.jsonl")), -1)
    assert "\n" not in str(error.value) and model.model is None


def test_a_completion_that_is_not_text_is_refused_naming_the_row(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1"}], "answer": "2", "completion": 2})
                    + "\n")
    data = _data(str(path), batch_size=1)
    with pytest.raises(DataError, match=r"bad.jsonl.*: 'completion' must be the reference completion's text, got int"):
        data.setup("fit")


@pytest.mark.parametrize(
    ("distill", "task", "match"),
    [
        ({"lmbda": 1.5, "type": "loss"}, {}, r"model.distill.lmbda must be in \[0, 1\], got 1.5"),
        ({"lmbda": 0.5}, {}, "model.distill.lmbda=0.5 mixes in dataset completions, which only the JSD loss can "
                             "train on: set model.distill.type loss, or lmbda 1"),
        ({"lmbda": 0.5, "type": "loss"}, {"advantage_estimator": "gae", "constraints": {"entropy_min": 0.1}},
         r"^model.distill.lmbda=0.5 .* does not run with model.advantage_estimator, model.constraints set; "),
        ({"lmbda": 0.5, "type": "loss"}, {"rollout": {"engine": "vllm", "async_steps": 1}}, r"with model.rollout.async_steps set"),
    ],
)
def test_bad_lambda_settings_are_refused_at_construction_in_one_line(distill, task, match):
    with pytest.raises(ConfigError, match=match) as error:
        ppo_task(str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py"),
                 distill={"teacher": str(TEACHER), **distill}, **task)
    assert "\n" not in str(error.value)
