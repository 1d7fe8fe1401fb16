"""A stand-in for vLLM 0.32's ``vllm`` package, for the engine-process contract tests (no GPU, no real engine).

``LLM`` keeps vLLM 0.32's sleep/wake rules: ``sleep`` needs ``enable_sleep_mode`` and puts the weights and the KV cache
to sleep and pauses the scheduler; ``wake_up(tags)`` wakes those tags and resumes the scheduler only once nothing is
asleep (vllm/v1/engine/core.py ``wake_up``). A paused real engine never finishes ``generate`` (it spins); this one
refuses with an error instead, so a test fails rather than hangs. ``reload_weights`` while the weights are asleep is
refused too.

Every call is appended, as one JSON line, to the file given as the ``call_log`` argument (engine kwargs reach
``LLM``), with what is asleep at that moment; ``init`` also records the process's ``CUDA_VISIBLE_DEVICES``.
``fake_hang`` / ``fake_exit`` (``"init"`` or ``"generate"``) make that call never return / end the process with exit
code 17. ``fake_busy_starts=N``: the first N starts after the first one (restarts) fail as vLLM 0.32 does when the
device's memory is not free yet (``ValueError: Free memory on device ... on startup is less than desired GPU memory
utilization``; vllm/v1/worker/utils.py), as a restart can while the driver still releases the lost process's memory.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from typing import Any

import torch

__version__ = "0.32.0-fake"
TAGS = ("weights", "kv_cache")
EXIT_CODE = 17


class SamplingParams:
    """Keeps its keyword arguments as attributes."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


class LLM:
    """Records its calls; generates only when fully awake (see the module docstring)."""

    def __init__(self, model: str, *, call_log: str, enable_sleep_mode: bool = False, fake_hang: str | None = None,
                 fake_exit: str | None = None, fake_busy_starts: int = 0, **kwargs: Any) -> None:
        self.call_log, self.sleep_mode, self.hang, self.exit = call_log, enable_sleep_mode, fake_hang, fake_exit
        calls = [json.loads(line)["call"] for line in open(call_log)] if os.path.exists(call_log) else []
        if "init" in calls and calls.count("init_busy") < fake_busy_starts:
            self.asleep, self.paused = set(), False
            self._record("init_busy")
            raise ValueError("Free memory on device cuda:0 (1.20/79.11 GiB) on startup is less than desired GPU memory "
                             "utilization (0.9, 71.20 GiB). Decrease GPU memory utilization or reduce GPU memory used "
                             "by other processes.")
        self.asleep: set[str] = set()
        self.paused = False
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32),
                                          engine_core=SimpleNamespace(shutdown=lambda: self._record("shutdown")))
        self._record("init", sleep_mode=enable_sleep_mode, pid=os.getpid(),
                     cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
        self._stall("init")

    def _record(self, call: str, **details: Any) -> None:
        with open(self.call_log, "a") as f:
            f.write(json.dumps({"call": call, "asleep": sorted(self.asleep), "paused": self.paused, **details}) + "\n")

    def _stall(self, where: str) -> None:
        if self.hang == where:
            time.sleep(3600)
        if self.exit == where:
            os._exit(EXIT_CODE)

    def sleep(self, level: int = 1) -> None:
        self._record("sleep", level=level)
        if not self.sleep_mode:
            raise ValueError("fake vLLM: sleep mode is not enabled (LLM(enable_sleep_mode=True))")
        if level == 0:  # pause the scheduler only
            self.paused = True
            return
        self.asleep, self.paused = set(TAGS), True

    def release_kv_cache_memory(self) -> None:
        self._record("release_kv_cache_memory")
        if not self.paused or self.asleep:  # vLLM 0.32: a completed pause, all executor memory resident
            raise RuntimeError("fake vLLM: release_kv_cache_memory() requires a completed pause first, and all "
                               "executor memory resident")
        self.asleep = {"kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self._record("wake_up", tags=tags)
        self.asleep -= set(TAGS if tags is None else tags)
        self.paused = self.paused and bool(self.asleep)
        return not self.asleep

    def reset_prefix_cache(self) -> bool:
        self._record("reset_prefix_cache")
        return True

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> list[Any]:
        if "weights" in self.asleep:
            self._record(f"{method}_refused")
            raise RuntimeError(f"fake vLLM: {method} while the weights are asleep")
        tensors = list(kwargs["weights_iterator"])
        self._record(method, tensors=len(tensors))
        return []

    def apply_model(self, fn: Any) -> list[Any]:
        self._record("apply_model")
        return []

    def generate(self, inputs: list[dict], sampling: list[SamplingParams], use_tqdm: bool = False,
                 lora_request: Any = None) -> list[Any]:
        self._stall("generate")
        if self.paused or self.asleep:
            self._record("generate_refused", prompts=len(inputs))
            raise RuntimeError(f"fake vLLM 0.32: generate while {sorted(self.asleep)} asleep: the scheduler stays "
                               "paused until the engine is fully awake, so a real engine would spin forever")
        self._record("generate", prompts=len(inputs))
        return [SimpleNamespace(outputs=[_output(request["prompt_token_ids"], params, k) for k in range(params.n)])
                for request, params in zip(inputs, sampling, strict=True)]


def _output(prompt: list[int], params: SamplingParams, sample: int) -> Any:
    """Token i: (sum(prompt) + draw + i) % 97, the draw being the request's seed (mod 97) or, unseeded, the sample."""
    seed = getattr(params, "seed", None)
    draw = sample if seed is None else (seed + sample) % 97
    tokens = [(sum(prompt) + draw + i) % 97 for i in range(params.max_tokens)]
    return SimpleNamespace(token_ids=tokens, logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in tokens],
                           finish_reason="length")
