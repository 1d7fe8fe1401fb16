"""vLLM's engine internals the colocated engine reaches, behind named functions (tested on vllm 0.32).

``vllm.LLM`` has no public way to read the model's dtype, stop its engine core, or reload weights in place: these go
through ``llm.llm_engine`` (``model_config``, ``engine_core``) and the workers' ``reload_weights`` method.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

TESTED = "vllm 0.32"


def model_dtype(llm: Any) -> Any:
    """The torch dtype the engine's model runs in (``llm.llm_engine.model_config.dtype``)."""
    return llm.llm_engine.model_config.dtype


def reload_weights(llm: Any, named_tensors: Iterable[tuple[str, Any]]) -> None:
    """Load full tensors by checkpoint name into every worker's model, in order (the workers' ``reload_weights``)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors), "is_checkpoint_format": True})


def shutdown(llm: Any) -> None:
    """Stop the engine core (``llm.llm_engine.engine_core.shutdown()``); it also destroys the default process group."""
    llm.llm_engine.engine_core.shutdown()
