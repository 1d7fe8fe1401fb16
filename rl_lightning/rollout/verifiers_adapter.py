"""verifiers (0.4, ``verifiers.v1``) tasksets as ``reward_fn``/``interact``: ``env_path: verifiers:<taskset>``.

The mapping is described in `rl_lightning.rollout.env_adapters`; verifiers is imported only when one is used.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from typing import Any

from rl_lightning.errors import ConfigError

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class VerifiersAdapter:
    """A verifiers ``Taskset`` class as ``reward_fn``/``interact`` (see the module docstring)."""

    def __init__(self, taskset_class: Any, where: str) -> None:
        from verifiers.v1 import Taskset, TasksetConfig
        from verifiers.v1.utils.generic import concrete_type

        self.where = where
        config_type = concrete_type(taskset_class, TasksetConfig, origin=Taskset) or TasksetConfig
        try:
            self.taskset = taskset_class(config_type())
        except Exception as e:  # noqa: BLE001 - a taskset whose config has required fields, or that fails to build
            raise ConfigError(f"{where}: {taskset_class.__name__}({config_type.__name__}()) failed: "
                              f"{type(e).__name__}: {e}; give its config fields defaults") from None
        self.task_type = taskset_class.task_type()
        self.data_type = self.task_type.data_type()
        self.task_config = self.taskset.config.task
        probe = self.task_type(None, self.task_config)  # hooks and judges read the class and the config only
        rewards = [fn for fn in probe.hooks("reward") if not _needs_runtime(fn)]
        if not rewards and not probe.plugged_judges():
            raise ConfigError(f"{where}: its task {self.task_type.__name__} has no @vf.reward method (that runs "
                              "without a sandbox runtime): add one")
        sync = [fn.__name__ for fn in rewards if not inspect.iscoroutinefunction(fn)]
        if sync:
            raise ConfigError(f"{where}: rewards {sync} of {self.task_type.__name__} are not async (verifiers awaits "
                              "them): declare them `async def`")
        self.weights = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in rewards}
        self.weights |= {j.reward_name: float(j.config.weight) for j in probe.plugged_judges()}
        self.tools = self._tools()

    def _tools(self) -> dict[str, Callable[..., Any]]:
        from verifiers.v1.utils.decorators import discover_decorated

        toolsets = [*self.task_type.toolsets(self.task_config), *type(self.taskset).toolsets(self.taskset.config)]
        tools = {}
        for toolset in toolsets:
            for fn in discover_decorated(toolset, "tool"):
                name = getattr(fn, "tool_name", None) or fn.__name__
                tools[name] = fn
                if toolset.server_name:  # the name the model is shown by verifiers' MCP server: `<server>_<tool>`
                    tools[f"{toolset.server_name}_{name}"] = fn
        return tools

    def task(self, messages: list[dict], answer: Any) -> Any:
        """The task for a row: its data from `answer` (a dict) or from the prompt `messages` and `answer`."""
        if isinstance(answer, dict):
            data = self.data_type.model_validate(answer)
        elif "answer" in self.data_type.model_fields:
            prompt = messages[:next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))]
            data = self.data_type.model_validate({"prompt": [_vf_fields(m) for m in prompt], "answer": answer})
        else:
            raise ValueError(f"{self.data_type.__name__} has no `answer` field: give each row's answer as the task "
                             "data (a dict; rl_lightning.rollout.env_adapters.export_rows writes such rows)")
        return self.task_type(data, self.task_config)

    def trace(self, task: Any, messages: list[dict]) -> Any:
        """The conversation as a one-branch ``vf.Trace`` of `task`, its assistant turns sampled."""
        from pydantic import TypeAdapter
        from verifiers.v1 import AgentConfig, Message, Trace
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, TraceTask

        parse = TypeAdapter(Message).validate_python
        nodes = [MessageNode(parent=i - 1 if i else None, message=parse(_vf_fields(m)),
                             sampled=m["role"] == "assistant") for i, m in enumerate(messages)]
        return Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=AgentInfo(config=AgentConfig()), nodes=nodes)

    def reward_fn(self, messages: list[dict], answer: Any) -> dict[str, float]:
        """The task's own scores of the conversation, one component per reward (their weights: `weights`)."""
        task = self.task(messages, answer)
        trace = self.trace(task, messages)
        _run(task.score(trace))
        missing = [name for name in self.weights if trace.rewards.get(name) is None]
        if missing:
            raise ValueError(f"{task.data.name or type(task).__name__} left rewards {missing} unscored")
        return {name: float(reward.score) for name, reward in trace.rewards.items() if reward is not None}

    def interact(self, messages: list[dict]) -> list[dict]:
        """A ``tool`` message for each tool call of the last assistant turn (its result, or the error), else []."""
        replies = []
        for index, call in enumerate(TOOL_CALL.findall(messages[-1]["content"] or "")):
            call_id = f"call_{len(messages)}_{index}"
            try:
                request = json.loads(call)
                name, arguments = request["name"], request.get("arguments") or {}
                if name not in self.tools:
                    raise KeyError(f"unknown tool {name!r}; the tools are {sorted(self.tools)}")
                result = self.tools[name](**arguments)
                content = str(_run(result) if inspect.isawaitable(result) else result)
            except Exception as e:  # noqa: BLE001 - the model's call failed: the model reads why, as with MCP
                content = f"error: {type(e).__name__}: {e}"
            replies.append({"role": "tool", "content": content, "tool_call_id": call_id})
        return replies


def _needs_runtime(fn: Callable[..., Any]) -> bool:
    """Whether a verifiers reward needs a sandbox runtime (verifiers skips those when scoring without one)."""
    parameter = inspect.signature(fn).parameters.get("runtime")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _vf_fields(message: dict) -> dict:
    fields = {"role": message["role"], "content": message.get("content") or ""}
    if message["role"] == "tool":
        fields["tool_call_id"] = message.get("tool_call_id", "")
    return fields


def _run(coroutine: Any) -> Any:
    """Await `coroutine` from synchronous code (a worker thread when this thread already runs an event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
