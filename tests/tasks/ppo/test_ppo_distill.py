"""On-policy distillation in the PPO task (``model.distill``): the teacher's per-token signal on the student's own
samples, checked against an independent computation on the same trajectories (plain transformers forwards, TRL's
GKD loss), the LoRA teacher as the adapters-disabled base, and the one-line start-up errors."""

import json
import shutil

import lightning as L
import pytest
import torch
from conftest import REPO, TINY_MODEL
from helpers import Metrics, run_ppo

from rl_lightning.errors import ConfigError
from rl_lightning.memory.model_shape import load_model_shape
from rl_lightning.models.lora import AdaptersDisabled
from rl_lightning.tasks.ppo.distill import DistillConfig

TEACHER = REPO / "rl_lightning" / "assets" / "tiny-qwen2-sft"
ZERO_ENV = "def reward_fn(messages, answer):\n    return 0.0\n"


class Trajectories(L.Callback):
    """Each training batch's trajectories (input ids and completion masks)."""

    def __init__(self):
        self.batches = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append([(t.input_ids, t.completion_mask) for t in batch["rollout"].trajectories])


def _logits(folder, input_ids, temperature=1.0):
    """(T - 1, V) next-token logits / temperature from a plain transformers forward (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([input_ids])).logits[0, :-1] / temperature


def independent_reverse_kl(trajectories, student, teacher, temperature=1.0):
    """Mean over completion tokens of log pi_student - log pi_teacher of the sampled token, and its per-token values."""
    values = []
    for ids, completion_mask in trajectories:
        targets, mask = torch.tensor(ids[1:]), torch.tensor(completion_mask[1:]).bool()  # position i predicts i + 1
        s = _logits(student, ids, temperature).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
        t = _logits(teacher, ids, temperature).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
        values.append((s - t)[mask])
    return torch.cat(values)


@pytest.fixture(scope="module")
def zero_env(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "zero.py"
    path.write_text(ZERO_ENV)
    return str(path)


def test_reward_mode_logs_the_reverse_kl_and_puts_it_in_the_advantages(zero_env):
    """With a zero task reward (Dr. GRPO advantages 0), every completion token's advantage is
    coef x (log pi_teacher - log pi_student): the logged advantage mean is -coef x the logged reverse KL, and both
    equal an independent computation on the same trajectories."""
    metrics, batches = Metrics(), Trajectories()
    run_ppo(zero_env, callbacks=[metrics, batches], rollout={"temperature": 0.8},
            distill=DistillConfig(str(TEACHER), coef=0.5))
    first = metrics.history[0]
    per_token = independent_reverse_kl(batches.batches[0], TINY_MODEL, TEACHER, temperature=0.8)
    assert first["train/distill_reverse_kl"] == pytest.approx(float(per_token.mean()), abs=1e-5)
    assert first["train/advantage_mean"] == pytest.approx(-0.5 * float(per_token.mean()), abs=1e-5)
    assert first["train/advantage_std"] == pytest.approx(0.5 * float(per_token.std(correction=0)), abs=1e-5)
    assert first["train/distill_reverse_kl"] > 1.0  # the random student is far from the SFT'd teacher


def test_loss_mode_adds_gkd_jsd_equal_to_trls_on_the_same_tokens(zero_env):
    """``type: loss``: the logged JSD_beta is TRL's GKD loss over the student's sampled completion tokens (both
    models' logits from plain forwards); with a zero task reward it is the only gradient, and it moves the policy."""
    from trl.experimental.gkd import GKDTrainer

    metrics, batches = Metrics(), Trajectories()
    model, _ = run_ppo(zero_env, callbacks=[metrics, batches],
                       distill=DistillConfig(str(TEACHER), coef=1.0, type="loss", beta=0.3))
    student, teacher, labels = [], [], []
    for ids, completion_mask in batches.batches[0]:
        student.append(_logits(TINY_MODEL, ids))
        teacher.append(_logits(TEACHER, ids))
        labels.append(torch.tensor([i if m else -100 for i, m in zip(ids[1:], completion_mask[1:], strict=True)]))
    expected = GKDTrainer.generalized_jsd_loss(torch.cat(student)[None], torch.cat(teacher)[None],
                                               labels=torch.cat(labels)[None], beta=0.3)
    assert metrics.history[0]["train/distill_jsd"] == pytest.approx(float(expected), abs=1e-5)
    plan = model.memory_plan.components  # the plan counted the teacher (fp32 here, one process) and the JSD
    assert plan["teacher weights"] == 4 * load_model_shape(str(TEACHER)).params and plan["JSD (GKD: second forward and logits)"] > 0
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(str(TINY_MODEL), dtype=torch.float32).state_dict()
    moved = [k for k, v in model.model.state_dict().items() if not torch.equal(v, initial[k])]
    assert len(moved) > 0


@pytest.mark.parametrize("kind", ["reward", "loss"])
def test_a_lora_student_of_its_own_base_is_taught_by_the_base_with_adapters_disabled(zero_env, kind):
    """teacher = model.lm.name under LoRA: the teacher is the policy with its adapters off (no second model);
    before the first step B = 0, so student and teacher agree exactly: reverse KL 0, zero advantages, JSD 0."""
    metrics = Metrics()
    model, _ = run_ppo(zero_env, callbacks=[metrics], lm={"lora": {"r": 4}},
                       distill=DistillConfig(str(TINY_MODEL), type=kind))
    assert isinstance(model._teacher, AdaptersDisabled) and model._teacher.model is model.model
    assert model.memory_plan.components["teacher weights"] == 0  # no second copy to plan for
    assert abs(metrics.history[0]["train/distill_reverse_kl"]) < 1e-6
    assert abs(metrics.history[0]["train/advantage_std"]) < 1e-6
    if kind == "loss":
        assert abs(metrics.history[0]["train/distill_jsd"]) < 1e-7


def _other_tokenizer(folder):
    shutil.copytree(TINY_MODEL, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["!"], vocab['"'] = vocab['"'], vocab["!"]  # two ids swapped: same size, different ids
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


@pytest.mark.parametrize(
    ("distill", "match"),
    [
        ({"teacher": "./no/such/teacher"}, r"^model.distill.teacher './no/such/teacher': no such model folder .*; set "
                                           r"model.distill.teacher to a causal LM folder"),
        ({"teacher": "OTHER"}, r"^model.distill.teacher '.*' has a different tokenizer from model.lm.name .*"
                               r"\((\d+) vs \1 tokens, 4 entries differ\).*same tokenizer"),
        ({"teacher": "no-such-org/no-such-teacher"}, r"^model.distill.teacher 'no-such-org/no-such-teacher': cannot "
                                                     r"load its tokenizer \(.*\); set model.distill.teacher to"),
        ({"teacher": "asset:nothing"}, r"^model.distill.teacher: model 'asset:nothing' is not built"),
        ({"teacher": str(TEACHER), "type": "kl"}, "model.distill.type must be one of reward, loss, got 'kl'"),
        ({"teacher": str(TEACHER), "beta": 2.0}, r"model.distill.beta must be in \[0, 1\], got 2.0"),
        ({"teacher": str(TEACHER), "coef": 0.0}, "model.distill.coef must be > 0, got 0.0"),
    ],
)
def test_bad_teachers_are_refused_at_construction_in_one_line(tmp_path, distill, match):
    from helpers import ppo_task

    if distill["teacher"] == "OTHER":
        distill = {**distill, "teacher": str(_other_tokenizer(tmp_path / "other"))}
    with pytest.raises(ConfigError, match=match) as error:
        ppo_task(str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py"), distill=distill)
    assert "\n" not in str(error.value)


def test_the_loss_type_refuses_sequence_mean():
    from helpers import ppo_task

    with pytest.raises(ConfigError, match="model.distill.type=loss is a token mean and needs model.aggregation"):
        ppo_task(str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py"), aggregation="sequence_mean",
                 distill={"teacher": str(TEACHER), "type": "loss"})


CAPTURE = '''
import json
import lightning as L


class Capture(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rows = [[t.input_ids, t.completion_mask] for t in batch["rollout"].trajectories]
        with open("trajectories.jsonl", "a") as f:
            f.write(json.dumps(rows) + "\\n")
'''


@pytest.mark.slow
def test_the_recipe_through_the_cli_logs_the_reverse_kl_of_its_first_batch(workdir):
    """``recipes/distill.yaml`` through the real CLI (LightningCLI, MLflow store): the first rollout's logged
    ``train/distill_reverse_kl`` equals the per-token mean of log pi_student - log pi_teacher computed independently
    on the same trajectories, and the second rollout (after one update towards the teacher) is logged too."""
    from mlflow import MlflowClient

    from rl_lightning.cli.main import main

    (workdir / "capture.py").write_text(CAPTURE)
    main(["fit", "--config", "recipes/distill.yaml", "--model.max_rollouts", "2", "--data.batch_size", "4",
          "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing", "false",
          "--trainer.callbacks+=capture.Capture"])
    client = MlflowClient("sqlite:///mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("rl_lightning/rl").experiment_id])
    logged = sorted(client.get_metric_history(run.info.run_id, "train/distill_reverse_kl"), key=lambda m: m.step)
    first = [tuple(row) for row in json.loads((workdir / "trajectories.jsonl").read_text().splitlines()[0])]
    assert len(first) == 4 * 4 and len(logged) == 2  # batch_size x responses_per_prompt; one value per rollout
    expected = independent_reverse_kl(first, TINY_MODEL, TEACHER)
    assert logged[0].value == pytest.approx(float(expected.mean()), abs=1e-5)
