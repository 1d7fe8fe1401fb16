"""SimPO, ORPO and KTO in the DPO task: through the real CLI (recipes/dpo.yaml + ``--model.loss_type``) the first
step's logged loss equals the pure function on the same rows, scored one sequence at a time with a plain forward;
reference-free losses never build a reference model; KTO units are built as documented (unpaired rows, pairs split in
two, mismatched sequences from the previous row); bad settings are one line at start-up naming the key and the fix."""

import json
import math

import pytest
import torch
from conftest import DEMO_DATA, TINY_MODEL, assert_close
from helpers import parse_cli

from rl_lightning.algorithms import kto_loss, kto_reference_point, orpo_loss, simpo_loss
from rl_lightning.cli.main import main
from rl_lightning.data import PreferenceDataModule
from rl_lightning.data.loading import load_rows
from rl_lightning.data.tokenization import tokenize_messages
from rl_lightning.errors import ConfigError, DataError
from rl_lightning.models.config import LMConfig
from rl_lightning.tasks import DPO

SFT_MODEL = TINY_MODEL.parent / "tiny-qwen2-sft"
FIRST_STEP = ["--config", "recipes/dpo.yaml", "--trainer.max_steps", "1", "--data.batch_size", "8",
              "--data.shuffle", "false", "--trainer.enable_checkpointing", "false"]


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["rl_lightning"])


def _fit_first_step(args):
    """The real CLI, parsed and instantiated, then `fit` as its ``fit`` subcommand runs it; returns the CLI."""
    cli = parse_cli(args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli


def _logps_one_by_one(model_path, sequences):
    """(summed completion log-probabilities, completion token counts) of each sequence alone, float64 log-softmax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    sums, counts = [], []
    with torch.no_grad():
        for s in sequences:
            ids = torch.tensor([s.input_ids])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            picked = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(s.loss_mask[1:], dtype=torch.float64)
            sums.append((picked * mask).sum())
            counts.append(mask.sum())
    return torch.stack(sums), torch.stack(counts)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_log_the_pure_function_and_build_no_reference(loss_type, workdir):
    extra = ["--model.simpo_gamma", "0.3"] if loss_type == "simpo" else []
    cli = _fit_first_step([*FIRST_STEP, "--model.loss_type", loss_type, "--model.reference_free", "true",
                           "--model.beta", "2.0", *extra])
    assert cli.model._reference is None  # never built: configure_model only loads one for a referenced loss
    pairs = cli.datamodule.units["train"][:8]
    chosen, chosen_tokens = _logps_one_by_one(TINY_MODEL, [p.chosen for p in pairs])
    rejected, rejected_tokens = _logps_one_by_one(TINY_MODEL, [p.rejected for p in pairs])
    chosen, rejected = chosen / chosen_tokens, rejected / rejected_tokens
    if loss_type == "simpo":
        expected, _ = simpo_loss(chosen, rejected, 8, beta=2.0, gamma=0.3)
    else:
        expected, _ = orpo_loss(chosen, rejected, 8, lam=2.0)
    # 1e-5: the run's float32 packed forward against float64 log-softmax one sequence at a time
    assert_close(cli.trainer.callback_metrics["train/loss"].double(), expected, atol=1e-5)


@pytest.mark.slow
def test_kto_logs_the_pure_function_with_its_reference_point(workdir):
    """The SFT-tuned tiny model as reference, so log-ratios and the reference point z0 are not zero; desirable weight
    2: the paired demo rows split into 4 desirable and 4 undesirable examples in the first step."""
    cli = _fit_first_step([*FIRST_STEP, "--model.loss_type", "kto", "--model.ref_model_name", str(SFT_MODEL),
                           "--model.desirable_weight", "2.0"])
    units = cli.datamodule.units["train"][:8]
    assert [u.fields["label"] for u in units] == [1.0, 0.0] * 4
    logps, _ = _logps_one_by_one(TINY_MODEL, [u.example for u in units])
    ref_logps, _ = _logps_one_by_one(SFT_MODEL, [u.example for u in units])
    mismatched, _ = _logps_one_by_one(TINY_MODEL, [u.mismatched for u in units])
    ref_mismatched, _ = _logps_one_by_one(SFT_MODEL, [u.mismatched for u in units])
    z0 = kto_reference_point((mismatched - ref_mismatched).sum(), 8)
    assert z0 > 0.1  # not a trivial reference point
    labels = torch.tensor([u.fields["label"] for u in units], dtype=torch.float64)
    expected, _ = kto_loss(logps, ref_logps, labels, z0, 8, 0.1, 2.0, 1.0)
    metrics = cli.trainer.callback_metrics
    assert_close(metrics["train/kl"].double(), z0, atol=1e-5)  # 1e-5: float32 packed vs float64 one by one
    assert_close(metrics["train/loss"].double(), expected, atol=1e-5)
    assert_close(metrics["train/desirable"], torch.tensor(0.5))


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


class _Task:
    """What `PreferenceDataModule` reads of the task it feeds: whether it trains on unpaired examples."""

    def __init__(self, unpaired):
        self.lightning_module = type("Module", (), {"unpaired_examples": unpaired})()


def _units(path, unpaired, **kwargs):
    data = PreferenceDataModule(path, tokenizer_name=str(TINY_MODEL), batch_size=2, **kwargs)
    data.trainer = _Task(unpaired)
    return data.build_units(load_rows(path), "train")[0], data.tokenizer


def test_unpaired_rows_and_pairs_give_kto_units_with_previous_row_mismatches(tmp_path):
    rows = [{"prompt": "What is 1 + 1?", "completion": "2", "label": True},
            {"messages": [{"role": "user", "content": "What is 2 + 5?"}], "completion": "8", "label": False},
            {"messages": [{"role": "user", "content": "What is 3 * 3?"}], "chosen": "9", "rejected": "6"}]
    units, tokenizer = _units(_write_rows(tmp_path / "mixed.jsonl", rows), unpaired=True)
    prompts = [[{"role": "user", "content": q}] for q in ("What is 1 + 1?", "What is 2 + 5?", "What is 3 * 3?")]

    def tokens(prompt, completion):
        return tokenize_messages(tokenizer, [*prompt, {"role": "assistant", "content": completion}], 1024,
                                 last_turn_only=True)

    # examples: (row 0, "2", desirable), (row 1, "8", undesirable), (row 2, "9", desirable), (row 2, "6", undesirable)
    expected = [(prompts[0], "2", 1.0, "9"), (prompts[1], "8", 0.0, "2"), (prompts[2], "9", 1.0, "8"),
                (prompts[2], "6", 0.0, "8")]  # mismatched: the previous row's same side (or its only one); row 0: last
    assert len(units) == 4
    for unit, (prompt, completion, label, mismatched) in zip(units, expected, strict=True):
        assert unit.fields == {"label": label}
        assert unit.example.input_ids == tokens(prompt, completion).input_ids
        assert unit.example.loss_mask == tokens(prompt, completion).loss_mask
        assert unit.mismatched.input_ids == tokens(prompt, mismatched).input_ids
        assert unit.mismatched.loss_mask == tokens(prompt, mismatched).loss_mask


def test_a_paired_row_split_for_kto_gives_the_pair_tokens(tmp_path):
    path = str(DEMO_DATA / "preference.jsonl")
    pairs, _ = _units(path, unpaired=False, max_length=128)
    examples, _ = _units(path, unpaired=True, max_length=128)
    assert len(examples) == 2 * len(pairs) == 2000
    for pair, (chosen, rejected) in zip(pairs[:50], zip(examples[0::2], examples[1::2], strict=True), strict=False):
        assert chosen.example == pair.chosen and rejected.example == pair.rejected


def test_unpaired_rows_for_a_paired_loss_or_a_bad_label_are_one_line(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Hi"}], "chosen": "a", "rejected": "b"},
            {"prompt": "Hi", "completion": "a", "label": True}]
    path = _write_rows(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(DataError, match=r"mixed.jsonl line 2: an unpaired row \('completion', 'label'\) but this loss "
                                        r"trains on pairs \('chosen', 'rejected'\); set model.loss_type: kto"):
        _units(path, unpaired=False)
    rows[1]["label"] = "yes"
    path = _write_rows(tmp_path / "label.jsonl", rows)
    with pytest.raises(DataError, match=r"line 2: 'label' must be true \(desirable\) or false \(undesirable\), got "
                                        r"'yes'$"):
        _units(path, unpaired=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_type": "kto", "reference_free": True},
         "model.loss_type=kto needs the reference model (its rewards are log-ratios against it); set "
         "model.reference_free: false"),
        ({"loss_type": "simpo"},
         "model.loss_type=simpo is reference-free (it compares the policy's own average log-probabilities); set "
         "model.reference_free: true so no reference model is loaded"),
        ({"loss_type": "orpo"},
         "model.loss_type=orpo is reference-free (it compares the policy's own average log-probabilities); set "
         "model.reference_free: true so no reference model is loaded"),
        ({"loss_type": "sigmoid", "simpo_gamma": 0.5},
         "model.simpo_gamma=0.5 is SimPO's target margin, for the reference-free loss only; set model.loss_type: "
         "simpo and model.reference_free: true, or unset model.simpo_gamma"),
        ({"loss_type": "kto", "desirable_weight": 0.0},
         "model.desirable_weight must be > 0, got 0.0; it scales KTO's loss on those examples (1.0: balanced data; "
         "raise the weight of the rarer kind)"),
        ({"loss_type": "kto", "undesirable_weight": -1.0},
         "model.undesirable_weight must be > 0, got -1.0; it scales KTO's loss on those examples (1.0: balanced "
         "data; raise the weight of the rarer kind)"),
        ({"loss_type": "sigmoid", "desirable_weight": 2.0},
         "model.desirable_weight=2.0 only applies to model.loss_type: kto (got sigmoid); unset it"),
        ({"loss_type": "orpo", "reference_free": True, "label_smoothing": 0.1},
         "model.label_smoothing=0.1 applies to loss_type sigmoid, robust, simpo, not orpo; set it to 0"),
        ({"loss_type": "cpo"},
         "model.loss_type must be one of sigmoid, robust, ipo, hinge, simpo, orpo, kto, got 'cpo'"),
    ],
    ids=["kto-reference-free", "simpo-with-reference", "orpo-with-reference", "gamma-not-simpo", "kto-weight-zero",
         "kto-weight-negative", "weight-not-kto", "orpo-smoothing", "unknown"],
)
def test_inconsistent_loss_settings_are_one_line_naming_the_key(kwargs, message):
    with pytest.raises(ConfigError) as info:
        DPO(LMConfig(str(TINY_MODEL)), **kwargs)
    assert str(info.value) == message


def test_a_bad_loss_setting_is_one_line_through_the_cli(workdir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "recipes/dpo.yaml", "--model.loss_type", "simpo"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rl_lightning: error: model.loss_type=simpo is reference-free"), err


def test_kto_first_step_closed_form_at_the_reference():
    """Policy == reference: every log-ratio is 0, z0 = 0, each example's loss w (1 - sigma(0)) = w / 2; 4 desirable
    (w = 2) and 4 undesirable (w = 1) examples: (4 + 2) / 8 = 0.75."""
    from helpers import fit

    from rl_lightning.models.optim import OptimConfig

    data = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=8,
                                shuffle=False, max_length=128)
    model = DPO(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3, lr_schedule="constant", max_grad_norm=0.0)), loss_type="kto", desirable_weight=2.0)
    trainer = fit(model, data)
    assert_close(trainer.callback_metrics["train/loss"], torch.tensor(0.75))
    assert trainer.callback_metrics["train/kl"].item() == 0.0
    assert math.isclose(trainer.callback_metrics["train/pairs"].item(), 8)


@pytest.mark.parametrize("loss_type", ["kto", "orpo"])
def test_packing_and_micro_batch_split_leave_the_gradient_unchanged(loss_type):
    """One unit per padded micro-batch against 4 packed micro-batches: the same loss and gradients (KTO's reference
    point is taken over the whole step, so it does not depend on the split either)."""
    from helpers import GradientRecorder, assert_same_grads, fit

    from rl_lightning.models.optim import OptimConfig

    model_kwargs = ({"loss_type": "kto", "ref_model_name": str(SFT_MODEL)} if loss_type == "kto" else
                    {"loss_type": "orpo", "reference_free": True})
    recorders, trainers = [], []
    for data_kwargs in ({"packing": False, "micro_batch_size": 1}, {"packing": True, "max_length_per_device": 400}):
        torch.manual_seed(0)
        data = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=8,
                                    shuffle=False, max_length=128, **data_kwargs)
        model = DPO(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3, lr_schedule="constant", max_grad_norm=0.0)), **model_kwargs)
        recorders.append(GradientRecorder())
        trainers.append(fit(model, data, callbacks=[recorders[-1]]))
    assert recorders[0].micro_batches == [8] and recorders[1].micro_batches[0] > 1
    assert_same_grads(*recorders)
    assert_close(trainers[1].callback_metrics["train/loss"], trainers[0].callback_metrics["train/loss"], atol=1e-5)
