"""HF engine: greedy == argmax decoding, seeded sampling reproducible, engine logprobs == recomputed processed
logprobs; environment loading and the reward-error policy; rollout settings (``model.rollout``) and the sampling
parameters the rollout callback derives from them."""

import dataclasses
import math
import random

import pytest
import torch
from conftest import TINY_MODEL, assert_close
from helpers import run_on_cpu_ranks

from rl_lightning.algorithms import token_logprobs
from rl_lightning.data.prompts import Prompt
from rl_lightning.engines.hf import HFEngine
from rl_lightning.engines.protocol import SamplingParams, derive_seed
from rl_lightning.envs.environment import load_environment
from rl_lightning.errors import ConfigError, DataError
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.rollout.callback import RolloutCallback, RolloutConfig
from rl_lightning.rollout.trajectory import continuation_seeds

PROMPT = [258, 84, 82, 68, 81, 198, 54, 71, 64, 83, 256, 198, 258, 64]


@pytest.fixture(scope="module")
def engine():
    model = load_causal_lm(str(TINY_MODEL))
    return HFEngine(model, pad_token_id=257)


def test_greedy_equals_argmax_decoding(engine):
    (completion,) = engine.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=6))[0]
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, engine.model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert completion.token_ids == ids[0, len(PROMPT):].tolist() and not completion.finished


def test_seeded_sampling_is_reproducible_and_logprobs_match_the_trainer(engine):
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=8, seed=123)
    first = engine.generate([PROMPT, PROMPT[:5]], params)
    second = engine.generate([PROMPT, PROMPT[:5]], params)
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in second]
    assert len({tuple(c.token_ids) for c in first[0]}) > 1  # n samples differ from each other
    completion = first[0][0]
    ids = torch.tensor([PROMPT + completion.token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[:, len(PROMPT) - 1 : -1]
    recomputed = token_logprobs(logits, ids[:, len(PROMPT):], temperature=0.7)[0]
    assert_close(torch.tensor(completion.logprobs), recomputed, atol=1e-4)  # generate's cached vs full forward


@pytest.mark.parametrize("sampling", [{"temperature": 0.7}, {"temperature": 1.0, "top_k": 5},
                                      {"temperature": 0.9, "top_p": 0.8}], ids=["temperature", "top_k", "top_p"])
def test_batched_decoding_samples_what_generate_samples_for_each_prompt_alone(engine, sampling):
    """Prompts of different lengths decode in one left-padded batch, yet each completion (prompt i, sample j) is
    exactly what ``model.generate`` samples for that prompt alone after ``torch.manual_seed(sample_seed(i, j))``
    (transformers' warpers and multinomial draw), and the same as decoding the prompt by itself: independent of the
    batch and the rank."""
    prompts, seeds = [PROMPT, PROMPT[:5], PROMPT[3:9]], [5, 9, 11]
    params = SamplingParams(n=3, max_new_tokens=12, seeds=seeds, **sampling)
    batched = engine.generate(prompts, params)
    for i, (prompt, seed, completions) in enumerate(zip(prompts, seeds, batched, strict=True)):
        reference = []
        for j in range(3):
            torch.manual_seed(params.sample_seed(i, j))
            ids = torch.tensor([prompt])
            reference += engine.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=12,
                pad_token_id=257, eos_token_id=None, temperature=sampling["temperature"],
                top_k=sampling.get("top_k") or None, top_p=sampling.get("top_p", 1.0))[:, len(prompt):].tolist()
        assert [c.token_ids for c in completions] == reference
        (alone,) = engine.generate([prompt], dataclasses.replace(params, seeds=[seed]))
        assert [c.token_ids for c in alone] == [c.token_ids for c in completions]
        for a, b in zip(alone, completions, strict=True):  # padding changes only the summation order
            assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert len({tuple(c.token_ids) for g in batched for c in g}) > 3  # not a constant sequence


def test_a_prompt_leaves_the_batch_when_its_completions_stopped_and_others_sample_the_same(engine):
    """With stop tokens, a prompt whose n rows have all stopped leaves the batch and the KV cache (the forward's
    batch shrinks), and every prompt still gets exactly what ``model.generate`` samples for it alone."""
    prompts, seeds = [PROMPT, PROMPT[:5], PROMPT[3:9]], [5, 9, 11]
    free = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seeds=seeds))
    stops = sorted({c.token_ids[0] for c in free[1]})  # the middle prompt's first tokens: it stops at once
    batch_sizes = []
    hook = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        batched = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seeds=seeds,
                                                          stop_token_ids=stops))
    finally:
        hook.remove()
    assert batch_sizes[0] == 9 and min(batch_sizes) < 9  # a prompt's rows left the batch
    seeded = SamplingParams(n=3, seeds=seeds)
    for i, (prompt, completions) in enumerate(zip(prompts, batched, strict=True)):
        reference = []
        for j in range(3):
            torch.manual_seed(seeded.sample_seed(i, j))
            ids = torch.tensor([prompt])
            reference += engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                               max_new_tokens=16, pad_token_id=257, eos_token_id=stops,
                                               temperature=1.0, top_k=None)[:, len(prompt):].tolist()
        for completion, row in zip(completions, reference, strict=True):
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            assert completion.token_ids == row[:end] and completion.finished == (row[end - 1] in stops)


def test_stop_tokens_end_completions(engine):
    (greedy,) = engine.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=6))[0]
    stop = greedy.token_ids[2]
    (stopped,) = engine.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[stop]))[0]
    first = greedy.token_ids.index(stop)
    assert stopped.finished and stopped.token_ids == greedy.token_ids[: first + 1]
    assert len(stopped.logprobs) == len(stopped.token_ids)


def _lockstep_worker(rank, out_path):
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # a missed step fails, never hangs
    model = load_causal_lm(str(TINY_MODEL))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    engine = HFEngine(model, pad_token_id=257)
    (greedy,) = engine.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=8))[0]
    stops = [greedy.token_ids[1]] if rank == 0 else []  # rank 0 stops after 2 tokens, rank 1 decodes all 8
    (stopped,) = engine.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=stops))[0]
    torch.save((greedy.token_ids, stopped.token_ids, stopped.finished), f"{out_path}.{rank}")


def test_sharded_policy_decodes_in_lockstep_across_ranks(engine, tmp_path):
    """Under FSDP2 every forward is a collective: a rank whose completions all stopped keeps stepping until its peers
    are done (else its peers wait in an all-gather it never joins), and its completions are still cut at the stop."""
    run_on_cpu_ranks(_lockstep_worker, 2, tmp_path / "out")
    (reference,) = engine.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=8))[0]
    (greedy0, stopped0, finished0), (greedy1, stopped1, finished1) = (
        torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    assert greedy0 == greedy1 == reference.token_ids  # sharding changes nothing
    first = reference.token_ids.index(reference.token_ids[1])
    assert stopped0 == reference.token_ids[: first + 1] and finished0
    assert stopped1 == reference.token_ids and not finished1


def _env(tmp_path, source):
    path = tmp_path / "env.py"
    path.write_text(source)
    return str(path)


def test_environment_loading_errors(tmp_path):
    with pytest.raises(ConfigError, match="env_path '.*missing.py' does not exist"):
        load_environment(str(tmp_path / "missing.py"))
    with pytest.raises(ConfigError, match="must define reward_fn"):
        load_environment(_env(tmp_path, "def score(messages, answer):\n    return 1.0\n"))
    with pytest.raises(ConfigError, match="reward_fn must take"):
        load_environment(_env(tmp_path, "def reward_fn(messages):\n    return 1.0\n"))
    with pytest.raises(ConfigError, match="failed to import: ZeroDivisionError"):
        load_environment(_env(tmp_path, "x = 1 / 0\n"))


def test_reward_errors_fail_fast_or_score_zero(tmp_path):
    path = _env(tmp_path, "def reward_fn(messages, answer):\n    if answer == 'nan':\n        return float('nan')\n"
                          "    return 1 / int(answer)\n\ndef interact(messages):\n    return []\n")
    env = load_environment(path)
    assert env.interact is not None and env.score([], "4", "row 1")[0] == 0.25
    with pytest.raises(DataError, match=r"row 2: reward_fn from .*env.py failed \(ZeroDivisionError"):
        env.score([], "0", "row 2")
    with pytest.raises(DataError, match="non-finite"):
        env.score([], "nan", "row 3")
    lenient = load_environment(path, on_error="zero")
    assert lenient.score([], "0", "row 2")[0] == 0.0 and lenient.score([], "nan", "row 3")[0] == 0.0
    assert lenient.failures == 2 and not math.isnan(lenient.score([], "2", "row 4")[0])


def test_multi_component_rewards_weighted_sum_and_tchebycheff(tmp_path):
    path = _env(tmp_path, "def reward_fn(messages, answer):\n"
                          "    return {'correct': float(answer == 'right'), 'format': 0.5}\n")
    weighted = load_environment(path, weights={"correct": 2.0, "format": 0.4})
    assert weighted.score([], "right", "row 1") == (pytest.approx(2.0 * 1 + 0.4 * 0.5), {"correct": 1.0, "format": 0.5})
    assert weighted.score([], "wrong", "row 2")[0] == pytest.approx(0.2)
    cheb = load_environment(path, weights={"correct": 1.0, "format": 1.0}, combination="tchebycheff")
    # -max_k w_k |1 - r_k|: the worst-off objective decides
    assert cheb.score([], "right", "row 1")[0] == pytest.approx(-0.5)
    assert cheb.score([], "wrong", "row 2")[0] == pytest.approx(-1.0)
    ideal = load_environment(path, weights={"correct": 1.0, "format": 4.0}, combination="tchebycheff",
                             ideal={"correct": 1.0, "format": 0.5})
    assert ideal.score([], "wrong", "row 2")[0] == pytest.approx(-1.0)
    assert ideal.score([], "right", "row 1")[0] == pytest.approx(0.0)


def test_multi_component_reward_mismatches_are_config_errors(tmp_path):
    path = _env(tmp_path, "def reward_fn(messages, answer):\n    return {'correct': 1.0}\n")
    with pytest.raises(ConfigError, match=r"row 1: .* returned components \['correct'\] but reward_weights has \[\]"):
        load_environment(path).score([], "x", "row 1")
    with pytest.raises(ConfigError, match=r"but reward_weights has \['correct', 'format'\]"):
        load_environment(path, weights={"correct": 1.0, "format": 1.0}).score([], "x", "row 1")
    single = _env(tmp_path, "def reward_fn(messages, answer):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="return a dict with those keys"):
        load_environment(single, weights={"correct": 1.0}).score([], "x", "row 1")
    with pytest.raises(ConfigError, match="reward_combination must be one of weighted_sum, tchebycheff"):
        load_environment(single, combination="max")
    with pytest.raises(ConfigError, match="reward_ideal must name the same components"):
        load_environment(single, weights={"a": 1.0}, ideal={"b": 1.0})
    nan = _env(tmp_path, "def reward_fn(messages, answer):\n    return {'a': float('nan')}\n")
    lenient = load_environment(nan, on_error="zero", weights={"a": 1.0})
    assert lenient.score([], "x", "row 1") == (0.0, {"a": 0.0}) and lenient.failures == 1


def test_rollout_config_errors_are_reported_together_under_model_rollout(tmp_path):
    env = _env(tmp_path, "def reward_fn(messages, answer):\n    return 0.0\n")
    with pytest.raises(ConfigError) as error:
        RolloutConfig(env, responses_per_prompt=0, max_turns=0, engine="sglang")
    assert str(error.value) == ("model.rollout.engine.kind='sglang' is not an engine kind; use one of hf, vllm, "
                                "vllm_process (or register yours with rl_lightning.engines.registry.register); "
                                "model.rollout.responses_per_prompt must be >= 1, got 0; model.rollout.max_turns must "
                                "be >= 1, got 0")
    assert RolloutConfig(env, max_new_tokens=16, max_turns=3).max_completion_tokens == 48  # the generation budget


def test_sampling_params_seed_each_prompt_by_rollout_row_and_refill_round(tmp_path):
    """derive_seed(run seed, rollout, refill round, the prompt's row index): never the rank, so a prompt samples the
    same completions wherever it lands; the stop token is the caller's; the run's seed changes every seed."""
    env = _env(tmp_path, "def reward_fn(messages, answer):\n    return 0.0\n")
    config = RolloutConfig(env, responses_per_prompt=3, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=12)
    callback = RolloutCallback(config)
    callback.seed = 10  # what `setup` takes from the DataModule (the CLI's seed_everything)
    prompts = [Prompt([1], [], None, "row 5", 4), Prompt([2], [], None, "row 10", 9)]
    assert callback.sampling_params(2, prompts, 257, refill_round=1) == SamplingParams(
        n=3, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=12, stop_token_ids=[257],
        seeds=[derive_seed(10, 2, 1, 4), derive_seed(10, 2, 1, 9)])
    assert callback.sampling_params(0, prompts, 3).seeds == [derive_seed(10, 0, 0, 4), derive_seed(10, 0, 0, 9)]
    assert callback.sampling_params(0, prompts, 3).stop_token_ids == [3]
    callback.seed = 11
    assert callback.sampling_params(0, prompts, 3).seeds == [derive_seed(11, 0, 0, 4), derive_seed(11, 0, 0, 9)]


def test_no_two_requests_of_a_run_share_a_seed(tmp_path):
    """Every completion a run samples has a random stream of its own, over a realistic grid: 12 rollouts x 4 refill
    rounds x 64 prompts (rows drawn from 1000, so rows repeat across rollouts and rounds) x 8 samples x 3 turns, and
    validation (64 rows x 8 samples x 3 turns): 79k engine seeds, all distinct. (The old offsets ``seed + 1_000_003
    x rollout + 7_919 x round + row`` with vLLM's ``+ sample`` and the turn's ``+ 7_919 x turn + 104_729 x sample``
    gave row i's sample 1 the stream of row i + 1's sample 0.)"""
    env = _env(tmp_path, "def reward_fn(messages, answer):\n    return 0.0\n")
    callback = RolloutCallback(RolloutConfig(env, responses_per_prompt=8, val_temperature=1.0,
                                             val_responses_per_prompt=8))
    callback.seed = 42
    draw, n, seen = random.Random(0), 8, []

    def engine_seeds(params):  # what the engine seeds each completion with, turn by turn (`rollout`'s continuations)
        seeds = [params.sample_seed(i, j) for i in range(len(params.seeds)) for j in range(params.n)]
        active = list(range(len(seeds)))  # every trajectory goes on
        for turn in (1, 2):
            continued = dataclasses.replace(params, n=1, seed=None, seeds=continuation_seeds(params, active, turn))
            seeds += [continued.sample_seed(k, 0) for k in active]
        return seeds

    for step in range(12):
        for refill_round in range(4):
            prompts = [Prompt([1], [], None, f"row {r}", r) for r in draw.sample(range(1000), 64)]
            seen += engine_seeds(callback.sampling_params(step, prompts, 3, refill_round))
    seen += engine_seeds(callback.validation_params([Prompt([1], [], None, f"row {r}", r) for r in range(64)], 3))
    assert None not in seen and len(seen) == (12 * 4 + 1) * 64 * n * 3
    assert len(set(seen)) == len(seen)


def test_the_run_seed_drives_the_sampled_completions(engine, tmp_path):
    """The HF engine on the tiny model, through the callback's sampling parameters: another run seed samples other
    completions; the same seed samples the same ones exactly."""
    env = _env(tmp_path, "def reward_fn(messages, answer):\n    return 0.0\n")
    callback = RolloutCallback(RolloutConfig(env, responses_per_prompt=3, temperature=1.0, max_new_tokens=8))
    prompts = [Prompt(PROMPT, [], None, "row 1", 0), Prompt(PROMPT[:5], [], None, "row 2", 1)]

    def sample(seed):
        callback.seed = seed  # what `setup` takes from the DataModule (seed_everything)
        groups = engine.generate([p.prompt_ids for p in prompts], callback.sampling_params(0, prompts, 257))
        return [[c.token_ids for c in group] for group in groups]

    first, other, again = sample(1), sample(2), sample(1)
    assert first == again and first != other
    assert all(first[i][j] != other[i][j] for i in range(2) for j in range(3))  # every completion re-drawn
