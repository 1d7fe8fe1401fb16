"""The export's model card: a real tiny SFT run through the CLI writes README.md (Hugging Face front matter, recipe,
settings, held-out metrics at start and end, the command) and its resolved config, and the folder still loads in
transformers; the pure parts on a hand-made card."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from rl_lightning.cli.main import main
from rl_lightning.tracking.model_card import (
    CONFIG_FILE,
    CardInfo,
    base_license,
    card_text,
    format_command,
    front_matter,
)

SFT = ["fit", "--config", "recipes/sft.yaml", "--trainer.max_steps", "2", "--data.batch_size", "4",
       "--data.path", "train.jsonl", "--data.val_path", "val.jsonl", "--trainer.val_check_interval", "1",
       "--trainer.num_sanity_val_steps", "0", "--trainer.enable_checkpointing", "false"]


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["rl_lightning"])


def test_sft_export_has_a_model_card_and_still_loads(workdir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chats = (workdir / "rl_lightning/assets/data/sft.jsonl").read_text().splitlines()
    (workdir / "train.jsonl").write_text("\n".join(chats[:16]) + "\n")  # a short file: little to tokenize
    (workdir / "val.jsonl").write_text("\n".join(chats[16:20]) + "\n")
    main(SFT)
    export = workdir / "outputs" / "sft" / "latest" / "export"
    text = (export / "README.md").read_text()
    meta = front_matter(text)
    assert meta["base_model"] == "rl_lightning/assets/tiny-qwen2"
    assert meta["pipeline_tag"] == "text-generation" and meta["library_name"] == "transformers"
    assert {"rl_lightning", "sft"} <= set(meta["tags"])
    assert "license" not in meta  # the tiny base model's folder has no card to take it from

    client = MlflowClient("sqlite:///mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("rl_lightning/sft").experiment_id])
    val = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "val/loss"), key=lambda m: m.timestamp)]
    assert len(val) == 2
    assert f"| `val/loss` | {val[0]:.4g} (step 1) | {val[1]:.4g} (step 2) |" in text  # before and after
    assert "| recipe | `rl_lightning/recipes/sft.yaml` |" in text and "| `model.lm.optim.lr` | `0.003` |" in text
    assert "| `trainer.max_steps` | `2` |" in text and "| `data.batch_size` | `4` |" in text
    bundled = [arg.replace("recipes/", "rl_lightning/recipes/") for arg in SFT]  # the recipe the CLI found
    assert format_command(bundled) in text and "python -m rl_lightning fit \\\n    --config rl_lightning/recipes/sft.yaml" in text
    assert run.info.run_id in text
    assert "class_path: rl_lightning.tasks.SFT" in (export / CONFIG_FILE).read_text()

    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = tokenizer("What is 2 + 3?", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape[1] == ids.shape[1] + 2


def _card(**changes) -> CardInfo:
    info = CardInfo(base_model="Qwen/Qwen2.5-0.5B-Instruct", task="PPO", algorithm="Dr. GRPO",
                    length="40 rollouts (80 optimizer steps)", version="0.1.0", run_name="grpo", license="apache-2.0",
                    lineage={"recipe": "recipes/grpo.yaml", "data": "d.jsonl",
                             "data_sha256": "ab" * 32, "git_commit": "c0ffee" * 7,
                             "git_dirty": "true"},
                    settings={"model.kl.coef": 0.0, "model.rollout.reward_weights": {"a|b": 1.0}},
                    metrics={"val/reward": ((0, 0.25), (40, 0.75)), "val/reward/correct": ((40, 0.5), (40, 0.5))},
                    x_unit="rollout", command="python -m rl_lightning fit \\\n    --config recipes/grpo.yaml",
                    versions={"rl_lightning": "0.1.0"})
    for key, value in changes.items():
        setattr(info, key, value)
    return info


def test_card_text_front_matter_and_body():
    text = card_text(_card())
    meta = front_matter(text)
    assert meta == {"base_model": "Qwen/Qwen2.5-0.5B-Instruct", "library_name": "transformers",
                    "pipeline_tag": "text-generation", "tags": ["rl_lightning", "reinforcement-learning", "dr-grpo"],
                    "license": "apache-2.0"}
    assert "**Dr. GRPO**" in text and "for 40 rollouts (80 optimizer steps)" in text
    assert "| `val/reward` | 0.25 (rollout 0) | 0.75 (rollout 40) |" in text
    assert "| `val/reward/correct` |  | 0.5 (rollout 40) |" in text  # one validation: no start column
    assert "`{'a\\|b': 1.0}`" in text  # a pipe would split the table's cell
    assert f"at commit `{'c0ffee' * 2}`" in text and "(with uncommitted changes)" in text
    reward_model = front_matter(card_text(_card(task="RewardModel", algorithm="Bradley-Terry", license=None)))
    assert reward_model["pipeline_tag"] == "text-classification" and "license" not in reward_model
    assert "AutoModelForSequenceClassification.from_pretrained" in card_text(_card(task="RewardModel"))


def test_license_comes_from_the_base_models_own_card(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: mit\nlanguage: [en]\n---\n# base\n")
    assert base_license(str(tmp_path)) == "mit"
    assert base_license(str(tmp_path / "missing")) is None
    assert front_matter("# no front matter") == {}
    assert json.dumps(front_matter("---\nbase_model: x\n---\n")) == '{"base_model": "x"}'


def test_the_built_real_model_is_named_by_its_hub_id():
    from rl_lightning.assets.real import REAL_MODEL, SCHEME
    from rl_lightning.tracking.model_card import ASSET_ORIGINS

    hub_id, license, note = ASSET_ORIGINS[f"{SCHEME}{REAL_MODEL}"]  # the asset the real recipes train
    text = card_text(_card(base_model=hub_id, license=license, base_note=note))
    assert front_matter(text)["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert front_matter(text)["license"] == "apache-2.0"
    assert "| base model | `HuggingFaceTB/SmolLM2-135M-Instruct` (as `asset:SmolLM2-135M-Instruct`" in text
