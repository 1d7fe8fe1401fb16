"""Third-party environments declare their trust (issue 36.8): a verifiers tool call reaches only a declared tool, with
only its declared parameters of their annotated types (anything else is an error message the model reads); an
OpenEnv environment is played against its own server when named by URL (``trust = "server"``), and in-process only
when named as a module (``trust = "in-process"``, said in the log)."""

import json
import logging
import subprocess
import sys
import time

import httpx
import pytest
from conftest import REPO
from helpers import free_port

from rl_lightning.envs.adapters import load_adapter
from rl_lightning.envs.environment import load_environment
from rl_lightning.errors import ConfigError

pytest.importorskip("verifiers.v1", reason="the envs extra: pip install -e '.[envs]'")
pytest.importorskip("openenv.core", reason="the envs extra: pip install -e '.[envs]'")

OPENENV = f"{REPO}/rl_lightning/recipes/envs/openenv_arithmetic.py"
TASKSET = f"""
import json
import sys

sys.path.insert(0, {str(REPO / "rl_lightning" / "recipes" / "envs")!r})
import verifiers.v1 as vf
from verifiers_arithmetic import ArithmeticTask, ArithmeticTaskset, CalculatorToolset


class EchoToolset(vf.Toolset):
    TOOL_PREFIX = None

    @vf.tool
    def echo(self, text: str, times: int = 1, **options) -> str:
        return text * times + json.dumps(options)

    def helper(self, path: str) -> str:  # not a tool
        return "helper ran"


class EchoTask(ArithmeticTask):
    @classmethod
    def toolsets(cls, config):
        return [CalculatorToolset(vf.ToolsetConfig()), EchoToolset(vf.ToolsetConfig())]


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    load = ArithmeticTaskset.load


__all__ = ["EchoTaskset"]
"""


def _calls(*calls):
    text = "".join(f"<tool_call>{c if isinstance(c, str) else json.dumps(c)}</tool_call>" for c in calls)
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


def test_verifiers_tools_take_only_declared_tools_parameters_and_types(tmp_path, caplog):
    path = tmp_path / "echo_taskset.py"
    path.write_text(TASKSET)
    with caplog.at_level(logging.WARNING, logger="rl_lightning.envs.environment"):
        env = load_environment(f"verifiers:{path}")
    assert load_adapter(f"verifiers:{path}").trust == "in-process"
    assert [r.message.split(" runs ")[1][:10] for r in caplog.records] == ["in-process"]
    replies = env.interact(_calls(
        {"name": "echo", "arguments": {"text": "ab", "times": 2}},
        {"name": "echo", "arguments": {"text": "ab", "shell": "rm -rf /"}},  # into **options before
        {"name": "echo", "arguments": {"text": ["ab"]}},
        {"name": "echo", "arguments": ["ab"]},
        {"name": "helper", "arguments": {"path": "/etc/passwd"}},
        {"name": "calculate", "arguments": {"expression": "6 * 7"}},
        '["not", "a", "call"]',
    ))
    assert [r["content"] for r in replies] == [
        "abab{}",
        "error: ValueError: echo takes ['text', 'times'], not ['shell']",
        "error: ValueError: echo: text: Input should be a valid string",
        "error: ValueError: echo: arguments must be a JSON object, got list",
        "error: ValueError: unknown tool 'helper'; the tools are ['calculate', 'echo']",
        "42",
        'error: ValueError: a tool call is {"name": "<tool>", "arguments": {...}}',
    ]
    many = env.interact(_calls(*[{"name": "calculate", "arguments": {"expression": "1 + 1"}}] * 20))
    assert [r["content"] for r in many] == ["2"] * 16 + ["error: 4 tool call(s) not run: at most 16 per turn"]


@pytest.fixture(scope="module")
def openenv_server(tmp_path_factory):
    """The example OpenEnv environment served by OpenEnv's own app (uvicorn) on a free localhost port."""
    port = free_port()
    script = (f"import sys, uvicorn; sys.path.insert(0, {str(REPO / 'rl_lightning' / 'recipes' / 'envs')!r})\n"
              "from openenv.core.env_server import create_app\n"
              "from openenv_arithmetic import ArithmeticGame, GuessAction, GuessObservation\n"
              "app = create_app(ArithmeticGame, GuessAction, GuessObservation, max_concurrent_envs=4)\n"
              f"uvicorn.run(app, host='127.0.0.1', port={port}, log_level='warning')\n")
    log = tmp_path_factory.mktemp("openenv") / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        process.kill()
        pytest.fail(f"the OpenEnv server did not start: {log.read_text()[-2000:]}")
    yield url
    process.terminate()
    process.wait(timeout=30)


def test_openenv_served_by_its_own_server_scores_as_in_process(openenv_server, caplog):
    with caplog.at_level(logging.WARNING, logger="rl_lightning.envs.environment"):
        served = load_environment(f"openenv:{openenv_server}", weights={})
    assert caplog.records == [] and load_adapter(f"openenv:{openenv_server}").trust == "server"
    local = load_environment(f"openenv:{OPENENV}", weights={})
    assert load_adapter(f"openenv:{OPENENV}").trust == "in-process"
    prompt = [{"role": "user", "content": "What is 3 + 4?", "reset": {"a": 3, "b": 4}}]
    for turns in (["7"], ["The answer is 7."], ["6", "7"], ["1", "2", "3", "4"]):
        messages = prompt + [{"role": "assistant", "content": t} for t in turns]
        assert served.score(messages, None, "row 1")[0] == pytest.approx(local.score(messages, None, "row 1")[0])
    wrong = prompt + [{"role": "assistant", "content": "6"}]
    assert served.interact(wrong) == local.interact(wrong) == [
        {"role": "user", "content": "Not quite. Check your sum and answer again."}]
    assert served.interact(prompt + [{"role": "assistant", "content": "7"}]) == []
    port = free_port()  # nothing listens there
    with pytest.raises(ConfigError, match=rf"no OpenEnv server answers http://127.0.0.1:{port}/schema .*start the "):
        load_adapter(f"openenv:http://127.0.0.1:{port}")
