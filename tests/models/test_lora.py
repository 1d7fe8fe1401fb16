"""LoRA (`rl_lightning.models.lora`) on SFT, DPO and PPO: only adapter weights move (the base stays bitwise equal), the
reference is the base model with no second copy, FSDP2 over two gloo ranks equals one process, a checkpoint resumes
exactly, and the exports (merged and adapter folder) give the trained model's logits."""

import math

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, TINY_MODEL, assert_close
from helpers import fit, ppo_task, prompts, run_on_cpu_ranks

from rl_lightning.data import PreferenceDataModule, SFTDataModule
from rl_lightning.errors import ConfigError
from rl_lightning.models.config import LMConfig
from rl_lightning.models.lora import AdaptersDisabled, LoRAConfig, base_model, parameter_counts
from rl_lightning.models.optim import OptimConfig
from rl_lightning.tasks import DPO, SFT

LORA = LoRAConfig(r=4, alpha=8.0)
OPTIM = OptimConfig(lr=1e-2, lr_schedule="constant", max_grad_norm=1.0)


def _sft_data(batch_size=4):
    return SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=batch_size,
                         shuffle=False, max_length=96, max_length_per_device=256)


def _pairs():
    return PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4,
                                shuffle=False, max_length=128, max_length_per_device=512)


def _fresh_base():
    from rl_lightning.models.loading import load_causal_lm

    return load_causal_lm(str(TINY_MODEL))


def assert_only_adapters_moved(model):
    """Every base weight bitwise equal to a freshly loaded model's; every adapter B (zero at start) moved."""
    fresh = _fresh_base().state_dict()
    adapters = 0
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            adapters += 1
            if "lora_B" in name:
                assert tensor.abs().sum() > 0, name
            continue
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(tensor, fresh[key]), name
    assert adapters > 0
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())


@pytest.fixture(scope="module")
def sft_run():
    L.seed_everything(0)
    model = SFT(LMConfig(str(TINY_MODEL), optim=OPTIM, lora=LORA))
    fit(model, _sft_data(), 3)
    return model


def test_sft_trains_only_adapters(sft_run):
    assert_only_adapters_moved(sft_run.model)
    trainable, total = parameter_counts(sft_run.model)
    optimizer_params = sum(p.numel() for g in sft_run.trainer.optimizers[0].param_groups for p in g["params"])
    assert optimizer_params == trainable
    # tiny-qwen2: 2 blocks, hidden 64, 4 heads of 16, 2 KV heads, MLP 128; r=4: r * (in + out) per projection
    config = base_model(sft_run.model).config
    h, kv, mlp, layers = config.hidden_size, config.num_key_value_heads * config.head_dim, config.intermediate_size, \
        config.num_hidden_layers
    per_layer = 4 * ((h + h) * 2 + (h + kv) * 2 + 2 * (h + mlp) + (mlp + h))
    assert trainable == layers * per_layer, (trainable, total)


def test_gradient_checkpointing_with_a_frozen_base_gives_the_same_adapters(sft_run):
    """Non-reentrant checkpointing still reaches the adapters when no input of a block requires grad (frozen
    embeddings): the same 3 steps give bitwise the same adapter weights."""
    L.seed_everything(0)
    checkpointed = SFT(LMConfig(str(TINY_MODEL), optim=OPTIM, lora=LORA, gradient_checkpointing=True))
    fit(checkpointed, _sft_data(), 3)
    assert base_model(checkpointed.model).model.gradient_checkpointing
    expected = dict(sft_run.model.named_parameters())
    for name, param in checkpointed.model.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_exports_merged_and_adapter_give_the_trained_logits(sft_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rl_lightning.tracking.export import export_hf

    export_hf(sft_run.model, str(TINY_MODEL), tmp_path)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL), tmp_path / "adapter").eval()
    assert (tmp_path / "adapter" / "adapter_config.json").exists() and not (tmp_path / "adapter" / "config.json").exists()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = sft_run.model.eval()(input_ids=ids).logits
        sft_run.model.train()
        assert_close(adapter(input_ids=ids).logits, trained, atol=1e-6)
        # merging adds B A into W: float32 rounding of the sum differs from the unmerged W x + B (A x)
        assert_close(merged(input_ids=ids).logits, trained, atol=1e-5)
        assert (merged(input_ids=ids).logits - _fresh_base().eval()(input_ids=ids).logits).abs().max() > 1e-3
    assert_only_adapters_moved(sft_run.model)  # exporting (merging a copy) left the training weights alone


def test_dpo_reference_is_the_base_without_a_second_copy():
    """The first step's loss is exactly ln 2 (policy = reference at step 0, LoRA's B = 0); after training, the
    reference (adapters disabled) gives a freshly loaded base model's log-probabilities."""
    from rl_lightning.parallel.reductions import local_micro_batch, process_groups
    from rl_lightning.tasks.dpo import completion_logprobs

    L.seed_everything(0)
    model = DPO(LMConfig(str(TINY_MODEL), optim=OPTIM, lora=LORA))
    data = _pairs()
    trainer = fit(model, data, 1)
    assert_close(trainer.callback_metrics["train/loss"], torch.tensor(math.log(2)), atol=1e-6)
    trainer = fit(model, data, 2)  # model already loaded: two more steps
    assert isinstance(model._reference, AdaptersDisabled) and model._reference.model is model.model
    assert_only_adapters_moved(model.model)
    batch = next(iter(data.train_dataloader()))
    fresh = _fresh_base()
    with torch.no_grad():
        for mb in batch["micro_batches"]:
            local = local_micro_batch(process_groups(trainer), mb)
            reference = model.reference_logprobs([mb])[0]
            assert_close(reference, completion_logprobs(fresh, local), atol=1e-6)
            assert (completion_logprobs(model.model, local) - reference).abs().max() > 1e-3  # the policy moved


def test_ppo_reference_is_the_base_and_only_adapters_move(parity_env):
    model = ppo_task(parity_env, max_rollouts=2, kl={"coef": 0.1}, lm={"lora": {"r": 4, "alpha": 8.0}})
    L.seed_everything(0)
    trainer = fit(model, prompts(), -1)
    assert isinstance(model._reference, AdaptersDisabled)
    assert_only_adapters_moved(model.model)
    assert float(trainer.callback_metrics["train/kl"]) > 0  # the policy left the reference
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(model._reference(input_ids=ids).logits, _fresh_base()(input_ids=ids).logits, atol=1e-6)


def test_reward_model_trains_adapters_and_head_and_its_export_scores_like_training(tmp_path):
    """Backbone frozen (adapters only), the scalar head trained in full; the merged export, loaded with
    ``AutoModelForSequenceClassification``, gives the rewards training reads."""
    from transformers import AutoModelForSequenceClassification

    from rl_lightning.data.steps import pack
    from rl_lightning.models.loading import load_reward_model
    from rl_lightning.tasks import RewardModel
    from rl_lightning.tasks.reward import sequence_rewards
    from rl_lightning.tracking.export import export_hf

    L.seed_everything(0)
    module = RewardModel(LMConfig(str(TINY_MODEL), optim=OPTIM, lora=LORA))
    data = _pairs()
    fit(module, data, 2)
    fresh, params = load_reward_model(str(TINY_MODEL)).state_dict(), dict(module.model.named_parameters())
    for name, param in params.items():
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if "lora_" in name or "modules_to_save" in name:
            assert param.requires_grad, name
            if "modules_to_save" in name:  # the trained head left the frozen copy PEFT keeps of the initial one
                assert not torch.equal(param, params[name.replace("modules_to_save.default", "original_module")])
            if "lora_B" in name:
                assert param.abs().sum() > 0, name
        else:
            assert not param.requires_grad, name
            assert "original_module" in name or torch.equal(param, fresh[key]), name
    export_hf(module.model, str(TINY_MODEL), tmp_path)
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    pair = data.units["train"][0]
    with torch.no_grad():
        training = sequence_rewards(module.model.eval(), pack([pair.chosen, pair.rejected], 0))
        for sequence, reward in zip((pair.chosen, pair.rejected), training, strict=True):
            assert_close(exported(input_ids=torch.tensor([sequence.input_ids])).logits[0, 0], reward, atol=1e-5)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"r": 0}, "model.lm.lora.r must be >= 1, got 0"),
    ({"alpha": -1.0}, "model.lm.lora.alpha must be > 0"),
    ({"dropout": 1.0}, r"model.lm.lora.dropout must be in \[0, 1\)"),
    ({"target_modules": "attention"}, "model.lm.lora.target_modules must be a list of module names or 'all-linear'"),
])
def test_bad_lora_config_is_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LoRAConfig(**kwargs)


def test_tensor_parallel_is_refused_in_one_line():
    from rl_lightning.models.lora import check_lora_strategy
    from rl_lightning.parallel import ParallelStrategy

    check_lora_strategy(ParallelStrategy(data_parallel_size=2, context_parallel_size=2))
    with pytest.raises(ConfigError, match="^model.lm.lora does not support strategy.tensor_parallel_size=2 "):
        check_lora_strategy(ParallelStrategy(tensor_parallel_size=2))


def test_unknown_target_and_lora_with_a_separate_reference_fail_at_start_up():
    with pytest.raises(ConfigError, match=r"model.lm.lora.target_modules=\['nope'\]"):
        fit(SFT(LMConfig(str(TINY_MODEL), lora=LoRAConfig(target_modules=("nope",)))), _sft_data(), 1)
    with pytest.raises(ConfigError, match="model.ref_model_name"):
        DPO(LMConfig(str(TINY_MODEL), lora=LORA), ref_model_name="other")


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def _sft_fit(dp, root, ckpt_path=None, export=None):
    """4 SFT steps with LoRA on 8 rows per step (`dp` FSDP2 ranks), checkpointing at step 2 (or resuming from it)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from rl_lightning.parallel import ParallelStrategy
    from rl_lightning.tracking.export import export_hf

    L.seed_everything(0)
    recorder = LossRecorder()
    callbacks = [recorder]
    if ckpt_path is None:
        callbacks.append(ModelCheckpoint(dirpath=f"{root}/ckpt", every_n_train_steps=2, save_top_k=-1))
    model = SFT(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-2, warmup_steps=1, lr_schedule="cosine"), lora=LORA))
    trainer = L.Trainer(accelerator="cpu", devices=dp, max_steps=4, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, default_root_dir=str(root),
                        strategy=ParallelStrategy(data_parallel_size=dp) if dp > 1 else "auto")
    trainer.fit(model, datamodule=_sft_data(8 // dp), ckpt_path=ckpt_path)
    if export is not None:
        export_hf(model.model, str(TINY_MODEL), export, trainer.is_global_zero)
    return model, recorder.losses


def _fsdp_worker(rank, root, ckpt_path, out_path):
    model, losses = _sft_fit(2, root, ckpt_path, export=root / ("export" if ckpt_path is None else "resumed"))
    if rank == 0:
        sharded = any(hasattr(p, "device_mesh") for n, p in model.model.named_parameters() if "lora_" in n)
        torch.save({"losses": losses, "sharded": sharded}, out_path)


@pytest.mark.slow
def test_fsdp2_two_ranks_and_resume_equal_one_process(tmp_path):
    """FSDP2 over 2 gloo ranks (frozen base and adapters sharded in the same units) gives the single-process losses
    and exported weights; resuming the step-2 distributed checkpoint in a fresh process group gives the
    uninterrupted run's steps 3-4 and the same final weights."""
    from transformers import AutoModelForCausalLM

    run_on_cpu_ranks(_fsdp_worker, 2, tmp_path, None, tmp_path / "full.pt")
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert checkpoint.is_dir() and any(checkpoint.glob("*.distcp"))
    run_on_cpu_ranks(_fsdp_worker, 2, tmp_path, str(checkpoint), tmp_path / "resumed.pt")
    single, single_losses = _sft_fit(1, tmp_path / "single")
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert full["sharded"] and len(full["losses"]) == 4 and len(resumed["losses"]) == 2
    # gloo sums the 2 ranks' gradients in another order than one process's micro-batch loop: float32 rounding
    assert max(abs(a - b) for a, b in zip(full["losses"], single_losses, strict=True)) < 1e-5
    assert resumed["losses"] == full["losses"][2:]
    assert_only_adapters_moved(single.model)
    trained = {n.removeprefix("base_model.model.").replace(".base_layer.", "."): p for n, p in
               single.model.merge_and_unload().state_dict().items()}
    for folder in ("export", "resumed"):
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / folder).state_dict()
        for name, tensor in exported.items():
            torch.testing.assert_close(tensor, trained[name], atol=1e-5, rtol=0)  # see the losses' tolerance


def _adapter_config(run_folder):
    import json

    return json.loads((run_folder / "export" / "adapter" / "adapter_config.json").read_text())


def _latest(workdir, task):
    return (workdir / "outputs" / task / "latest").resolve()


@pytest.mark.slow
def test_sft_dpo_and_grpo_recipes_run_with_lora_from_the_command_line_and_yaml(workdir, capsys, monkeypatch):
    """``--model.lm.lora.r 8`` on the command line (SFT, then resumed with ``--ckpt_path last``), a ``lora`` group in a
    YAML overlay (DPO) and GRPO with the hf engine: each run exports the merged model and the adapter folder with the
    configured adapters."""
    from transformers import AutoModelForCausalLM

    from rl_lightning.cli.main import main

    monkeypatch.setattr("sys.argv", ["rl_lightning"])
    quiet = ["--trainer.limit_val_batches", "0"]
    main(["fit", "--config", "recipes/sft.yaml", "--model.lm.lora.r", "8", "--trainer.max_steps", "2", *quiet])
    main(["fit", "--config", "recipes/sft.yaml", "--model.lm.lora.r", "8", "--trainer.max_steps", "3", "--ckpt_path",
          "last", *quiet])
    assert "sft r=8 finished: 3 steps" in capsys.readouterr().out  # named after the recipe and --model.lm.lora.r
    sft = _latest(workdir, "sft")
    assert _adapter_config(sft)["r"] == 8 and AutoModelForCausalLM.from_pretrained(sft / "export") is not None

    overlay = workdir / "dpo-lora.yaml"  # the run folder is named after its config files: dpo+dpo-lora
    overlay.write_text("model:\n  init_args:\n    lm:\n      lora: {r: 4, alpha: 4, target_modules: all-linear}\n")
    main(["fit", "--config", "recipes/dpo.yaml", "--config", str(overlay), "--trainer.max_steps", "2",
          "--data.batch_size", "4", *quiet])
    config = _adapter_config(_latest(workdir, "dpo+dpo-lora"))
    targets = {name.split(".")[-1] for name in config["target_modules"]}  # PEFT writes all-linear out as paths
    assert config["r"] == 4 and config["lora_alpha"] == 4 and targets == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                            "gate_proj", "up_proj", "down_proj"}

    main(["fit", "--config", "recipes/grpo.yaml", "--model.lm.lora.r", "4", "--model.rollout.engine", "hf",
          "--model.max_rollouts", "1", "--model.rollout.responses_per_prompt", "4", "--model.rollout.max_new_tokens",
          "8", "--data.batch_size", "2", "--trainer.num_sanity_val_steps", "0", "--trainer.logger", "false", *quiet])
    assert "PPO finished: 1 rollout in" in capsys.readouterr().out
    assert _adapter_config(_latest(workdir, "run"))["r"] == 4  # no logger: the run is named "run"
