"""The `RolloutCallback`: the PPO task's rollouts, as its ``model.rollout`` settings (`RolloutConfig`) say.

Before each training batch, the callback turns the batch's prompts into scored trajectories: the engine samples
``responses_per_prompt`` completions per prompt (multi-turn through the environment's ``interact`` when ``max_turns``
> 1), the environment's ``reward_fn`` scores them, and a `Rollout` is attached to the batch (``batch["rollout"]``) for
the task's ``training_step``.

The PPO task owns its rollout: it builds the callback from its ``rollout`` argument group and hands it to the Trainer
through ``configure_callbacks``, so ``--model.rollout.env_path my_env.py`` works from the command line and the
sampling temperature the task recomputes log-probabilities at is the one the engine sampled at. The callback reads
the task's policy interface only (`PolicyTask`): ``model``, ``tokenizer``, ``model_name``, ``rollouts`` (completed
rollouts) and ``device``. `RolloutConfig` lives in `rl_lightning.rollout.config` and is importable from here too.

When the engine samples relative to the updates is the scheduling policy's (`rl_lightning.rollout.schedule`:
synchronous, one-step-off, in-flight), chosen from the config by `scheduling_policy`; the policy composes the
callback's public steps (`prepare_engine`, `sample`, `finish`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol, cast

import lightning as L
import torch
from typing_extensions import override

from rl_lightning.data.datamodule import run_seed
from rl_lightning.engines.lockstep import Lockstep
from rl_lightning.engines.protocol import SamplingParams, derive_seed
from rl_lightning.engines.weights import WeightSync
from rl_lightning.envs.environment import load_environment
from rl_lightning.envs.workers import start_pool
from rl_lightning.errors import ConfigError
from rl_lightning.memory.phases import release_host_memory
from rl_lightning.parallel.reductions import Groups, data_parallel_sum, process_groups
from rl_lightning.rollout.config import DAPOConfig, RolloutConfig
from rl_lightning.rollout.engine_setup import (
    build_engine,
    context_limit,
    engine_process_placement,
    prepare_engine,
)
from rl_lightning.rollout.inflight import InFlight
from rl_lightning.rollout.pareto_archive import ParetoArchive
from rl_lightning.rollout.peer_share import check_identical, is_leader, share_from_leader, trajectory_digest
from rl_lightning.rollout.refill import data_parallel_ranks, refill
from rl_lightning.rollout.replay import ReplayDump, run_manifest
from rl_lightning.rollout.schedule import OneStepOff, SchedulingPolicy, Synchronous
from rl_lightning.rollout.shaping import shape, shaping_errors
from rl_lightning.rollout.trajectory import Rollout, Trajectory, rollout

__all__ = ["PolicyTask", "RolloutCallback", "RolloutConfig", "scheduling_policy"]


def scheduling_policy(config: RolloutConfig) -> SchedulingPolicy:
    """The scheduling policy `config` asks for.

    In-flight with ``inflight_segment_tokens``, one-step-off with ``async_steps: 1`` (a replay samples nothing:
    synchronous), else synchronous.
    """
    if not config.async_steps or config.replay is not None:
        return Synchronous()
    if config.inflight_segment_tokens is not None:
        return InFlight(config.inflight_segment_tokens)
    return OneStepOff()

# Domains of the run's seed besides training rollouts (whose keys are (rollout, round, row)): validation requests
# (keyed by row alone, so successive validations compare the same draws) and the refill prompt draws.
VALIDATION, REFILL = -1, -2


class PolicyTask(Protocol):
    """What the callback reads of its task (the PPO LightningModule)."""

    model: Any  # the policy: a transformers causal LM, possibly LoRA-wrapped and sharded
    tokenizer: Any  # its transformers tokenizer
    model_name: str  # where the policy was loaded from (the vLLM engine loads it too)
    rollouts: int  # completed rollouts: the sampling seeds' step
    device: torch.device

    def run_rollouts(self) -> int:
        """The rollouts this fit takes."""
        ...

def _task(pl_module: L.LightningModule) -> PolicyTask:
    """`pl_module` seen through the interface the callback needs (the task that built the callback)."""
    return cast(PolicyTask, pl_module)


def _datamodule(trainer: L.Trainer) -> Any:
    """The fit's DataModule (Lightning's data connector sets ``trainer.datamodule``; its Trainer leaves it out)."""
    return getattr(trainer, "datamodule", None)


class RolloutCallback(L.Callback):
    """Generate and score trajectories for every training (and validation) batch of prompts, as `config` says."""

    groups: Groups = Groups()  # this rank's parallel layout: `setup` builds it from the strategy's device mesh

    def __init__(self, config: RolloutConfig, dapo: DAPOConfig | None = None) -> None:
        self.config = c = config
        self.dapo = DAPOConfig() if dapo is None else dapo  # model.dapo: dynamic sampling, overlong shaping
        self.env = load_environment(c.env_path, c.on_error, weights=c.reward_weights, combination=c.reward_combination,
                                    ideal=c.reward_ideal, reward_model=c.reward_model, max_tool_chars=c.max_tool_chars)
        if c.max_turns > 1 and self.env.interact is None:
            raise ConfigError(f"model.rollout.max_turns={c.max_turns} needs interact(messages) in {c.env_path}")
        if errors := shaping_errors(c, self.env.component_names):
            raise ConfigError("; ".join(errors))
        self.weight_sync: WeightSync | None = None
        self.adapter_sync = False  # set with the engine: LoRA adapter-only weight sync (vllm)
        self.engine: Any = None
        self.lockstep: Lockstep | None = None  # an on-policy engine (hf), or a shared engine process, on several ranks
        self.peers: Any = None  # the context x tensor parallel group whose first rank samples for it
        self.engine_devices: list[int] | None = None  # an engine of its own process on GPU (checked in `setup`)
        self.refills = 0
        self.seed = 0  # the run's seed (``seed_everything``): the DataModule's, taken in `setup`
        self.max_model_len: int | None = None  # multi-turn: a conversation ends before it outgrows it
        self.schedule: SchedulingPolicy = scheduling_policy(c)  # when the engine samples (sync, one-step-off, ...)
        self.replay: ReplayDump | None = None  # model.rollout.replay: the dumped rollouts (read in `setup`)
        self.pareto: ParetoArchive | None = None if c.pareto_archive_size is None else ParetoArchive(
            self.env.component_names, c.pareto_archive_size, c.pareto_reference)

    # ------------------------------------------------------------------------------------------- start and end

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Start-up checks, before any model loads.

        Every prompt's answer is of a type ``reward_fn`` reads; an engine of its own process (``vllm_process``) has
        GPUs of its own and a layout it serves.
        """
        c = self.config
        self.groups = process_groups(trainer)  # the parallel layout, for the rollout's reductions
        self.seed = run_seed(_datamodule(trainer))
        prompts = getattr(_datamodule(trainer), "prompts", {})  # answers of the type reward_fn reads, or one line
        self.env.check_answers(p for loaded in (prompts.values() if isinstance(prompts, dict) else []) for p in loaded)
        if c.replay is not None and stage == "fit":  # refuses a dump of another model or rollout shape at once
            self.replay = ReplayDump.start(trainer, _task(pl_module), c, self.dapo.filter_range)
        if not c.engine_spec.own_process or stage != "fit" or c.replay is not None:
            return
        self.engine_devices = engine_process_placement(c, trainer)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Start the reward workers and the reward model, and build the engine (once per process but on-policy ones)."""
        c, task = self.config, _task(pl_module)
        if self.replay is not None:  # no engine, no reward workers (the rollouts are checked in `on_train_start`)
            return
        self.max_model_len = context_limit(c, task.model.config, _datamodule(trainer))
        if self.env.scorer is None:
            self.env.scorer = start_pool(self.env.path, c.reward_workers, c.reward_timeout_s, trainer.num_devices,
                                         c.interact_timeout_s, c.worker_env)
        if self.env.reward_model is not None:  # the server answers (or the RM folder loads) before any training
            self.env.reward_model.start(task.device)
        self.schedule.start(self.groups.device)  # the device its engine thread selects (if it has one)
        peer_mesh = getattr(trainer.strategy, "peer_mesh", None)
        self.peers = peer_mesh.get_group() if peer_mesh is not None and peer_mesh.size() > 1 else None
        if c.engine_spec.on_policy:  # built per fit: it samples with this fit's policy module
            self.engine, self.adapter_sync = build_engine(c, trainer, task, self.groups.device, None)
            # its forwards may be collectives: every rank generates equally often
            self.lockstep = Lockstep(self.groups.device, task.tokenizer.pad_token_id) if trainer.world_size > 1 else None
            return
        if self.engine is None:  # vLLM initialises once per process: a later fit reuses the engine
            engine, self.adapter_sync = build_engine(c, trainer, task, self.groups.device, self.engine_devices)
            self.engine = self.schedule.wrap_engine(engine)
        if c.engine_spec.own_process and trainer.world_size > 1:  # one shared engine: every rank generates as often
            self.lockstep = Lockstep(torch.device("cpu"), task.tokenizer.pad_token_id, group=self.engine.group)
        # a fresh fit always pushes its weights first (in adapter mode: the adapter; the engine keeps the base)
        self.weight_sync = WeightSync(getattr(c.engine_settings, "weight_bucket_mb", 512) << 20,
                                      adapter=self.adapter_sync)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A replay: refuse a dump lacking a rollout the run needs (from a resumed checkpoint's on)."""
        task = _task(pl_module)
        if self.replay is not None:
            self.replay.check(run_manifest(trainer, task, self.config, self.dapo.filter_range),
                              range(task.rollouts, task.run_rollouts()),
                              self.dapo.filter_range is not None)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Drop any in-flight rollout and shut the reward workers down."""
        self.schedule.close()  # an in-flight rollout is dropped (it still uses the reward workers)
        if self.env.scorer is not None:  # the reward workers
            self.env.scorer.close()
            self.env.scorer = None

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A failed fit tears down as a finished one does."""
        self.teardown(trainer, pl_module, "fit")

    def prepare_engine(self, trainer: L.Trainer, task: PolicyTask) -> None:
        """Push the policy's weights into the engine (skipped without an optimizer step since the last push), wake it."""
        prepare_engine(self.engine, self.weight_sync, task.model, trainer.global_step)

    # --------------------------------------------------------------------------------------------- training

    def sampling_params(self, step: int, prompts: list, stop_id: int, refill_round: int = 0) -> SamplingParams:
        """The training sampling parameters of `prompts`, seeded per prompt.

        A prompt's seed is ``derive_seed(run seed, rollout, refill round, its dataset row)`` (the engine derives each
        sample's from it, the rollout each turn's), never the rank: a prompt samples the same completions whatever
        the parallel layout (dp=2 == dp=1), and no two requests of a run share a random stream.

        Args:
            step: the rollout's index.
            prompts: the prompts (each with its dataset ``index``).
            stop_id: the token that ends a completion.
            refill_round: the dynamic-sampling round (0: the batch's own prompts).

        Returns:
            The parameters of one generate call.
        """
        c = self.config
        seeds = [derive_seed(self.seed, step, refill_round, p.index) for p in prompts]
        return SamplingParams(n=c.responses_per_prompt, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                              max_new_tokens=c.max_new_tokens, stop_token_ids=[stop_id], seeds=seeds)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict, batch_idx: int
                             ) -> None:
        """Sample and score the batch's rollout, when the scheduling policy says (read ahead with ``async_steps: 1``).

        A rollout an earlier callback attached (distillation's dataset completions) is kept: nothing is sampled.
        """
        if "rollout" in batch:
            return
        task = _task(pl_module)
        if self.replay is not None:  # the dumped rollout: nothing is sampled or scored
            batch["rollout"] = rollout = self.replay.rollout(
                task.rollouts, None if self.dapo.filter_range is not None else batch["prompts"])
            self._observe(trainer, task, rollout.trajectories, rollout.metrics)
            return
        batch["rollout"] = self.schedule.rollout(self, trainer, task, batch, batch_idx)

    def sample(self, trainer: L.Trainer, task: PolicyTask, prompts: list, index: int
               ) -> tuple[list[Trajectory], dict[str, float]]:
        """Rollout `index` of `prompts`, scored (and refilled).

        No collective when the policy generates in the background, so it may run on the engine thread.

        Returns:
            The trajectories and the rollout's metrics (timings, the environment's counters).
        """
        if self.peers is not None and self.lockstep is None and not is_leader(self.peers):
            return [], {}  # the group leader samples for its peers (`finish` shares it); a lockstep engine needs all
        start, self.env.reward_seconds = time.perf_counter(), 0.0
        params = self.sampling_params(index, prompts, task.tokenizer.eos_token_id)
        trajectories = self._generate(prompts, task.tokenizer, params)
        if self.dapo.filter_range is not None:
            trajectories = self._refill(trainer, task, prompts, trajectories, index, self.dapo.filter_range)
        env = self.env  # interact counts (since the start) are logged once non-zero
        tools = {"rollout/interact_timeouts": env.interact_timeouts, "rollout/interact_failures": env.interact_failures,
                 "rollout/engine_restarts": getattr(self.engine, "restarts", 0),  # an engine process
                 "rollout/reward_model_failures": getattr(env.reward_model, "failed_requests", 0),  # served RM
                 "rollout/tool_truncations": env.tool_truncations, "rollout/overlong_conversations":
                     env.overlong_conversations}
        return trajectories, {"rollout/generate_s": time.perf_counter() - start,  # sampling, scoring and refills
                              "rollout/reward_s": env.reward_seconds,  # scoring alone
                              "rollout/reward_timeouts": float(env.timeouts),  # since the start
                              **{k: float(v) for k, v in tools.items() if v}}

    def finish(self, trainer: L.Trainer, task: PolicyTask, trajectories: list[Trajectory],
               metrics: dict[str, float]) -> Rollout:
        """The `Rollout` the trainer takes: `metrics` with the weight push's, the archive's and the curriculum's.

        Context/tensor-parallel peers take their group leader's rollout (`rl_lightning.rollout.peer_share`) and
        check once per rollout that they hold the same trajectories.
        """
        if self.peers is not None:
            shared = (trajectories, metrics) if is_leader(self.peers) else None
            trajectories, metrics = share_from_leader(shared, self.peers)
            check_identical(trajectory_digest(trajectories), self.peers, task.rollouts)
        if self.weight_sync is not None:
            metrics["rollout/weight_sync_s"] = self.weight_sync.seconds  # 0: skipped (no optimizer step)
            metrics["rollout/weight_sync_mb"] = self.weight_sync.stats.bytes / 2**20  # adapter sync: the adapter's
        self._observe(trainer, task, trajectories, metrics)
        return Rollout(trajectories, self.config.responses_per_prompt, self.env.component_names, self.env.failures,
                       self.refills, metrics)

    def _observe(self, trainer: L.Trainer, task: PolicyTask, trajectories: list[Trajectory],
                 metrics: dict[str, float]) -> None:
        """What a rollout, sampled or replayed, feeds: the Pareto archive, the data curriculum (into `metrics`)."""
        if self.pareto is not None:
            metrics.update(self._track_pareto(trainer, task, trajectories))
        curriculum = getattr(_datamodule(trainer), "curriculum", None)
        if curriculum is not None:  # data.curriculum: each prompt's pass rate decides what the next rollouts draw
            metrics.update(curriculum.observe(self.groups, [t.prompt.index for t in trajectories],
                                              [t.reward for t in trajectories]))

    def _track_pareto(self, trainer: L.Trainer, task: PolicyTask, trajectories: list[Trajectory]
                      ) -> dict[str, float]:
        """Offer this rollout's global component means to the Pareto archive and return its metrics.

        Rank 0 rewrites the MLflow table when the archive changed. Every rank runs the same all-reduce and so holds
        the same archive.
        """
        pareto = self.pareto
        if pareto is None:
            return {}
        names = pareto.names
        per_rank = torch.tensor([float(len(trajectories)), *(sum(t.reward_components[n] for t in trajectories)
                                                              for n in names)], dtype=torch.float64,
                                device=self.groups.device)
        count, *sums = data_parallel_sum(self.groups, per_rank).tolist()
        if count > 0 and pareto.add([s / count for s in sums], task.rollouts + 1, trainer.global_step):
            if trainer.is_global_zero:
                from lightning.pytorch.loggers import MLFlowLogger

                pareto.log_to([lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)])
        return pareto.metrics()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Give the heap the update freed (activations, logits) back to the system before the next rollout."""
        release_host_memory()

    @override
    def state_dict(self) -> dict[str, Any]:
        """The Pareto archive, if one is kept; the scheduling policy's state (every rank's in-flight rollout)."""
        state: dict[str, Any] = {} if self.pareto is None else {"pareto": self.pareto.state_dict()}
        return {**state, **self.schedule.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict`'s archive and this rank's in-flight rollout."""
        if self.pareto is not None and "pareto" in state_dict:
            self.pareto.load_state_dict(state_dict["pareto"])
        self.schedule.load_state_dict(state_dict)

    def validation_params(self, prompts: list, stop_id: int) -> SamplingParams:
        """The validation sampling parameters of `prompts`: seeded by row alone, the same at every validation."""
        c = self.config
        sampled = c.val_temperature > 0
        return SamplingParams(n=c.val_responses_per_prompt, temperature=c.val_temperature,
                              top_p=c.top_p if sampled else 1.0, top_k=c.top_k if sampled else 0,
                              max_new_tokens=c.max_new_tokens, stop_token_ids=[stop_id],
                              seeds=[derive_seed(self.seed, VALIDATION, p.index) for p in prompts])

    @override
    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        """Held-out prompts: `val_responses_per_prompt` completions each (multi-turn as in training), scored."""
        c, task = self.config, _task(pl_module)
        params = self.validation_params(batch["prompts"], task.tokenizer.eos_token_id)

        def validate() -> list[Trajectory]:  # where the policy's engine calls run, once no rollout uses the engine
            self.prepare_engine(trainer, task)
            trajectories = rollout(self.engine, batch["prompts"], self.env, task.tokenizer, params, c.max_turns,
                                   self.lockstep, self.max_model_len)
            self.engine.sleep()
            return trajectories

        batch["rollout"] = Rollout(self.schedule.call(validate), c.val_responses_per_prompt, self.env.component_names,
                                   self.env.failures, self.refills)

    def _generate(self, prompts: list, tokenizer: Any, params: SamplingParams) -> list[Trajectory]:
        c = self.config
        trajectories = rollout(self.engine, prompts, self.env, tokenizer, params, c.max_turns, self.lockstep,
                               self.max_model_len)
        shape(trajectories, c, self.dapo, params.n)
        return trajectories

    def _refill(self, trainer: L.Trainer, task: PolicyTask, prompts: list, trajectories: list[Trajectory],
                index: int, filter_range: tuple[float, float]) -> list[Trajectory]:
        """DAPO dynamic sampling, decided over the data-parallel ranks (`rl_lightning.rollout.refill`)."""
        c = self.config

        def generate(extra: list, refill_round: int) -> list[Trajectory]:
            params = self.sampling_params(index, extra, task.tokenizer.eos_token_id, refill_round)
            return self._generate(extra, task.tokenizer, params)

        ranks = data_parallel_ranks(self.groups, collectives=not self.schedule.background)
        kept, rounds = refill(generate, prompts, trajectories, _datamodule(trainer).prompts["train"],
                              c.responses_per_prompt, filter_range, self.dapo.max_refill_rounds,
                              derive_seed(self.seed, REFILL, index), ranks)
        self.refills += rounds
        return kept
