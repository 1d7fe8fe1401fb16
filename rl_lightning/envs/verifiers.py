"""verifiers (0.4, ``verifiers.v1``) tasksets as ``reward_fn``/``interact``: ``env_path: verifiers:<taskset>``.

The mapping is described in `rl_lightning.envs.adapters`; verifiers is imported only when one is used.

Trust: the taskset is code the user installed, and its tools run in-process (in the reward workers, `trust`), not in
the runtime verifiers would serve them from. What the model chooses is data: a call names one of the declared tools
(`VerifiersAdapter.tools`), passes only that tool's declared parameters, with values of their annotated types
(validated by pydantic, as verifiers' MCP server would), and at most `MAX_TOOL_CALLS` calls are answered per turn;
anything else is answered with an ``error: ...`` tool message the model reads, never raised.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from typing import Any

from rl_lightning.compat.verifiers import reward_weight
from rl_lightning.errors import ConfigError

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
MAX_TOOL_CALLS = 16
"""Tool calls answered per assistant turn; later ones get one error message."""


class VerifiersAdapter:
    """A verifiers ``Taskset`` class as ``reward_fn``/``interact`` (see the module docstring)."""

    trust = "in-process"  # the tools run in the reward workers; the model's calls are filtered (module docstring)

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
        self.weights = {fn.__name__: reward_weight(fn) for fn in rewards}
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
                             "data (a dict; rl_lightning.envs.adapters.export_rows writes such rows)")
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
        calls = TOOL_CALL.findall(messages[-1]["content"] or "")
        replies = []
        for index, call in enumerate(calls[:MAX_TOOL_CALLS]):
            try:
                content = self.call(call)
            except Exception as e:  # noqa: BLE001 - the model's call failed: the model reads why, as with MCP
                content = f"error: {type(e).__name__}: {e}"
            replies.append({"role": "tool", "content": content, "tool_call_id": f"call_{len(messages)}_{index}"})
        if len(calls) > MAX_TOOL_CALLS:
            replies.append({"role": "tool", "content": f"error: {len(calls) - MAX_TOOL_CALLS} tool call(s) not run: "
                            f"at most {MAX_TOOL_CALLS} per turn", "tool_call_id": f"call_{len(messages)}_rest"})
        return replies

    def call(self, text: str) -> str:
        """Run one ``{"name": ..., "arguments": {...}}`` call of a declared tool; a `ValueError` for anything else."""
        request = json.loads(text)
        if not isinstance(request, dict) or not isinstance(request.get("name"), str):
            raise ValueError('a tool call is {"name": "<tool>", "arguments": {...}}')
        name, arguments = request["name"], request.get("arguments") or {}
        if name not in self.tools:
            raise ValueError(f"unknown tool {name[:80]!r}; the tools are {sorted(self.tools)}")
        if not isinstance(arguments, dict):
            raise ValueError(f"{name}: arguments must be a JSON object, got {type(arguments).__name__}")
        fn = self.tools[name]
        declared = _parameters(fn)
        unknown = sorted(set(arguments) - set(declared))
        if unknown:
            raise ValueError(f"{name} takes {declared}, not {[k[:40] for k in unknown[:5]]}")
        result = _validated(fn, name)(**arguments)
        return str(_run(result) if inspect.isawaitable(result) else result)


def _parameters(fn: Callable[..., Any]) -> list[str]:
    """The names a tool declares (no ``*args``/``**kwargs``, nothing verifiers injects such as a runtime)."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [n for n, p in inspect.signature(fn).parameters.items() if p.kind in named and n not in ("runtime", "state")]


def _validated(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn` with its arguments validated against its annotations; a failure is one `ValueError` line."""
    from pydantic import ValidationError, validate_call

    checked = validate_call(fn)

    def call(**arguments: Any) -> Any:
        try:
            return checked(**arguments)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:3])
            raise ValueError(f"{name}: {problems}") from None

    return call


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
