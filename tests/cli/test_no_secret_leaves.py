"""No secret leaves the process (issue 36.4), on one real GRPO fit through the CLI: a recipe overlay reads a secret with
``${oc.env:...}``, names a secret-keyed value, scores with a reward model whose URL carries a password (a real HTTP
server on localhost that refuses requests without it), and logs to a tracking URI with an access token; the run ends
in a user callback's error. Then every byte the run left (run folder, checkpoint, export, ``mlflow.db``, MLflow
artifacts) and everything printed are searched: no secret anywhere; the redacted forms are where the values were."""

import base64
import json
import os
import stat
from pathlib import Path

import pytest
from auth_server import AuthServer
from conftest import TINY_MODEL
from mlflow import MlflowClient

from rl_lightning.cli.main import main

HOOK_SECRET = "hook-secret-5566778899"  # read by the overlay with ${oc.env:HOOK_SECRET}
API_TOKEN = "tok-literal-99887766"  # written in the overlay under a secret-named key
RM_PASSWORD = "rmpw-1122334455"  # in the reward model's URL
TRACKING_TOKEN = "trk-token-0a1b2c3d4e"  # in the tracking URI's query
SECRETS = (HOOK_SECRET, API_TOKEN, RM_PASSWORD, TRACKING_TOKEN, "rm-user")

# A user's callback (the working directory is on sys.path): it fails the run at its end, quoting its webhook.
NOTIFY = '''
import lightning as L

class Notify(L.Callback):
    def __init__(self, webhook: str, api_token: str):
        self.webhook, self.api_token = webhook, api_token

    def on_train_end(self, trainer, pl_module):
        raise RuntimeError(f"could not post to {self.webhook}")
'''
OVERLAY = f"""
model:
  init_args:
    max_rollouts: 1
    update_per_rollout: 1
    rollout:
      engine: hf
      responses_per_prompt: 2
      max_new_tokens: 4
      reward_workers: 0
      reward_model: {{model: {TINY_MODEL}, retries: 0}}
data:
  init_args: {{batch_size: 2, val_path: null}}
trainer:
  num_sanity_val_steps: 0
  callbacks:
    - class_path: rl_lightning.parallel.checkpoint_io.AtomicModelCheckpoint  # a checkpoint after the one step
      init_args: {{save_last: link, every_n_train_steps: 1}}
    - class_path: notify.Notify
      init_args:
        webhook: https://hooks.example.org/services/T0/${{oc.env:HOOK_SECRET}}
        api_token: {API_TOKEN}
"""


def _leaks(root: Path) -> list[str]:
    """``file: secret`` for every secret in any file under `root` (symlinked repo folders and the inputs left out)."""
    found = []
    for folder, _, files in os.walk(root):  # not into symlinked folders
        for name in set(files) - {"overlay.yaml", "notify.py"}:
            path = Path(folder, name)
            data = b"" if path.is_symlink() else path.read_bytes()
            found += [f"{path.relative_to(root)}: {secret}" for secret in SECRETS if secret.encode() in data]
    return found


@pytest.mark.slow
def test_a_fit_with_secrets_leaves_none_behind(workdir, monkeypatch, capfd):
    monkeypatch.setattr("sys.argv", ["rl_lightning"])
    monkeypatch.setenv("HOOK_SECRET", HOOK_SECRET)
    (workdir / "notify.py").write_text(NOTIFY)
    (workdir / "overlay.yaml").write_text(OVERLAY)
    server = AuthServer("Basic " + base64.b64encode(f"rm-user:{RM_PASSWORD}".encode()).decode(), scale=0.01)
    url = f"http://rm-user:{RM_PASSWORD}@127.0.0.1:{server.port}"
    tracking = f"sqlite:///file:mlflow.db?uri=true&access_token={TRACKING_TOKEN}&mode=rwc"
    args = ["fit", "--config", "recipes/grpo.yaml", "--config", "overlay.yaml", "--model.rollout.reward_model.url",
            url, "--trainer.logger.init_args.tracking_uri", tracking]
    try:
        with pytest.raises(SystemExit):
            main([*args, "--print_config"])
        printed = capfd.readouterr().out
        with pytest.raises(RuntimeError, match="could not post"):
            main(args)
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
    out, err = capfd.readouterr()
    assert server.authorised >= 2 and server.refused == 0  # the start-up check and the rollout's scoring
    assert "webhook: https://hooks.example.org/services/T0/${oc.env:HOOK_SECRET}" in printed
    assert "api_token: '***'" in printed and f"url: http://***@127.0.0.1:{server.port}" in printed

    (run,) = Path("outputs").glob("grpo+overlay/20*")
    record = json.loads((run / "run.json").read_text())
    assert record["mlflow_tracking_uri"] == "sqlite:///file:mlflow.db?uri=true&access_token=***&mode=rwc"
    for private in (run / "config.yaml", run / "export" / "rl_lightning_config.yaml"):
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o600, private
    assert "api_token: '***'" in (run / "config.yaml").read_text()
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("rl_lightning/rl").experiment_id])
    params, tags = mlflow_run.data.params, mlflow_run.data.tags
    assert params["model.rollout.reward_model.url"] == f"http://***@127.0.0.1:{server.port}"
    assert params["trainer.callbacks.Notify"] == (
        "webhook=https://hooks.example.org/services/T0/${oc.env:HOOK_SECRET}, api_token=***")
    assert tags["mlflow.runName"] == f"grpo+overlay url=127.0.0.1:{server.port}"
    assert tags["error"] == "could not post to https://hooks.example.org/services/T0/${oc.env:HOOK_SECRET}"
    assert "train/reward/reward_model" in mlflow_run.data.metrics
    assert (run / "checkpoints" / "last.ckpt").exists() and (run / "export" / "model.safetensors").exists()
    assert _leaks(workdir) == []
    terminal = printed + out + err
    assert [secret for secret in SECRETS if secret in terminal] == [], terminal[-3000:]
