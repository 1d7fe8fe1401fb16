"""Reward models as rewards: a vLLM server on localhost scoring the RM task's export gives transformers' scores; the
configured component (``model.rollout.reward_model``, served or in-process) is logged as ``train/reward/<name>`` and
combined with ``reward_fn``'s reward; timeouts, HTTP errors and retries follow the policy, checked against real
local HTTP servers."""

import json
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import lightning as L
import pytest
from conftest import DEMO_DATA, REPO, TINY_MODEL
from helpers import Metrics, fit, free_port, ppo_task, prompts, start_vllm_serve, stop_vllm_serve

from rl_lightning.envs.environment import load_environment
from rl_lightning.errors import ConfigError
from rl_lightning.models.config import LMConfig
from rl_lightning.rewards.reward_model import (
    LocalRewardModel,
    RewardModelClient,
    RewardModelConfig,
    RewardModelError,
    conversation_tokens,
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": answer}]
    for answer in ("4", "five", "The answer is 4.", "", "x" * 60)
] + [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye?"},
      {"role": "assistant", "content": "Bye"}]]

CONSTANT_ENV = "def reward_fn(messages, answer):\n    return 0.5\n"
LENGTH_ENV = "def reward_fn(messages, answer):\n    return {'length': len(messages[-1]['content']) / 10}\n"


@pytest.fixture(scope="session")
def rm_folder(tmp_path_factory):
    """The RM task trained 2 steps on the demo pairs and exported (a Qwen2ForSequenceClassification folder)."""
    from rl_lightning.data import PreferenceDataModule
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.tasks import RewardModel
    from rl_lightning.tracking.export import export_hf

    L.seed_everything(0)
    data = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=8,
                                shuffle=False, max_length=128)
    module = RewardModel(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-2, lr_schedule="constant", max_grad_norm=0.0)))
    fit(module, data, max_steps=2)
    path = tmp_path_factory.mktemp("rm") / "rm"
    export_hf(module.model, str(TINY_MODEL), path)
    return str(path)


class VllmServe:
    """``vllm serve`` of `folder` on localhost `port`: `stop` it (its process group) and `start` it again, same port."""

    def __init__(self, folder: str, port: int, log) -> None:
        self.folder, self.port, self.log, self.url = folder, port, log, f"http://127.0.0.1:{port}"
        self.starts, self.process = 0, None

    def start(self) -> None:
        self.process = start_vllm_serve(self.folder, self.port, self.log)
        self.starts += 1

    def stop(self) -> None:
        stop_vllm_serve(self.process)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@pytest.fixture(scope="session")
def vllm_server(rm_folder, tmp_path_factory):
    """``vllm serve`` of the RM export on a free localhost port, stopped at the end. One start (about a minute on 2
    CPU cores) serves every test; the restart test stops it mid-run and leaves it started again."""
    pytest.importorskip("vllm")
    server = VllmServe(rm_folder, free_port(), tmp_path_factory.mktemp("vllm") / "serve.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


class FakeServer:
    """A real HTTP/1.1 server on localhost standing in for vLLM: lists `model`, answers ``/classify`` with the length
    of each sequence as its score (rows in reverse order, as a server may), after `delay_s` (for the first `slow_first`
    requests only, when set), with `status` for the first `fail_first` requests; keeps connections alive and records
    the client address of each request in `connections`."""

    def __init__(self, delay_s=0.0, fail_first=0, status=503, model=str(TINY_MODEL), slow_first=None):
        self.delay_s, self.fail_first, self.status, self.model, self.requests = delay_s, fail_first, status, model, 0
        self.slow_first, self.connections = slow_first, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: a pooled client reuses its connections

            def log_message(self, *args):
                pass

            def do_GET(self):
                fake.connections.append(self.client_address)
                self._reply(200, {"object": "list", "data": [{"id": fake.model, "object": "model"}]})

            def do_POST(self):
                fake.connections.append(self.client_address)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests += 1
                if fake.requests <= fake.fail_first:
                    return self._reply(fake.status, {"error": {"message": f"busy (request {fake.requests})"}})
                if fake.slow_first is None or fake.requests <= fake.slow_first:
                    time.sleep(fake.delay_s)
                rows = [{"index": i, "label": None, "probs": [float(len(ids))], "num_classes": 1}
                        for i, ids in enumerate(body["input"])]
                self._reply(200, {"object": "list", "model": body["model"], "data": rows[::-1]})

            def _reply(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except BrokenPipeError:  # the client gave up (timed out)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _env(tmp_path, source, **config):
    path = tmp_path / "env.py"
    path.write_text(source)
    weights = {"length": 1.0} if "length" in source else None
    return load_environment(str(path), weights=weights, reward_model=RewardModelConfig(**config))


def _calls(conversations):
    return [(messages, None, f"row {i}") for i, messages in enumerate(conversations)]


def test_conversations_are_tokenised_as_the_rm_task_trains(tokenizer):
    """The client's token ids for prompt + completion are the preference data module's ids for that side."""
    from rl_lightning.data import PreferenceDataModule

    data = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), tokenizer_name=str(TINY_MODEL), max_length=4096)
    data.setup("fit")
    rows = [json.loads(line) for line in (DEMO_DATA / "preference.jsonl").read_text().splitlines()]
    assert len(rows) == len(data.units["train"]) > 0  # no pair dropped: the rows and pairs line up
    for row, pair in zip(rows, data.units["train"], strict=True):
        for side, sequence in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            conversation = row["messages"] + [{"role": "assistant", "content": row[side]}]
            assert conversation_tokens(tokenizer, conversation) == sequence.input_ids


@pytest.mark.slow
def test_vllm_server_scores_equal_transformers_scores(rm_folder, vllm_server, monkeypatch):
    """Raw scores (use_activation false: no sigmoid) from the server equal transformers' logits, batched or not, and
    through the example environment's reward_fn. Tolerance 1e-5: both run float32, with different attention/matmul
    kernels (measured difference 2.4e-7)."""
    local = LocalRewardModel(rm_folder, batch_size=4)  # padded batches of up to 4
    one_by_one = [LocalRewardModel(rm_folder, batch_size=1).score([c])[0] for c in CONVERSATIONS]
    served = RewardModelClient(vllm_server.url, batch_size=2, concurrency=2).score(CONVERSATIONS)
    assert len(served) == len(CONVERSATIONS) and len(set(served)) == len(served)  # distinct: a real comparison
    for expected, batched, got in zip(one_by_one, local.score(CONVERSATIONS), served, strict=True):
        assert abs(batched - expected) < 1e-5 and abs(got - expected) < 1e-5
    monkeypatch.setenv("RL_REWARD_MODEL_URL", vllm_server.url)
    example = load_environment(str(REPO / "rl_lightning" / "recipes" / "envs" / "rm_env.py"))
    assert abs(example.score(CONVERSATIONS[-1], None, "row 0")[0] - one_by_one[-1]) < 1e-5


def _ppo_with_reward_model(tmp_path, env_source, reward_model, **rollout):
    env = tmp_path / "env.py"
    env.write_text(env_source)
    metrics, captured = Metrics(), []

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            captured.append(batch["rollout"].trajectories)

    L.seed_everything(0)
    model = ppo_task(env, max_rollouts=1, rollout={"reward_workers": 0, "responses_per_prompt": 2,
                                                   "max_new_tokens": 6, "reward_model": reward_model, **rollout})
    fit(model, prompts(2), -1, [metrics, Capture()])
    return metrics.history[0], captured[0]


@pytest.mark.slow
def test_served_reward_model_component_is_logged_and_added(tmp_path, rm_folder, vllm_server):
    """A scalar reward_fn (0.5) plus the served RM with weight 2: each reward is 0.5 + 2 x the RM's (transformers')
    score of the trajectory, and train/reward/reward_model is their mean."""
    logged, trajectories = _ppo_with_reward_model(tmp_path, CONSTANT_ENV, RewardModelConfig(
        url=vllm_server.url, weight=2.0, batch_size=3))
    expected = LocalRewardModel(rm_folder).score([t.messages for t in trajectories])
    assert len(trajectories) == 4
    for t, score in zip(trajectories, expected, strict=True):
        assert abs(t.reward_components["reward_model"] - score) < 1e-5  # float32 kernels, as above
        assert abs(t.reward - (0.5 + 2.0 * t.reward_components["reward_model"])) < 1e-12
    assert abs(logged["train/reward/reward_model"] - sum(expected) / 4) < 1e-5
    assert logged["train/reward_failures"] == 0.0


def test_in_process_reward_model_joins_the_weighted_components(tmp_path, rm_folder):
    """`path`: the RM runs in the trainer; with reward_weights it is one more weighted component."""
    logged, trajectories = _ppo_with_reward_model(
        tmp_path, LENGTH_ENV, RewardModelConfig(path=rm_folder, name="rm", weight=0.5),
        reward_weights={"length": 1.0})
    expected = LocalRewardModel(rm_folder).score([t.messages for t in trajectories])
    for t, score in zip(trajectories, expected, strict=True):
        assert t.reward_components["rm"] == pytest.approx(score, abs=1e-6)
        length = len(t.messages[-1]["content"]) / 10
        assert t.reward == pytest.approx(length + 0.5 * score, abs=1e-9)
    assert logged["train/reward/rm"] == pytest.approx(sum(expected) / len(expected), abs=1e-6)
    assert "train/reward/length" in logged


def test_timeout_raises_one_line_error_or_scores_zero_and_counts(tmp_path):
    with FakeServer(delay_s=2.0) as server:
        config = {"url": server.url, "timeout_s": 0.3, "retries": 0}
        env = _env(tmp_path, CONSTANT_ENV, **config)
        env.reward_model.start()
        with pytest.raises(RewardModelError) as error:
            env.score_all(_calls(CONVERSATIONS[:2]))
        message = str(error.value)
        assert "\n" not in message and error.value.timed_out
        assert f"reward model at {server.url}/classify: no answer within timeout_s=0.3" in message
        assert "model.rollout.reward_model.timeout_s" in message and "on_error: zero" in message
        env = _env(tmp_path, CONSTANT_ENV, on_error="zero", batch_size=2, **config)
        scores = env.score_all(_calls(CONVERSATIONS[:3]))
    assert scores == [(0.5, {"reward_model": 0.0})] * 3  # reward_fn's 0.5, the RM component zeroed
    assert env.failures == 3 and env.timeouts == 3


def test_tchebycheff_takes_the_reward_model_as_one_more_component(tmp_path):
    """reward = -max_k w_k |ideal_k - r_k| over reward_fn's `length` and the RM (the fake server scores a sequence by
    its token count), with the RM's weight and ideal."""
    path = tmp_path / "env.py"
    path.write_text(LENGTH_ENV)
    with FakeServer() as server:
        env = load_environment(str(path), weights={"length": 1.0}, combination="tchebycheff",
                               ideal={"length": 1.0, "reward_model": 100.0},
                               reward_model=RewardModelConfig(url=server.url, weight=0.5))
        scores = env.score_all(_calls(CONVERSATIONS))
    assert env.component_names == ["length", "reward_model"]
    for conversation, (reward, components) in zip(CONVERSATIONS, scores, strict=True):
        length, tokens = len(conversation[-1]["content"]) / 10, len(conversation_tokens(env.reward_model.tokenizer,
                                                                                        conversation))
        assert components == {"length": length, "reward_model": float(tokens)}
        assert reward == pytest.approx(-max(abs(1.0 - length), 0.5 * abs(100.0 - tokens)), abs=1e-12)
    with pytest.raises(ConfigError, match=r"reward_ideal must name the same components as reward_weights \['length', "
                                          r"'reward_model'\]"):
        load_environment(str(path), weights={"length": 1.0}, combination="tchebycheff", ideal={"length": 1.0},
                         reward_model=RewardModelConfig(url="http://x"))


def test_failed_requests_are_retried_with_backoff_then_succeed(tmp_path):
    with FakeServer(fail_first=2) as server:
        client = RewardModelClient(server.url, retries=2, backoff_s=0.01)
        scores = client.score(CONVERSATIONS[:3])
        assert server.requests == 3  # two 503 answers, then the scores
    expected = [float(len(conversation_tokens(client.tokenizer, c))) for c in CONVERSATIONS[:3]]
    assert scores == expected  # in request order although the server answered in reverse
    with FakeServer(fail_first=5) as server:
        with pytest.raises(RewardModelError, match=r"HTTP 503: busy \(request 2\) after 2 attempt\(s\)"):
            RewardModelClient(server.url, retries=1, backoff_s=0.01).score(CONVERSATIONS[:1])
    with FakeServer(fail_first=5, status=400) as server:  # a client error is not retried
        with pytest.raises(RewardModelError, match=r"HTTP 400: busy \(request 1\) after 1 attempt"):
            RewardModelClient(server.url, retries=3, backoff_s=0.01).score(CONVERSATIONS[:1])
        assert server.requests == 1


def test_start_up_check_and_config_errors(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConfigError, match=rf"reward model at {url}/v1/models: cannot connect .*model.rollout."
                                          r"reward_model.url") as error:
        RewardModelConfig(url=url, retries=0).build().start()
    assert "on_error" not in str(error.value)  # a wrong URL always stops: no training on zeros
    env = tmp_path / "env.py"
    env.write_text(CONSTANT_ENV)
    model = ppo_task(env, max_rollouts=1, rollout={"reward_workers": 0, "reward_model": RewardModelConfig(
        url=url, retries=0)})
    with pytest.raises(ConfigError, match=r"cannot connect"):  # at fit start, before any rollout
        fit(model, prompts(2), -1)
    assert model.rollouts == 0
    with FakeServer() as server:
        with pytest.raises(ConfigError, match=r"model.rollout.reward_model.model='other' is not served by"):
            RewardModelConfig(url=server.url, model="other").build().start()
    with pytest.raises(ConfigError, match=r"model.rollout.reward_model.url and path are exclusive"):
        RewardModelConfig(url="http://x", path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"model.rollout.reward_model.url and path are exclusive"):
        RewardModelConfig()
    with pytest.raises(ConfigError, match=r"reward_model.batch_size and concurrency must be >= 1.*got 0"):
        RewardModelConfig(url="http://x", batch_size=0)
    with pytest.raises(ConfigError, match=r"reward_model.name='length' is also a component of reward_weights"):
        _env(tmp_path, LENGTH_ENV, url="http://x", name="length")


def test_requests_share_pooled_connections():
    """One pooled httpx client: sequential requests (the start-up check, then one batch per request) reuse one kept-alive
    connection instead of opening one each, and a copy (pickled, as a worker would get it) opens its own pool."""
    with FakeServer() as server:
        client = RewardModelClient(server.url, batch_size=1, concurrency=1)
        scores = client.score(CONVERSATIONS)
        assert len(server.connections) == 1 + len(CONVERSATIONS) and len(set(server.connections)) == 1
        copy = pickle.loads(pickle.dumps(client))
        assert copy.score(CONVERSATIONS[:2]) == scores[:2]
        assert len(set(server.connections)) == 2  # the copy's own connection
        client.close()
        assert client.score(CONVERSATIONS[:1]) == scores[:1]  # closed: the next request opens a new pool


def test_an_answer_that_times_out_is_retried():
    """A read timeout is retried by the client's own policy (not the transport's, which retries connecting only)."""
    with FakeServer(delay_s=2.0, slow_first=1) as server:
        client = RewardModelClient(server.url, timeout_s=0.5, retries=1, backoff_s=0.01)
        client.start()
        assert client.score(CONVERSATIONS[:1]) == [float(len(conversation_tokens(client.tokenizer,
                                                                                   CONVERSATIONS[0])))]
        assert server.requests == 2


def test_connection_failures_are_retried_by_the_transport():
    """Nothing listens: the transport tries to connect 1 + retries times (httpcore's backoff 0 s, 0.5 s), then one
    line says so; the client's own loop does not retry a connection the transport already gave up on."""
    url = f"http://127.0.0.1:{free_port()}"
    client = RewardModelClient(url, retries=2, backoff_s=10.0)  # a retry of the client's own would sleep 10 s
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"/v1/models: cannot connect \(.*\) after 3 attempt\(s\)"):
        client.start()
    assert 0.5 <= time.monotonic() - start < 5.0


@pytest.mark.slow  # a restart of the session's vllm serve (about a minute on 2 CPU cores) and a 3-rollout fit
def test_a_real_vllm_serve_stopped_and_restarted_mid_run_costs_only_the_rollout_it_missed(tmp_path, rm_folder,
                                                                                          vllm_server):
    """A real ``vllm serve`` of the RM export (the session's) is stopped (its whole process group) before rollout 1
    and started again on the same port before rollout 2: under ``on_error: zero`` the run goes on; rollouts 0 and 2
    get transformers' scores of their trajectories, rollout 1 gets 0 on each of its 4 and is counted
    (train/reward_failures 0, 4, 4; rollout/reward_model_failures 2 failed requests of 2 trajectories)."""
    starts, first = vllm_server.starts, vllm_server.process
    metrics, captured = Metrics(), []

    class Outage(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                vllm_server.stop()
            elif batch_idx == 2:
                vllm_server.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            captured.append(batch["rollout"].trajectories)

    env = tmp_path / "env.py"
    env.write_text(CONSTANT_ENV)
    reward_model = RewardModelConfig(url=vllm_server.url, batch_size=2, concurrency=1, retries=1,
                                     timeout_s=10.0, on_error="zero")
    L.seed_everything(0)
    task = ppo_task(env, max_rollouts=3, rollout={"reward_workers": 0, "responses_per_prompt": 2, "max_new_tokens": 6,
                                                  "reward_model": reward_model})
    try:
        fit(task, prompts(2), -1, [Outage(), metrics])
    finally:
        if not vllm_server.running:  # the later tests need it up
            vllm_server.start()
    assert vllm_server.starts == starts + 1 and first.returncode is not None and vllm_server.process is not first
    assert [len(r) for r in captured] == [4, 4, 4]
    local = LocalRewardModel(rm_folder)
    for index, trajectories in enumerate(captured):
        got = [t.reward_components["reward_model"] for t in trajectories]
        if index == 1:
            assert got == [0.0] * 4
        else:  # float32 kernels of vLLM and transformers differ (measured 2.4e-7, see the parity test)
            expected = local.score([t.messages for t in trajectories])
            assert all(abs(g - e) < 1e-5 for g, e in zip(got, expected, strict=True)) and any(got)
    assert [m["train/reward_failures"] for m in metrics.history] == [0.0, 4.0, 4.0]
    assert [m.get("rollout/reward_model_failures", 0.0) for m in metrics.history] == [0.0, 2.0, 2.0]
