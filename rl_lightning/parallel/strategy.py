"""`ParallelStrategy`: Lightning's ModelParallelStrategy with a 3-D mesh (data x context x tensor parallel).

- **Data parallel** ranks see different sequences. FSDP2 shards parameters, gradients and optimizer state over the
  flattened data x context group (ZeRO-3). ``replicate_size`` > 1 splits the data-parallel ranks into replica groups
  (HSDP: shard within a group, replicate across groups, all-reduce between replicas) — RL2's ``ddp_size``.
- **Context parallel** ranks see the same sequences and each keeps a zigzag share of every packed sequence; attention
  runs as ring attention over the group (`rl_lightning.attention.ring`).
- **Tensor parallel** ranks see the same tokens and hold column/row shards of each block's linear layers.

Mesh dims (outermost first): ``replicate, shard, context_parallel, tensor_parallel``; the derived 1-D meshes are
`dp_mesh` (data loading and count reductions), `cp_mesh`, `tp_mesh`, and `fsdp_mesh` (what ``fully_shard`` uses).
The tasks shard their models through `rl_lightning.parallel.parallelize.parallelize_for` in ``configure_model``.

Lightning hand-offs relied on (its private names in `rl_lightning.compat.lightning`, pinned by
tests/compat/test_lightning.py): Lightning's process-group set-up initialises the process group; the module's device
mesh is what ``LightningModule.device_mesh`` returns; ``distributed_sampler_kwargs`` is the only place Lightning reads
the data-parallel layout; under ``cpu_offload`` the root device is recorded as the module's (pinned by
tests/parallel/test_device_rules.py).
"""

from __future__ import annotations

import shutil
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from rl_lightning.compat.lightning import (
    StrategyHooks,
    checkpoint_io_if_set,
    process_group_backend,
    process_group_timeout,
    record_device,
    saves_distributed_checkpoint,
    set_checkpoint_io,
    set_device_mesh,
    setup_distributed,
)
from rl_lightning.compat.torch import flatten_mesh
from rl_lightning.errors import ConfigError
from rl_lightning.parallel.checkpoint_io import AtomicCheckpointIO, publish_folder
from rl_lightning.parallel.checkpoint_trust import (
    DCP_FILES,
    FOLDER_DIGESTS,
    folder_digests,
    own_shards,
    refuse_untrusted,
)
from rl_lightning.parallel.local_group import init_local_group, single_host


class ParallelStrategy(StrategyHooks, ModelParallelStrategy):
    """FSDP2 x ring-attention context parallel x tensor parallel on one device mesh.

    Args:
        data_parallel_size: data-parallel ranks (including replicas).
        context_parallel_size: ranks that split each sequence (ring attention); needs ``attn_implementation:
            rl_varlen`` and packed micro-batches.
        tensor_parallel_size: ranks that split each block's linear layers; must divide the attention and key-value
            head counts.
        replicate_size: HSDP replica groups: FSDP shards within ``data_parallel_size / replicate_size`` x context
            ranks and replicates across groups; must divide `data_parallel_size`.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU (FSDP2 CPUOffloadPolicy).
        mixed_precision: ``bf16`` computes in bfloat16 with fp32 master weights and fp32 gradient reduction (keep
            ``trainer.precision: 32-true``); ``null`` computes in the parameters' dtype.
        reshard_after_forward: free gathered parameters after each block's forward (ZeRO-3); False keeps them until
            the backward (ZeRO-2-like: faster, more memory).
        activation_offload: keep what each decoder block saves for the backward pass in host memory (pinned,
            copied asynchronously) until the backward needs it (`rl_lightning.parallel.offload`); with
            ``model.lm.gradient_checkpointing``, each block's input (what checkpointing keeps) instead.
        optimizer_offload: keep the optimizer state (AdamW's moments) in host memory between steps; the step streams
            it through the device in buckets of ``offload_bucket_mb`` while parameters and gradients stay there.
            Not with ``cpu_offload``, which keeps the state on the host already.
        offload_bucket_mb: the most optimizer state on the device at once under ``optimizer_offload``.
        compile: compile each decoder block with ``torch.compile`` (after ``model.lm.gradient_checkpointing``, before
            FSDP2) so the element-wise work around the matrix products (RMSNorm, SwiGLU, rotary, casts) runs as fused
            kernels; the first steps pay the compilation. Not with tensor parallelism (refused at start-up).
        compile_mode: ``torch.compile``'s ``mode``: ``null`` (its default), ``reduce-overhead``, ``max-autotune`` or
            ``max-autotune-no-cudagraphs``; only with ``compile``.
        save_distributed_checkpoint: save sharded (DCP) checkpoints; False gathers a full state dict on rank 0.
            Either is written whole under a hidden name, then renamed into place
            (`rl_lightning.parallel.checkpoint_io`): a kill mid-save leaves the previous checkpoint as it was.
        process_group_backend: ``nccl`` / ``gloo``; default by device.
        timeout: collective timeout.
    """

    def __init__(
        self,
        data_parallel_size: int = 1,
        context_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        replicate_size: int = 1,
        cpu_offload: bool = False,
        mixed_precision: str | None = None,
        reshard_after_forward: bool = True,
        activation_offload: bool = False,
        optimizer_offload: bool = False,
        offload_bucket_mb: int = 256,
        compile: bool = False,
        compile_mode: str | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        sizes = {"data_parallel_size": data_parallel_size, "context_parallel_size": context_parallel_size,
                 "tensor_parallel_size": tensor_parallel_size, "replicate_size": replicate_size}
        errors = [f"strategy.{k} must be an integer >= 1, got {v!r}" for k, v in sizes.items()
                  if not isinstance(v, int) or v < 1]
        if not errors and data_parallel_size % replicate_size:
            errors.append(f"strategy.replicate_size={replicate_size} must divide "
                          f"strategy.data_parallel_size={data_parallel_size}")
        if mixed_precision not in (None, "bf16"):
            errors.append(f"strategy.mixed_precision must be 'bf16' or null, got {mixed_precision!r}")
        errors += _offload_errors(cpu_offload, optimizer_offload, offload_bucket_mb)
        errors += _compile_errors(compile, compile_mode, sizes)
        if errors:
            raise ConfigError("; ".join(errors))
        super().__init__(data_parallel_size * context_parallel_size, tensor_parallel_size,
                         save_distributed_checkpoint, process_group_backend, timeout)
        self.dp_size, self.cp_size, self.tp_size, self.replicate_size = (
            data_parallel_size, context_parallel_size, tensor_parallel_size, replicate_size)
        self.cpu_offload, self.mixed_precision = cpu_offload, mixed_precision
        self.reshard_after_forward = reshard_after_forward
        self.activation_offload, self.optimizer_offload = activation_offload, optimizer_offload
        self.offload_bucket_mb = offload_bucket_mb
        self.compile, self.compile_mode = compile, compile_mode
        self.dp_mesh: Any = None
        self.peer_mesh: Any = None  # context x tensor parallel peers: they train on the same trajectories
        self.cp_mesh: Any = None
        self.tp_mesh: Any = None
        self.fsdp_mesh: Any = None

    @override
    def before_launch(self) -> None:
        # Called while the Trainer is built, in the launching process only: a layout that cannot fit the job stops
        # here, once, before Lightning starts the other processes (setup_environment would run in each of them).
        self._check_layout(self.cluster_environment.world_size())

    @override
    def setup_environment(self) -> None:
        setup_distributed(self)
        self._check_layout(self.world_size)
        self._build_meshes()
        if self.cp_size > 1 and self.root_device.type == "cuda":
            from rl_lightning.attention.ring import flash_attn_status

            flash_attn_status()  # a flash-attn that is installed but broken: its one warning line now, before the model

    @override
    def before_process_group(self) -> None:
        """When every rank is on this host, the default group is made first, on loopback channels only.

        (`rl_lightning.parallel.local_group`: torch's ``env://`` store would listen on every interface.)
        """
        assert self.cluster_environment is not None
        if single_host(self.num_nodes, self.cluster_environment.main_address):
            self.set_world_ranks()
            init_local_group(self.cluster_environment, process_group_backend(self), process_group_timeout(self),
                             self.root_device)

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.optimizer_offload:
            from rl_lightning.parallel.offload import OptimizerStateOffload

            for optimizer in self.optimizers:
                if not hasattr(optimizer, "rl_lightning_state_offload"):
                    OptimizerStateOffload(optimizer, self.offload_bucket_mb << 20)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state as ModelParallelStrategy collects it, made first if the optimizer has none yet.

        An optimizer that has not stepped yet gets its first step's state
        (`rl_lightning.models.optim.materialize_adam_state`): torch would make it by stepping at lr 0, which counts a
        step and shrinks the next real update.
        """
        from rl_lightning.models.optim import materialize_adam_state

        materialize_adam_state(optimizer)
        return super().optimizer_state(optimizer)

    @property
    @override
    def checkpoint_io(self) -> Any:
        """The user's CheckpointIO (``trainer.plugins``), else `AtomicCheckpointIO` (not Lightning's default)."""
        if checkpoint_io_if_set(self) is None:
            set_checkpoint_io(self, AtomicCheckpointIO())
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        set_checkpoint_io(self, io)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Save as ModelParallelStrategy does; a sharded (DCP) folder is written whole under a hidden name first.

        Every rank writes its shards into ``.<name>.partial`` and hashes them; rank 0 adds Lightning's ``meta.pt``,
        lists every file's SHA-256 in ``SHA256SUMS``, then renames the folder into place (`publish_folder`) while
        the other ranks wait.
        """
        if not saves_distributed_checkpoint(self) or storage_options is not None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        path = Path(self.broadcast(str(filepath)))
        staging = path.parent / f".{path.name}.partial"
        if self.global_rank == 0 and staging.exists():  # a killed save's
            shutil.rmtree(staging)
        self.barrier()
        super().save_checkpoint(checkpoint, staging)
        digests = self._gather(folder_digests(staging, own_shards(staging, self.global_rank)))
        if self.global_rank == 0:
            digests.append(folder_digests(staging, list(DCP_FILES)))
            (staging / FOLDER_DIGESTS).write_text("".join(digests))
            publish_folder(staging, path)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load, weights-only unless `weights_only` is False; an untrusted DCP folder is checked first.

        torch's DCP reader unpickles a sharded folder's metadata and non-tensor entries in full, so unless trusted
        the folder is refused first if they hold anything a weights-only read would refuse
        (`rl_lightning.parallel.checkpoint_trust.refuse_untrusted`).
        """
        path = Path(self.broadcast(str(checkpoint_path)))
        if weights_only is not False and path.is_dir():
            refuse_untrusted(path)
        return super().load_checkpoint(path, weights_only=weights_only is not False)

    def _gather(self, text: str) -> list[str]:
        """`text` of every rank, in rank order (this rank's alone in one process)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return [text]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, text)
        return gathered

    def _check_layout(self, world_size: int) -> None:
        product = self.dp_size * self.cp_size * self.tp_size
        if product != world_size:
            raise ConfigError(
                f"strategy sizes data_parallel_size={self.dp_size} x context_parallel_size={self.cp_size} x "
                f"tensor_parallel_size={self.tp_size} = {product}, but the job has {world_size} processes "
                f"(trainer.devices x trainer.num_nodes); make the product equal the world size"
            )

    def _build_meshes(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        shard = self.dp_size // self.replicate_size
        mesh = init_device_mesh(
            self.root_device.type, (self.replicate_size, shard, self.cp_size, self.tp_size),
            mesh_dim_names=("replicate", "shard", "context_parallel", "tensor_parallel"),
        )
        set_device_mesh(self, mesh)
        self.dp_mesh = flatten_mesh(mesh["replicate", "shard"], "data_parallel")
        fsdp_shard = flatten_mesh(mesh["shard", "context_parallel"], "fsdp_shard")
        self.cp_mesh, self.tp_mesh = mesh["context_parallel"], mesh["tensor_parallel"]
        if self.replicate_size > 1:
            with warnings.catch_warnings():  # slicing a flattened dim back out of the root mesh; still supported
                warnings.simplefilter("ignore")
                self.fsdp_mesh = mesh["replicate", "fsdp_shard"]
        else:
            self.fsdp_mesh = fsdp_shard
        self.peer_mesh = flatten_mesh(mesh["context_parallel", "tensor_parallel"], "peers")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.dp_mesh.size(), "rank": self.dp_mesh.get_local_rank()}

    @override
    def backend_when_unset(self) -> str | None:
        if self.cpu_offload and self.root_device.type == "cuda":
            # Offloaded gradients and weights live on the CPU: their norm/gather collectives need a CPU backend.
            return "cuda:nccl,cpu:gloo"
        return None

    @override
    def model_to_device(self) -> None:
        """Move the module to `root_device`; under `cpu_offload` only record it there.

        Offloaded FSDP2 parameters must stay on the CPU, but the compute device is still the root device (FSDP2 moves
        forward inputs there): ``pl_module.device``, which tasks put micro-batches, labels and counts on, must say so.
        """
        if not self.cpu_offload:
            super().model_to_device()
            return
        assert self.model is not None
        record_device(self.model, self.root_device)  # the modules' device records, no tensor moves

    @override
    def teardown(self) -> None:
        super().teardown()
        self.dp_mesh = self.cp_mesh = self.tp_mesh = self.fsdp_mesh = self.peer_mesh = None

    def mp_policy(self) -> Any:
        """FSDP2's mixed precision: for ``bf16``, bf16 parameters and fp32 gradient reduction; else no casting."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.mixed_precision == "bf16":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def offload_policy(self) -> Any:
        """FSDP2's CPU offload policy when `cpu_offload` is set (pinned memory on CUDA), else no offloading."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if self.cpu_offload:
            return CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
        return OffloadPolicy()


def _offload_errors(cpu_offload: bool, optimizer_offload: bool, bucket_mb: Any) -> list[str]:
    """What the offload settings cannot be combined with (activation offload with checkpointing: `parallelize`)."""
    errors = []
    if optimizer_offload and cpu_offload:
        errors.append("strategy.optimizer_offload=true with strategy.cpu_offload=true: cpu_offload keeps the optimizer "
                      "state on the CPU already; set one of them")
    if not isinstance(bucket_mb, int) or bucket_mb < 1:
        errors.append(f"strategy.offload_bucket_mb must be an integer >= 1, got {bucket_mb!r}")
    return errors


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # refused under FSDP2 until measured (issue 39.6)


def _compile_errors(compile: Any, mode: Any, sizes: dict[str, Any]) -> list[str]:
    """What ``compile`` cannot be combined with (measured on CPU, tests/parallel/test_compile.py)."""
    if compile not in (True, False):
        return [f"strategy.compile must be true or false, got {compile!r}"]
    if mode not in COMPILE_MODES:
        return [f"strategy.compile_mode must be one of {', '.join(map(str, COMPILE_MODES[1:]))} or null, got {mode!r}"]
    if not compile:
        return [] if mode is None else [f"strategy.compile_mode={mode!r} needs strategy.compile=true; set it or drop "
                                        "compile_mode"]
    tp = sizes["tensor_parallel_size"]
    errors = []
    if mode in CUDA_GRAPH_MODES:
        errors.append(f"strategy.compile_mode={mode!r} records CUDA graphs, which FSDP2's parameter re-gathers and "
                      "packed micro-batches of varying length re-record at every step (not measured to pay off); use "
                      "compile_mode: max-autotune-no-cudagraphs or default")
    if isinstance(tp, int) and tp > 1:  # context parallelism, LoRA and both offloads train as eager does
        errors.append(f"strategy.compile=true with strategy.tensor_parallel_size={tp}: inductor fails to compile "
                      "the backward of the tensor-parallel (DTensor) projections; set compile: false or "
                      "tensor_parallel_size: 1")
    return errors
