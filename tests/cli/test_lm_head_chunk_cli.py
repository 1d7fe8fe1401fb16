"""``model.lm.lm_head_chunk`` through the real CLI: SFT, DPO and GRPO (hf engine) fits with the default chunked output head
log the same first-step loss (and gradient norm) as ``--model.lm.lm_head_chunk null`` (the full logits); the key is in
every task's ``--model.help`` and a bad value is one line at start-up."""

import json

import pytest
from mlflow import MlflowClient

from rl_lightning.cli.main import main

RUNS = {
    "sft": ["--config", "recipes/sft.yaml", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
            "--data.batch_size", "8"],
    "dpo": ["--config", "recipes/dpo.yaml", "--trainer.max_steps", "1", "--data.batch_size", "8"],
    "grpo": ["--config", "recipes/grpo.yaml", "--model.rollout.engine", "hf", "--model.max_rollouts", "1",
           "--data.batch_size", "2", "--model.rollout.responses_per_prompt", "4", "--model.rollout.max_new_tokens",
           "8", "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0"],
}
# GRPO: the loss, the entropy and the policy's drift from the scoring pass (old log-probs of the second minibatch
# come from `scoring.score`, the reference-free update's from the training forward) and from the engine
KEYS = {"sft": ("train/loss", "train/grad_norm"), "dpo": ("train/loss", "train/grad_norm"),
        "grpo": ("train/policy_loss", "train/grad_norm", "train/entropy", "train/approx_kl",
                 "train/engine_logprob_diff")}


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["rl_lightning"])


def _first_step(workdir, recipe, args):
    """The train metrics the run logged first (MLflow), read through the run's output folder."""
    main(["fit", *args, "--trainer.enable_checkpointing", "false"])
    run_id = json.loads((workdir / "outputs" / recipe / "latest" / "run.json").read_text())["mlflow_run_id"]
    client = MlflowClient("sqlite:///mlflow.db")
    return {key: min(client.get_metric_history(run_id, key), key=lambda m: m.step).value for key in KEYS[recipe]}


@pytest.mark.parametrize("recipe", RUNS)
def test_default_chunked_head_logs_the_full_logits_first_loss(recipe, workdir):
    """The default (1024 positions: one chunk at this size) and 5-position chunks (many) against null."""
    default = _first_step(workdir, recipe, RUNS[recipe])
    small = _first_step(workdir, recipe, [*RUNS[recipe], "--model.lm.lm_head_chunk", "5"])
    full = _first_step(workdir, recipe, [*RUNS[recipe], "--model.lm.lm_head_chunk", "null"])
    for key in KEYS[recipe]:
        # the entropy is a float32 mean of per-token log-sum-exps, reduced in another order per chunking: 24 ulps of
        # its 0.5 nats (1.4e-6) were seen; 1e-5 still catches a wrong chunk (one of ~60 positions moves the mean ~1e-2)
        tolerance = 1e-5 if key == "train/entropy" else 1e-6
        assert abs(default[key] - full[key]) < tolerance, (key, default, full)
        assert abs(small[key] - full[key]) < tolerance, (key, small, full)
    assert full["train/grad_norm"] > 0 and full[KEYS[recipe][0]] != 0


@pytest.mark.parametrize("recipe", ["sft", "dpo", "grpo"])
def test_a_bad_chunk_is_one_line_at_start_up(recipe, workdir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", f"recipes/{recipe}.yaml", "--model.lm.lm_head_chunk", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("rl_lightning: error: model.lm.lm_head_chunk must be a number of positions >= 1 or null, got 0; "
                       "use e.g. 1024 (the default), or null for the full-logits path"), err
