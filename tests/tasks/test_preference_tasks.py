"""RM and DPO in-process: packing, micro-batch splits and data parallelism leave loss and gradients unchanged; the
losses match a one-by-one reference computation; the RM reads rewards where Hugging Face pools (also when EOS pads)
and its export scores like training did."""

import math
import os

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, TINY_MODEL, assert_close
from helpers import GradientRecorder, assert_same_grads, fit, run_on_cpu_ranks

from rl_lightning.data import PreferenceDataModule
from rl_lightning.data.steps import pack
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.errors import ConfigError
from rl_lightning.models.config import LMConfig
from rl_lightning.models.optim import OptimConfig
from rl_lightning.tasks import DPO, RewardModel
from rl_lightning.tasks.reward import sequence_rewards

TASKS = {"rm": RewardModel, "dpo": DPO}


def fit_pairs(task, max_steps=1, data_kwargs=None, model_kwargs=None, callbacks=(), **trainer_kwargs):
    L.seed_everything(0)
    data_kwargs = {"batch_size": 8, "shuffle": False, "max_length": 128, **(data_kwargs or {})}
    data = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), tokenizer_name=str(TINY_MODEL), **data_kwargs)
    optim = OptimConfig(lr=1e-3, lr_schedule="constant", max_grad_norm=0.0)
    model = TASKS[task](LMConfig(str(TINY_MODEL), optim=optim), **(model_kwargs or {}))
    return model, data, fit(model, data, max_steps, callbacks, **trainer_kwargs)


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize(
    ("data_kwargs", "expected_micro_batches"),
    [
        ({"packing": True, "max_length_per_device": 4096}, 1),
        ({"packing": True, "max_length_per_device": 700}, 2),
        ({"packing": True, "max_length_per_device": 400}, 4),
        ({"packing": False, "micro_batch_size": 4}, 2),
    ],
    ids=["packed-1", "packed-2", "packed-4", "padded-2"],
)
def test_packing_and_micro_batch_split_give_the_pair_by_pair_gradient(task, data_kwargs, expected_micro_batches,
                                                                      pair_by_pair_step):
    pair_by_pair, pair_by_pair_loss = pair_by_pair_step(task)
    other = GradientRecorder()
    _, _, t2 = fit_pairs(task, data_kwargs=data_kwargs, callbacks=[other])
    assert pair_by_pair.micro_batches == [8] and other.micro_batches == [expected_micro_batches]
    assert_same_grads(pair_by_pair, other)
    assert_close(t2.callback_metrics["train/loss"], pair_by_pair_loss, atol=1e-5)


@pytest.fixture(scope="module")
def pair_by_pair_step():
    """``task -> (GradientRecorder, loss)`` of the one-pair-per-micro-batch step, fitted once per task for the module
    (the reference every packing and split is compared with; the same fit in each parametrization)."""
    steps = {}

    def step(task):
        if task not in steps:
            recorder = GradientRecorder()
            _, _, trainer = fit_pairs(task, data_kwargs={"packing": False, "micro_batch_size": 1},
                                      callbacks=[recorder])
            steps[task] = recorder, trainer.callback_metrics["train/loss"]
        return steps[task]

    return step


def _dp_worker(rank, task, out_path):
    recorder = GradientRecorder()
    _, _, trainer = fit_pairs(task, max_steps=2, data_kwargs={"batch_size": 4, "max_length_per_device": 512},
                              callbacks=[recorder], devices=2, strategy="ddp")
    if rank == 0:
        torch.save({"grads": recorder.grads, "metrics": dict(trainer.callback_metrics)}, out_path)


def _dp_jobs_worker(rank, root):
    for task in TASKS:  # both tasks in one spawned pair: each rank imports torch and Lightning once
        print(f"rank {rank}: {task}", flush=True)  # in the group's failure output: which fit it was on
        _dp_worker(rank, task, root / f"{task}.pt")


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory):
    """``(root, error)``: ``root/<task>.pt`` from `_dp_jobs_worker`, and the group's error if it failed."""
    root = tmp_path_factory.mktemp("dp2")
    try:
        run_on_cpu_ranks(_dp_jobs_worker, 2, root)
        error = None
    except Exception as e:  # noqa: BLE001 - kept for the tests, each fails naming it
        error = f"{type(e).__name__}: {e}"
    return root, error


@pytest.mark.parametrize("task", list(TASKS))
def test_two_data_parallel_ranks_give_the_single_rank_gradient(task, dp2_runs):
    root, error = dp2_runs
    if not (root / f"{task}.pt").exists():
        pytest.fail(f"{task}: no output; the spawned pair failed: {error}")
    dp2 = torch.load(root / f"{task}.pt")
    single = GradientRecorder()
    _, _, trainer = fit_pairs(task, max_steps=2, data_kwargs={"batch_size": 8, "max_length_per_device": 512},
                              callbacks=[single])
    distributed = GradientRecorder()
    distributed.grads = dp2["grads"]
    assert_same_grads(single, distributed)
    for key in ("train/loss", "train/accuracy", "train/margin"):
        assert_close(dp2["metrics"][key], trainer.callback_metrics[key], atol=1e-5)


def _completion_logprobs_one_by_one(model, pair_sequences):
    """Summed completion log-probabilities, one unpacked sequence at a time."""
    out = []
    for s in pair_sequences:
        ids = torch.tensor([s.input_ids])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        picked = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
        out.append((picked * torch.tensor(s.loss_mask[1:])).sum())
    return torch.stack(out)


def test_dpo_completion_logprobs_of_a_packed_micro_batch_equal_one_by_one():
    """`completion_logprobs` sums each packed sequence's target-token log-probabilities, exactly as each sequence alone
    (plain forward, float64 log-softmax) gives them."""
    from rl_lightning.models.loading import load_causal_lm
    from rl_lightning.tasks.dpo import completion_logprobs

    model = load_causal_lm(str(TINY_MODEL)).eval()
    torch.manual_seed(0)
    sequences = [TokenizedExample(torch.randint(0, 256, (n,)).tolist(), [0] * (n // 2) + [1] * (n - n // 2))
                 for n in (9, 4, 15, 6)]
    with torch.no_grad():
        packed = completion_logprobs(model, pack(sequences, 0))
        expected = _completion_logprobs_one_by_one(model, sequences)
    assert packed.shape == (4,)
    assert_close(packed.double(), expected, atol=1e-5)


def test_dpo_first_step_loss_is_log_two_and_reference_free_matches_by_hand():
    """At step 0 the policy is the reference, so every h is 0 and the sigmoid loss is exactly ln 2. Reference-free,
    h = log pi(chosen) - log pi(rejected), computed here pair by pair without packing."""
    from transformers import AutoModelForCausalLM

    _, data, trainer = fit_pairs("dpo")
    assert_close(trainer.callback_metrics["train/loss"], torch.tensor(math.log(2)), atol=1e-6)
    _, data, trainer = fit_pairs("dpo", model_kwargs={"reference_free": True, "beta": 0.5})
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    pairs = data.units["train"][:8]
    chosen = _completion_logprobs_one_by_one(model, [p.chosen for p in pairs])
    rejected = _completion_logprobs_one_by_one(model, [p.rejected for p in pairs])
    expected = -torch.nn.functional.logsigmoid(0.5 * (chosen - rejected)).mean()
    assert_close(trainer.callback_metrics["train/loss"].double(), expected, atol=1e-5)


def test_dpo_reference_offload_gives_the_same_gradient_and_stays_on_cpu():
    kept, offloaded = GradientRecorder(), GradientRecorder()
    fit_pairs("dpo", max_steps=2, callbacks=[kept])
    model, _, _ = fit_pairs("dpo", max_steps=2, callbacks=[offloaded], model_kwargs={"reference_offload": True})
    assert_same_grads(kept, offloaded, atol=0.0)
    assert next(model._reference.parameters()).device.type == "cpu"
    assert not any(p.requires_grad for p in model._reference.parameters())


def test_reward_model_export_scores_like_training(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from rl_lightning.tracking.export import export_hf

    module, data, _ = fit_pairs("rm", max_steps=2)
    export_hf(module.model, str(TINY_MODEL), tmp_path / "rm")
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    pair = data.units["train"][0]
    training_rewards = sequence_rewards(module.model.eval(), pack([pair.chosen, pair.rejected], 0))
    for sequence, reward in zip((pair.chosen, pair.rejected), training_rewards, strict=True):
        hf_reward = exported(input_ids=torch.tensor([sequence.input_ids])).logits[0, 0]
        assert_close(hf_reward, reward, atol=1e-5)
    umask = os.umask(0)
    os.umask(umask)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "rm").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~umask  # servable by another user


def test_reward_is_read_where_hf_pools_when_eos_pads():
    """A tokenizer that pads with EOS and sequences ending in EOS: transformers pools at the last non-pad token, so
    training must read the reward there too."""
    from transformers import AutoModelForSequenceClassification

    from rl_lightning.models.loading import load_reward_model

    model = load_reward_model(str(TINY_MODEL)).eval()
    eos = model.config.eos_token_id
    model.config.pad_token_id = eos
    sequence = TokenizedExample([258, 84, 82, 19, eos], [0, 0, 1, 1, 1])
    batch = pack([sequence, TokenizedExample([258, 19], [0, 1])], pad_token_id=eos)
    assert batch["last_mask"].tolist() == [[0, 0, 0, 1, 0, 0, 1]]
    hf = AutoModelForSequenceClassification.from_config(model.config)
    hf.load_state_dict(model.state_dict())
    expected = hf.eval()(input_ids=torch.tensor([sequence.input_ids])).logits[0, 0]
    assert_close(sequence_rewards(model, batch)[0], expected, atol=1e-5)


def test_overlong_pair_fails_at_setup_or_is_counted_when_opted_in():
    kwargs = {"tokenizer_name": str(TINY_MODEL), "max_length_per_device": 100, "batch_size": 2}
    strict = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), **kwargs)
    with pytest.raises(ConfigError, match=r"preference.jsonl line \d+: the chosen\+rejected pair has \d+ tokens, more "
                                          r"than data.max_length_per_device=100; .*data.drop_overlong: true"):
        strict.setup("fit")
    lenient = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), drop_overlong=True, **kwargs)
    lenient.setup("fit")
    kept = len(lenient.units["train"])
    assert lenient.stats["data/train_overlong"] == 1000 - kept > 0
    assert all(len(p.chosen.input_ids) + len(p.rejected.input_ids) <= 100 for p in lenient.units["train"])
