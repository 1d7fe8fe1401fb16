"""Comparing runs in the real MLflow UI, in a real browser (headless Chromium through Playwright).

Two tiny GRPO runs through the CLI, the same recipe and overlay, differing only in ``--model.lm.optim.lr``: the store
holds them under distinct names, every value on the run's step (the rollout count the terminal and
``rollout_samples.json`` show), no constant counter charts and short tag keys; then ``mlflow ui`` serves the store
and Chromium opens the compare page (both names, the ``val/`` metrics), the runs' charts view from the link the
terminal prints (the model-training view, a ``val/reward`` chart whose legend names both runs) and a run's own
page, whose first chart section is the headline: held-out accuracy and reward before ``data``, ``train``, ...

Chromium is Debian's (``make setup`` installs it with apt-get as root, as CI runs); Playwright drives it through
``executable_path`` (no ``playwright install`` download).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rl_lightning.cli.main import main

pytestmark = pytest.mark.slow

OVERLAY = """\
model:
  init_args:
    max_rollouts: 2
    update_per_rollout: 1
    rollout: {engine: hf, responses_per_prompt: 2, max_new_tokens: 4, val_responses_per_prompt: 1}
data:
  init_args: {batch_size: 2}
trainer:
  val_check_interval: 1
  limit_val_batches: 0.02
  enable_checkpointing: false
"""
LRS = {"0.0001": "grpo+tiny lr=0.0001", "2e-5": "grpo+tiny lr=2e-05"}


def chromium_path() -> str:
    """Debian's Chromium; skips only where it cannot be installed here (not root), fails where ``make setup`` would."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.skip("chromium is not installed and this user is not root, so `make setup` cannot apt-get it: "
                    "run `apt-get install chromium` as root")
    pytest.fail("chromium is not installed: run `make setup` (it runs `apt-get install chromium` as root)")


@pytest.fixture
def two_runs(workdir, monkeypatch):
    monkeypatch.setattr("sys.argv", ["rl_lightning"])  # the CLI gets its arguments, not pytest's
    (workdir / "tiny.yaml").write_text(OVERLAY)
    for lr in LRS:
        main(["fit", "--config", "recipes/grpo.yaml", "--config", "tiny.yaml", "--model.lm.optim.lr", lr])
    client = MlflowClient("sqlite:///mlflow.db")
    experiment = client.get_experiment_by_name("rl_lightning/rl")
    runs = client.search_runs([experiment.experiment_id])
    return client, experiment.experiment_id, {run.info.run_name: run for run in runs}


def _steps(client: MlflowClient, run_id: str, name: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, name))


def _check_store(client: MlflowClient, runs: dict, workdir: Path) -> None:
    assert sorted(runs) == sorted(LRS.values())
    for name, run in runs.items():
        run_id = run.info.run_id
        assert _steps(client, run_id, "val/reward") == [0, 1, 2]  # the start, after rollouts 1 and 2
        assert _steps(client, run_id, "train/reward") == [1, 2]  # rollouts done, as the terminal counts them
        table = json.loads(Path(client.download_artifacts(run_id, "rollout_samples.json", str(workdir))).read_text())
        rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
        assert {r["step"] for r in rows} == {r["rollout"] for r in rows} == {1}  # logged rollout 1: chart step 1
        metrics = run.data.metrics
        assert not {"epoch", "train/refills", "train/oom_retries", "rollout/reward_timeouts"} & set(metrics)
        assert all(len(key) <= 16 for key in run.data.tags if not key.startswith("mlflow."))
        assert run.data.params["trainer.callbacks.RolloutSamples"].startswith("every_n_rollouts=10")
        models = [m for m in client.search_logged_models([run.info.experiment_id]) if m.source_run_id == run_id]
        assert [m.name for m in models] == [name.replace(".", "_")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(store: Path, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{store}",
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180  # a loaded CI machine took over a minute to start it
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            time.sleep(1)
    _stop(server)
    pytest.fail("mlflow ui did not answer /health within 180 s")


def _stop(server: subprocess.Popen) -> None:
    """End the server and its uvicorn worker (its own process group, started for it)."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def _text_when(page, needle: str, timeout_s: float = 60) -> str:
    """The page's text once it contains `needle` (the UI loads its data after the page)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = page.inner_text("body")
        if needle in text or time.monotonic() > deadline:
            return text
        page.wait_for_timeout(500)


def test_compare_page_and_charts_show_two_named_runs_and_their_validation(two_runs, workdir):
    from playwright.sync_api import sync_playwright

    from rl_lightning.cli.progress import ML_VIEW

    executable = chromium_path()
    client, experiment_id, runs = two_runs
    _check_store(client, runs, workdir)
    port = _free_port()
    server = _serve(workdir / "mlflow.db", port)
    base = f"http://127.0.0.1:{port}/"
    ids = [run.info.run_id for run in runs.values()]
    compare = (f"{base}#/compare-runs?runs={urllib.parse.quote(json.dumps(ids))}"
               f"&experiments={urllib.parse.quote(json.dumps([experiment_id]))}")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1600, "height": 1200})
            page.goto(compare)
            text = _text_when(page, "val/reward")
            assert all(name in text for name in LRS.values()), text[:2000]  # the "Run Name" row, in full
            # the link the terminal prints ("compare"), in the charts view: one val/reward chart, both runs
            page.goto(f"{base}#/experiments/{experiment_id}/runs?{ML_VIEW}&compareRunsMode=CHART")
            _text_when(page, "Search metric charts")
            page.get_by_placeholder("Search metric charts").fill("val/reward")
            text = _text_when(page, f"{next(iter(LRS.values()))} (val/reward)")
            for name in LRS.values():
                assert f"{name} (val/reward)" in text, text[:3000]  # the line chart's legend: run (metric)
            # a run's own page, model metrics: the headline section first (reward, held-out accuracy), then the rest
            page.goto(f"{base}#/experiments/{experiment_id}/runs/{ids[0]}/model-metrics")
            lines = _text_when(page, "held-out accuracy").splitlines()
            sections = [line for line, count in zip(lines, lines[1:], strict=False) if re.fullmatch(r"\(\d+\)", count)]
            assert sections[:2] == ["Summary", "data"] and sections.index("train") > 1, sections
            first = lines.index("Summary") + 3  # "Summary", "(3)", "Add chart", then the charts
            assert lines[first] == "held-out accuracy" and "reward" in lines[first:first + 30], lines[first:first + 30]
            browser.close()
    finally:
        _stop(server)
