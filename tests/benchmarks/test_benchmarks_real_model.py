"""The real-model GRPO benchmarks (benchmarks/sanity.py, seeds.py and through it real_grpo.py) at ``--smoke`` scale:
the bundled tiny model, one rollout of 2 prompts x 2 completions with the transformers engine, no TRL. A random tiny
model solves nothing, so the checks are on the scripts' bookkeeping: what the probe keeps, how accuracies and
pass@K relate, token budgets, the seed sweep's statistics, and the table against the rows it was built from."""

import json
import os
import statistics
import subprocess
import sys

import pytest
from conftest import REPO

SMOKE_BUDGET = 1 * 2 * 2 * 8  # grpo_runs.SMOKE: 1 rollout x 2 prompts x 2 completions x 8 new tokens


def _smoke(script, tmp_path, *extra):
    out = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, f"benchmarks/{script}", "--smoke", "--workdir", str(tmp_path / "work"),
                             "--json", str(out), *extra], cwd=REPO, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(out.read_text()), result.stdout


def _check_accuracies(row, questions, samples=2):
    """Greedy accuracy and pass@K (K = n samples) are shares of `questions`, the mean sampled accuracy a share of
    `questions` x `samples` completions; pass@K is at least the mean sampled accuracy."""
    for key, count in (("greedy", questions), ("sampled", questions * samples), ("pass_at_k", questions)):
        assert 0.0 <= row[key] <= 1.0 and (row[key] * count) == pytest.approx(round(row[key] * count)), (key, row)
    assert row["pass_at_k"] >= row["sampled"]


def _check_training(train):
    assert len(train["curve_correct"]) == 1  # one rollout, one logged point
    tokens = train["tokens_per_s"] * train["seconds"]
    assert 0 < tokens <= SMOKE_BUDGET + 1e-6  # the product gives the count back up to float rounding


@pytest.mark.slow  # four child processes: probe, two evaluations, one fit
def test_sanity_smoke_probes_trains_and_judges_on_the_chosen_questions(tmp_path):
    pytest.importorskip("reasoning_gym")
    from rl_lightning.data.loading import load_rows

    report, stdout = _smoke("sanity.py", tmp_path)
    probe, rows = report["probe"], report["rows"]
    # --smoke keeps every probed question (band [0, 1]): 4 candidates, 2 samples each
    assert probe["candidates"] == probe["chosen"] == 4 and sum(probe["pass_rate_histogram"].values()) == 4
    rates = {float(rate): count for rate, count in probe["pass_rate_histogram"].items()}
    assert all(rate * 2 == round(rate * 2) for rate in rates)  # a pass rate of 2 samples is 0, 0.5 or 1
    assert probe["chosen_mean_rate"] == pytest.approx(sum(r * c for r, c in rates.items()) / 4)
    # the training file is the first 4 training questions, in order, as the probe saw them
    chosen = [json.loads(line) for line in (tmp_path / "work" / "sanity.jsonl").read_text().splitlines()]
    expected = load_rows("reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=2&train_size=8&test_size=4"
                         "&split=train").rows[:4]
    assert [(r["messages"], r["answer"]) for r in chosen] == [(r["messages"], r["answer"]) for r in expected]
    assert set(rows) == {"before", "rl_lightning"}  # --smoke skips TRL
    for row in rows.values():
        _check_accuracies(row, questions=4)
    _check_training(rows["rl_lightning"]["train"])
    verdict = "PASS" if rows["rl_lightning"]["greedy"] > 0.9 else "FAIL"
    assert f"| rl_lightning | {rows['rl_lightning']['greedy']:.3f} |" in stdout and f"| {verdict} |" in stdout


@pytest.mark.slow  # two real_grpo.py --smoke runs, three child processes each
def test_seeds_smoke_sweeps_two_seeds_and_tabulates_their_mean_and_std(tmp_path):
    pytest.importorskip("reasoning_gym")
    report, stdout = _smoke("seeds.py", tmp_path)
    assert report["passthrough"] == ["--samples", "2", "--smoke"]
    [(task, runs)] = report["runs"].items()
    assert task == "reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=2" and len(runs) == 2
    # the starting model's evaluation does not depend on the training seed (fixed evaluator seed, same model)
    before = [{k: v for k, v in run["before"].items() if k != "seconds"} for run in runs]
    assert before[0] == before[1]
    for run in runs:
        assert set(run) == {"before", "rl_lightning"}
        _check_accuracies(run["before"], questions=4)  # --smoke: 4 held-out questions
        _check_accuracies(run["rl_lightning"], questions=4)
        _check_training(run["rl_lightning"]["train"])
    # the table's cells are the mean ± sample std of the per-seed rows
    gains = [run["rl_lightning"]["greedy"] - run["before"]["greedy"] for run in runs]
    greedy = [run["rl_lightning"]["greedy"] for run in runs]
    cell = f"{statistics.fmean(greedy):.3f} ± {statistics.stdev(greedy):.3f}"
    gain = f"{statistics.fmean(gains):.3f} ± {statistics.stdev(gains):.3f}"
    assert f"| rl_lightning | {cell} |" in stdout and f"| {gain} |" in stdout
    assert f"| before | {before[0]['greedy']:.3f} ± 0.000 |" in stdout
