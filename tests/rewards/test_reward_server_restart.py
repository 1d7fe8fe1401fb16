"""A served reward model (``model.rollout.reward_model.url``) whose server process is killed mid-run and started
again: with ``on_error: zero`` the run goes on, the trajectories scored while it is down get 0 for the component
and are counted (``train/reward_failures``, and the failed requests in ``rollout/reward_model_failures``), and once
it is back the same client scores again over a fresh connection.

The server is a real HTTP server in a process of its own (a ``subprocess``), killed with SIGKILL and restarted on the
same port; it speaks vLLM's ``/v1/models`` and ``/classify`` and scores a sequence by its token count, so every
expected score is known."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import lightning as L
import pytest
from conftest import TINY_MODEL
from helpers import Metrics, fit, free_port, ppo_task, prompts

from rl_lightning.rewards.reward_model import RewardModelConfig, conversation_tokens

SERVER = '''
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept-alive connections, as vLLM's server keeps them

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.reply({"object": "list", "data": [{"id": sys.argv[2], "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(sys.argv[3], "a") as log:  # the request arrived: a test may kill the server while it "computes"
            log.write("post\\n")
        time.sleep(float(sys.argv[4]))
        self.reply({"object": "list", "data": [{"index": i, "probs": [float(len(ids))], "num_classes": 1}
                                               for i, ids in enumerate(body["input"])]})

    def reply(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''


class ServerProcess:
    """The scoring server in its own process on `port`, answering each ``/classify`` after `delay_s` (its arrival
    logged to `log`): `start` waits until it answers, `kill` SIGKILLs it."""

    def __init__(self, port: int, log: Path, delay_s: float) -> None:
        self.port, self.url, self.process = port, f"http://127.0.0.1:{port}", None
        self.log, self.delay_s = log, delay_s
        log.touch()

    def posts(self) -> int:
        """``/classify`` requests the server received so far (over its lives)."""
        return len(self.log.read_text().splitlines())

    def start(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", SERVER, str(self.port), str(TINY_MODEL), str(self.log),
                                         str(self.delay_s)])
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2):
                    return
            except OSError:
                assert self.process.poll() is None and time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.1)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def _kill_on_next_request(server: ServerProcess) -> None:
    """A thread that SIGKILLs the server as soon as it receives its next ``/classify`` request (before it answers)."""
    seen = server.posts()

    def kill() -> None:
        while server.posts() == seen:
            time.sleep(0.005)
        server.kill()

    threading.Thread(target=kill, daemon=True).start()


class DownDuringRollout(L.Callback):
    """Before the rollout of batch `down`: kill the server (`mid_request`: once that rollout's first scoring request
    reached it); before that of batch `down + 1`: start it again. After every step: the rollout's trajectories."""

    def __init__(self, server: ServerProcess, down: int, mid_request: bool) -> None:
        self.server, self.down, self.mid_request, self.trajectories = server, down, mid_request, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.down:
            _kill_on_next_request(self.server) if self.mid_request else self.server.kill()
        elif batch_idx == self.down + 1:
            self.server.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.trajectories.append(batch["rollout"].trajectories)


@pytest.mark.parametrize("mid_request", [False, True], ids=["between-rollouts", "mid-request"])
def test_a_reward_server_killed_and_restarted_mid_run_costs_only_the_rollout_it_missed(tmp_path, mid_request):
    """Rollouts 0 and 2 are scored by the server (component = token count, reward = 0.5 + that); rollout 1, while
    the server is dead (killed before it, or while it held that rollout's first request), gets 0 for the component on
    each of its 4 trajectories: train/reward_failures reads 0, 4, 4 (cumulative) and rollout/reward_model_failures 2
    failed requests (2 trajectories each) from rollout 1 on."""
    server = ServerProcess(free_port(), tmp_path / "posts.log", delay_s=0.3 if mid_request else 0.0)
    server.start()
    env = tmp_path / "env.py"
    env.write_text("def reward_fn(messages, answer):\n    return 0.5\n")
    metrics, outage = Metrics(), DownDuringRollout(server, down=1, mid_request=mid_request)
    reward_model = RewardModelConfig(url=server.url, batch_size=2, concurrency=1, retries=1, timeout_s=5.0,
                                     on_error="zero")  # one request at a time: the kill finds exactly one in flight
    L.seed_everything(0)
    task = ppo_task(env, max_rollouts=3, rollout={"reward_workers": 0, "responses_per_prompt": 2,
                                                  "max_new_tokens": 6, "reward_model": reward_model})
    try:
        fit(task, prompts(2), -1, [outage, metrics])
    finally:
        server.kill()
    client = task.rollout_callback.env.reward_model
    assert task.rollouts == 3 and [len(r) for r in outage.trajectories] == [4, 4, 4]
    for index, trajectories in enumerate(outage.trajectories):
        expected = [0.0 if index == 1 else float(len(conversation_tokens(client.tokenizer, t.messages)))
                    for t in trajectories]
        assert [t.reward_components["reward_model"] for t in trajectories] == expected
        assert [t.reward for t in trajectories] == [0.5 + score for score in expected]
    assert [m["train/reward_failures"] for m in metrics.history] == [0.0, 4.0, 4.0]
    assert [m.get("rollout/reward_model_failures", 0.0) for m in metrics.history] == [0.0, 2.0, 2.0]
    assert server.posts() == 2 + mid_request + 2  # rollout 1: only the request the server died holding reached it
