"""Policy-loss variants (``model.policy_loss``: ppo, gspo, cispo) and the rollout/trainer mismatch correction
(``model.correction``) in the PPO task, on the tiny model with the HF engine.

The HF engine's log-probabilities equal the trainer's (to ~1e-5), so `MismatchedEngine` shifts them after sampling
by known amounts, a simulated engine/trainer mismatch; the logged ``train/mismatch_masked`` and
``train/mismatch_kl`` must then equal the pure functions on those shifts. On the first minibatch (ratio 1, nothing
clipped) the three losses have the same gradient. Both also run from the CLI."""

import sys

import lightning as L
import pytest
import torch
from conftest import REPO
from helpers import GradientRecorder, Metrics, assert_same_grads, fit, ppo_task, prompts, run_on_cpu_ranks

from rl_lightning.algorithms.correction import mismatch_kl, mismatch_weights, sequence_log_ratios
from rl_lightning.cli.main import main
from rl_lightning.errors import ConfigError
from rl_lightning.parallel import ParallelStrategy
from rl_lightning.tasks import PPO
from rl_lightning.tasks.ppo import CorrectionConfig

ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py")


def engine_shift(parity: int, token: int) -> float:
    """The simulated engine's log-probability offset of a completion token: +1 on even trajectories (r = pi_old /
    pi_engine = e^-1 = 0.37, below 0.5 per token, per sequence and per geometric mean), +-0.3 alternating on odd
    ones (r in [0.74, 1.35] per token; sums in {0, -0.3}: inside [0.5, 2] at every level). A trajectory's parity is
    that of the sum of its token ids: the same whatever rank holds it."""
    return 1.0 if parity % 2 == 0 else (0.3 if token % 2 == 0 else -0.3)


class MismatchedEngine(PPO):
    """PPO whose engine log-probabilities are shifted by `engine_shift` after sampling. Keeps, per rollout, the
    shifts (per trajectory, per completion token) and the logged means, in class attributes so that an instance
    built by the CLI can be read back."""

    shifts: list[list[list[float]]] = []
    logged: list[dict[str, float]] = []

    def on_train_batch_start(self, batch, batch_idx):
        rollout_shifts = []
        for trajectory in batch["rollout"].trajectories:
            positions = [p for p, m in enumerate(trajectory.completion_mask) if m]
            rollout_shifts.append([engine_shift(sum(trajectory.input_ids), k) for k in range(len(positions))])
            for p, shift in zip(positions, rollout_shifts[-1], strict=True):
                trajectory.engine_logprobs[p] += shift
        MismatchedEngine.shifts.append(rollout_shifts)

    def log_rollout(self, rollout, means, *args):
        MismatchedEngine.logged.append({k: float(v) for k, v in means.items()})
        super().log_rollout(rollout, means, *args)


@pytest.fixture
def mismatched():
    MismatchedEngine.shifts.clear()
    MismatchedEngine.logged.clear()
    return MismatchedEngine


def expected_mismatch(shifts: list[list[float]], correction: CorrectionConfig) -> tuple[float, float]:
    """(masked fraction, mean per-token k3) from the pure functions, on log pi_old / pi_engine = -shift."""
    log_ratios = [-torch.tensor(s, dtype=torch.float64) for s in shifts]
    tokens = torch.cat(log_ratios)
    kl = mismatch_kl(tokens, torch.zeros_like(tokens)).mean()
    if correction.level == "token":
        masked = mismatch_weights(tokens, correction.mode, correction.low, correction.high)[1].mean()
    else:
        sums = torch.stack([r.sum() for r in log_ratios])
        counts = torch.tensor([float(len(r)) for r in log_ratios], dtype=torch.float64)
        ratio = sequence_log_ratios(sums, counts, correction.level)
        masked = mismatch_weights(ratio, correction.mode, correction.low, correction.high)[1].mean()
    return float(masked), float(kl)


def check_mismatch_metrics(correction: CorrectionConfig, masked_somewhere: bool) -> None:
    for shifts, logged in zip(MismatchedEngine.shifts, MismatchedEngine.logged, strict=True):
        masked, kl = expected_mismatch(shifts, correction)
        assert 0.0 <= logged["mismatch_masked"] <= 1.0
        assert logged["mismatch_masked"] == pytest.approx(masked, abs=1e-6)  # counts: exact up to float32
        assert (0.0 < masked < 1.0) == masked_somewhere  # even trajectories masked, odd ones kept
        # the HF engine's own log-probabilities differ from the trainer's by up to ~1e-5 per token
        assert logged["mismatch_kl"] == pytest.approx(kl, abs=1e-4)
        mean_shift = sum(abs(x) for s in shifts for x in s) / sum(len(s) for s in shifts)
        assert logged["engine_logprob_diff"] == pytest.approx(mean_shift, abs=1e-4)


@pytest.mark.parametrize(
    ("level", "mode"),
    [("token", "mask"), ("sequence", "mask"), ("geometric", "mask"), ("sequence", "truncate")],
    ids=["icepop", "sequence-mis", "geometric-mask", "sequence-tis"],
)
def test_logged_mismatch_equals_the_pure_functions(mismatched, parity_env, level, mode):
    """One rollout of 8 trajectories: ``train/mismatch_masked`` is the fraction of tokens (token level) or of
    trajectories (sequence levels) the pure function masks; nothing under ``truncate``."""
    correction = CorrectionConfig(level=level, mode=mode, low=0.5, high=2.0)
    L.seed_everything(0)
    fit(ppo_task(parity_env, task_class=mismatched, max_rollouts=1, correction=correction), prompts(2), -1)
    assert len(MismatchedEngine.logged) == 1
    check_mismatch_metrics(correction, masked_somewhere=mode == "mask")


def test_variants_take_the_same_first_step(mismatched, parity_env):
    """On the first minibatch the ratio is 1 and nothing clips: PPO's, GSPO-token's and CISPO's gradients are all
    -sum_t w_t A_t grad logprobs_t / N (here with TIS weights w_t from the shifted engine)."""
    grads = {}
    for variant in ("ppo", "gspo", "cispo"):
        grads[variant] = GradientRecorder()
        L.seed_everything(0)
        model = ppo_task(parity_env, task_class=mismatched, max_rollouts=1, policy_loss=variant,
                         correction={"low": 0.5, "high": 2.0})
        fit(model, prompts(2), -1, [grads[variant]])
    assert_same_grads(grads["ppo"], grads["gspo"])
    assert_same_grads(grads["ppo"], grads["cispo"])
    assert any(g.abs().max() > 0 for g in grads["ppo"].grads[0].values())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"policy_loss": "trpo"}, "model.policy_loss must be one of ppo, gspo, cispo, got 'trpo'"),
     ({"policy_loss": "gspo", "dual_clip": 3.0}, r"model.dual_clip=3.0 applies to model.policy_loss=ppo only"),
     ({"clip_low": -0.1}, "model.clip_low and model.clip_high must be >= 0, got -0.1, 0.2"),
     ({"correction": {"level": "batch"}}, "model.correction.level must be one of token, sequence, geometric"),
     ({"correction": {"mode": "clip"}}, "model.correction.mode must be one of truncate, mask, got 'clip'"),
     ({"correction": {"low": 2.0, "high": 2.0}}, r"model.correction.low=2.0 and model.correction.high=2.0 must "
                                                 r"satisfy 0 <= low < high")],
)
def test_bad_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ppo_task(ENV, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "correction"),
    [(["--model.policy_loss", "gspo", "--model.clip_low", "3e-4", "--model.clip_high", "4e-4",
       "--model.aggregation", "sequence_mean"], CorrectionConfig("geometric", "mask", 0.5, 2.0)),
     (["--model.policy_loss", "cispo", "--model.clip_low", "1.0", "--model.clip_high", "4.0"],
      CorrectionConfig("token", "mask", 0.5, 2.0)),
     (["--model.policy_loss", "ppo"], CorrectionConfig("sequence", "mask", 0.5, 2.0))],
    ids=["gspo-geometric-mask", "cispo-icepop", "ppo-sequence-mis"],
)
def test_variants_from_the_cli(variant, correction, mismatched, parity_env, workdir, capsys, monkeypatch):
    """The PPO recipe with a variant, a masking correction and the HF engine (critic-free, two rollouts): it runs,
    and each rollout's logged mismatch equals the pure functions'."""
    monkeypatch.setattr(sys, "argv", ["rl_lightning"])  # LightningCLI warns when pytest's own argv is present
    c = correction
    main(["fit", "--config", "recipes/ppo.yaml", "--model", "test_ppo_variants.MismatchedEngine", *variant,
          "--model.correction.level", c.level, "--model.correction.mode", c.mode, "--model.correction.low",
          str(c.low), "--model.correction.high", str(c.high), "--model.advantage_estimator", "grpo",
          "--model.kl.coef", "0", "--model.rollout.engine", "hf", "--model.rollout.env_path", parity_env, "--model.max_rollouts", "2",
          "--model.freeze_steps", "0", "--model.update_per_rollout", "1", "--model.rollout.max_new_tokens", "8",
          "--trainer.logger", "false", "--trainer.limit_val_batches", "0"])
    assert "finished: 2 rollouts" in capsys.readouterr().out
    assert len(MismatchedEngine.logged) == 2
    check_mismatch_metrics(correction, masked_somewhere=True)


# GSPO's sequence ratio and a sequence-level correction both need whole-sequence sums: under context parallelism each
# 32-token completion spans both shards, so a shard-local mean would change the clipping, the weights and the logs.
LAYOUT_TASK = {"policy_loss": "gspo", "aggregation": "sequence_mean", "clip_low": 0.05, "clip_high": 0.05,
               "update_per_rollout": 2, "correction": {"level": "geometric", "mode": "mask", "low": 0.5, "high": 2.0}}
LAYOUT_COMPARED = ("train/grad_norm", "train/clipped", "train/approx_kl", "train/policy_loss", "train/mismatch_masked",
                   "train/mismatch_kl")
SINGLE = []  # the single-process history, shared by the layouts


def _layout_run(env, dp=1, cp=1):
    L.seed_everything(0)
    model = ppo_task(env, task_class=MismatchedEngine, rollout={"max_new_tokens": 32},
                     optim={"lr": 2e-3, "max_grad_norm": 1.0}, max_length_per_device=256, max_rollouts=2,
                     **LAYOUT_TASK)
    metrics = Metrics(LAYOUT_COMPARED)
    strategy = {"strategy": ParallelStrategy(data_parallel_size=dp, context_parallel_size=cp)} if dp * cp > 1 else {}
    fit(model, prompts(4 // dp, shuffle=True), -1, [metrics], devices=dp * cp, **strategy)
    return metrics.history


def _layout_worker(rank, env, dp, cp, out_path):
    history = _layout_run(env, dp, cp)
    if rank == 0:
        torch.save(history, out_path)


LAYOUTS = {"dp2": (2, 1), "cp2": (1, 2)}


def _layouts_worker(rank, env, root):
    for name, (dp, cp) in LAYOUTS.items():  # both layouts in one spawned pair: each rank imports torch once
        print(f"rank {rank}: {name}", flush=True)  # in the group's failure output: which run it was on
        _layout_worker(rank, env, dp, cp, root / f"{name}.pt")


@pytest.fixture(scope="module")
def layout_runs(parity_env, tmp_path_factory):
    """``(root, error)``: ``root/<layout>.pt`` from `_layouts_worker`, and the pair's error if it failed."""
    root = tmp_path_factory.mktemp("layouts")
    try:
        run_on_cpu_ranks(_layouts_worker, 2, parity_env, root)
        error = None
    except Exception as e:  # noqa: BLE001 - kept for the tests, each fails naming it
        error = f"{type(e).__name__}: {e}"
    return root, error


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gspo_with_a_sequence_correction_is_layout_invariant(layout, parity_env, layout_runs):
    """GSPO-token with a geometric-mean sequence mask on the shifted engine: the data- and context-parallel runs log
    the single process's gradient norms, clipped fractions, losses and mismatch metrics."""
    if not SINGLE:
        SINGLE.extend(_layout_run(parity_env))
    root, error = layout_runs
    if not (root / f"{layout}.pt").exists():
        pytest.fail(f"{layout}: no output; the spawned pair failed: {error}")
    parallel = torch.load(root / f"{layout}.pt")
    assert len(parallel) == len(SINGLE) == 2 and set(parallel[0]) == set(LAYOUT_COMPARED)
    for step, (a, b) in enumerate(zip(parallel, SINGLE, strict=True)):
        for name in a:
            assert abs(a[name] - b[name]) < 1e-5, (step, name, parallel, SINGLE)
    # not vacuous: gradients flow, the second minibatches are off-policy, some trajectories are masked, some kept
    assert all(h["train/grad_norm"] > 0 and h["train/approx_kl"] > 1e-7 for h in SINGLE)
    assert all(0 < h["train/mismatch_masked"] < 1 for h in SINGLE)
