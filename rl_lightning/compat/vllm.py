"""vLLM's engine internals the colocated engine reaches, behind named functions (tested on vllm 0.32).

``vllm.LLM`` has no public way to read the model's dtype, stop its engine core, or reload weights in place: these go
through ``llm.llm_engine`` (``model_config``, ``engine_core``) and the workers' ``reload_weights`` method. vLLM also
reads its settings from environment variables: the ones the engine sets are written here (`quiet_logging`,
`external_launcher_environment`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

TESTED = "vllm 0.32"
# vLLM's start-up error when the device's free memory is below its budget (vllm/v1/worker/utils.py), as after a
# restart while the driver still releases the lost engine process's memory
NOT_FREE_YET = ("Free memory on device", "on startup", "is less than")


def model_dtype(llm: Any) -> Any:
    """The torch dtype the engine's model runs in (``llm.llm_engine.model_config.dtype``)."""
    return llm.llm_engine.model_config.dtype


def reload_weights(llm: Any, named_tensors: Iterable[tuple[str, Any]]) -> None:
    """Load full tensors by checkpoint name into every worker's model, in order (the workers' ``reload_weights``)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors), "is_checkpoint_format": True})


def shutdown(llm: Any) -> None:
    """Stop the engine core (``llm.llm_engine.engine_core.shutdown()``); it also destroys the default process group."""
    llm.llm_engine.engine_core.shutdown()


def quiet_logging(level: str = "ERROR") -> None:
    """Set vLLM's log level unless the user set one (``VLLM_LOGGING_LEVEL``, read when vllm is first imported)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", level)


def external_launcher_environment(rank: int, local_rank: int, world_size: int,
                                  rendezvous: tuple[str, int] | None = None) -> None:
    """What ``distributed_executor_backend="external_launcher"`` reads from the environment, set for this process.

    ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (Lightning sets the last two but never ``RANK``); with `rendezvous`
    (address, port), ``MASTER_ADDR``/``MASTER_PORT`` unless already set, for vLLM's own ``env://`` process group.
    """
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size)})
    if rendezvous is not None:
        os.environ.setdefault("MASTER_ADDR", rendezvous[0])
        os.environ.setdefault("MASTER_PORT", str(rendezvous[1]))


def memory_not_free_yet(message: str) -> bool:
    """Whether `message` is vLLM's refusal to start because the device's memory is not (yet) free."""
    return all(part in message for part in NOT_FREE_YET)
