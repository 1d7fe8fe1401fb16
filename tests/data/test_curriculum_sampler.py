"""The prompt curriculum's sampler (`rl_lightning.data.curriculum.PromptCurriculum`): the walk, parking and
re-admission, the fill when too few prompts are active, its checkpointed state, and data-parallel agreement under
real gloo ranks. The pool maths is in tests/algorithms/test_curriculum_state.py; the end-to-end resume in
tests/tasks/test_curriculum_resume.py."""

import io
import types

import pytest
import torch
import torch.multiprocessing as mp
from helpers import run_on_cpu_ranks

from rl_lightning.data.curriculum import CurriculumConfig, PromptCurriculum
from rl_lightning.errors import ConfigError
from rl_lightning.parallel.reductions import Groups

ONE_PROCESS = Groups()


def _observe(curriculum, rates: dict[int, float], group: int = 4) -> dict[str, float]:
    """Report a rollout in which prompt i's `group` completions pass at rate `rates[i]` (reward 1 passes, 0 fails)."""
    index, rewards = [], []
    for i, rate in rates.items():
        passed = round(rate * group)
        index += [i] * group
        rewards += [1.0] * passed + [0.0] * (group - passed)
    return curriculum.observe(ONE_PROCESS, index, rewards)


def test_without_observations_the_draws_walk_the_seeded_permutations():
    """10 prompts, 3 per rollout: rollouts 1-3 are the first pass's first 9 prompts in order; rollout 4 takes the
    10th and the first two of the second pass that are not the 10th."""
    curriculum = PromptCurriculum(CurriculumConfig(), 10, seed=5)
    first, second = curriculum._walk(0)[0], curriculum._walk(1)[0]
    draws = [curriculum.draw(3) for _ in range(4)]
    assert sorted(first) == list(range(10)) and first != second
    assert [i for d in draws[:3] for i in d] == first[:9]
    taken = [i for i in second if i != first[9]][:2]  # a prompt already in the batch is passed over
    assert draws[3] == [first[9], *taken]
    assert curriculum.passes == 1 and curriculum.cursor == second.index(taken[-1]) + 1
    assert curriculum.draws.sum() == 12 and curriculum.draws.max() == 2


def test_before_any_observation_the_curriculum_draws_the_plain_loaders_first_epoch():
    """The walk's first pass is the permutation the plain prompt loader shuffles its first epoch with (the same seed),
    so a run with and without the curriculum sample the same prompts until the curriculum has seen them."""
    from rl_lightning.data.prompts import Prompt, PromptBatches

    prompts = [Prompt([], [], None, f"row {i}", i) for i in range(12)]
    plain = [[p.index for p in batch] for batch in PromptBatches(prompts, 3, 0, 1, shuffle=True, seed=42)]
    curriculum = PromptCurriculum(CurriculumConfig(), 12, seed=42)
    assert [curriculum.draw(3) for _ in range(4)] == plain
    other = [[p.index for p in batch] for batch in PromptBatches(prompts, 3, 0, 1, shuffle=True, seed=43)]
    assert other != plain  # the order follows the run's seed


def test_solved_and_hopeless_prompts_are_skipped_until_readmitted():
    """Prompts 0-2 solved (rate 1), 3-5 hopeless (0), 6-7 half-solved: with readmit_after 3 the next two rollouts
    draw only 6 and 7 (plus the unseen 8, 9); from the third rollout on the parked ones are active again."""
    curriculum = PromptCurriculum(CurriculumConfig(readmit_after=3), 10, seed=0)
    metrics = _observe(curriculum, {0: 1, 1: 1, 2: 1, 3: 0, 4: 0, 5: 0, 6: 0.5, 7: 0.5})
    assert metrics["curriculum/active"] == 4 and metrics["curriculum/solved"] == 3
    assert metrics["curriculum/hopeless"] == 3 and metrics["curriculum/unseen"] == 2
    assert [metrics[f"curriculum/pass_rate/{b}"] for b in ("0", "0-25", "25-50", "50-75", "75-100", "100")] == [
        3, 0, 2, 0, 0, 3]  # prompts 6 and 7: 0.5 falls in (.25, .5]
    for _ in range(2):  # rollouts 1 and 2 (observed at rollout 0): 2 and 1 rollouts since, fewer than 3
        drawn = curriculum.draw(2)
        assert set(drawn) <= {6, 7, 8, 9}
        _observe(curriculum, dict.fromkeys(drawn, 0.5))
    assert (curriculum.pools() == 0).all()  # 3 rollouts after rollout 0: everything active again


def test_parked_weight_keeps_exactly_the_parked_prompts_whose_coin_falls_under_it():
    """40 prompts, every fourth hopeless: the walk keeps every active prompt and the parked ones whose coin (the pass's
    seeded uniform draw at their position) is below parked_weight, in walk order (25 of them: fewer than the 30
    active, so no parked prompt is brought back to fill the batch)."""
    curriculum = PromptCurriculum(CurriculumConfig(parked_weight=0.3, readmit_after=None), 40, seed=1)
    _observe(curriculum, {i: 0.0 if i % 4 == 0 else 0.5 for i in range(40)})
    order, coins = curriculum._walk(0)
    expected = [i for i, coin in zip(order, coins, strict=True) if i % 4 or coin < 0.3][:25]
    assert any(i % 4 == 0 for i in expected)  # some parked prompts kept
    assert curriculum.draw(25) == expected and curriculum.cursor == order.index(expected[-1]) + 1


def test_too_few_active_prompts_bring_back_the_longest_parked_first():
    """6 prompts: 0-4 parked for good (0, 1 seen at rollout 0; 2, 3, 4 at rollout 1), 5 active. A rollout of 3 takes
    5 and the two parked prompts seen longest ago, 0 and 1 (ties by index)."""
    curriculum = PromptCurriculum(CurriculumConfig(readmit_after=None), 6, seed=2)
    _observe(curriculum, {0: 1, 1: 0})
    _observe(curriculum, {2: 1, 3: 0, 4: 1, 5: 0.5})
    assert sorted(curriculum.draw(3)) == [0, 1, 5]


def _run(curriculum, rollouts: int) -> list[list[int]]:
    """Draw and observe `rollouts` rollouts of 3 prompts with a deterministic made-up pass rate per (prompt, draw)."""
    drawn = []
    for _ in range(rollouts):
        batch = curriculum.draw(3)
        drawn.append(batch)
        _observe(curriculum, {i: [0.0, 0.25, 1.0, 0.5][(i + int(curriculum.draws[i])) % 4] for i in batch})
    return drawn


@pytest.mark.parametrize("decay", [0.0, 0.5])
def test_state_dict_round_trip_continues_the_same_draws(decay):
    """A curriculum saved after 7 rollouts (through torch.save, as in a checkpoint) and loaded into a fresh one
    continues with the draws and the state of the uninterrupted one, bit for bit."""
    config = CurriculumConfig(decay=decay, readmit_after=4, parked_weight=0.1)
    straight = PromptCurriculum(config, 12, seed=7)
    expected = _run(straight, 15)
    first = PromptCurriculum(config, 12, seed=7)
    before = _run(first, 7)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = PromptCurriculum(config, 12, seed=7)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert before + _run(resumed, 8) == expected
    for key, value in straight.state_dict().items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(resumed.state_dict()[key])), key


def test_a_checkpoint_of_other_data_is_one_line():
    state = PromptCurriculum(CurriculumConfig(), 12, seed=0).state_dict()
    with pytest.raises(ConfigError) as info:
        PromptCurriculum(CurriculumConfig(), 10, seed=0).load_state_dict(state)
    assert str(info.value) == ("the checkpoint's data.curriculum tracks 12 training prompts, data.path has 10: resume "
                               "with the same data (or data.curriculum: null)")


@pytest.mark.parametrize("settings, message", [
    ({"decay": 1.0}, "data.curriculum.decay must be in [0, 1), got 1.0"),
    ({"solved_at": 0.5, "hopeless_at": 0.5},
     "data.curriculum needs 0 <= hopeless_at < solved_at <= 1, got hopeless_at=0.5, solved_at=0.5"),
    ({"readmit_after": 0}, "data.curriculum.readmit_after must be >= 1 rollouts or null (never), got 0"),
    ({"parked_weight": -0.1}, "data.curriculum.parked_weight must be in [0, 1], got -0.1"),
])
def test_bad_settings_are_one_line(settings, message):
    with pytest.raises(ConfigError) as info:
        CurriculumConfig(**settings)
    assert str(info.value) == message


def _two_ranks(rank, results):
    """Rank 0 saw prompts 0 (2 of 4 pass) and 1 (4 of 4); rank 1 prompt 0 again (0 of 4) and 2 (0 of 4)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    groups = Groups(dp_rank=rank, dp_size=2, dp_group=dist.group.WORLD)
    curriculum = PromptCurriculum(CurriculumConfig(), 6, seed=0)
    index, rewards = {0: ([0] * 4 + [1] * 4, [1, 1, 0, 0] + [1] * 4), 1: ([0] * 4 + [2] * 4, [0.0] * 8)}[rank]
    metrics = curriculum.observe(groups, index, rewards)
    results[rank] = (metrics, curriculum.pass_rates.tolist(), curriculum.draw(4))


def test_data_parallel_ranks_pool_their_counts_and_draw_alike():
    """Prompt 0's rate pools both ranks' completions, (2 + 0) / (4 + 4) = 0.25; prompt 1 is solved, 2 hopeless; both
    ranks hold the same state and draw the same prompts."""
    with mp.Manager() as manager:
        results = manager.dict()
        run_on_cpu_ranks(_two_ranks, 2, results)
        results = dict(results)
    assert results[0] == results[1]
    metrics, rates, _ = results[0]
    assert rates[:3] == [0.25, 1.0, 0.0]
    assert (metrics["curriculum/solved"], metrics["curriculum/hopeless"], metrics["curriculum/active"]) == (1, 1, 4)


def test_the_run_plots_draw_the_pools_and_the_histogram():
    """An RL run that logged curriculum metrics gets the curriculum panel, with every pool and histogram bin."""
    from rl_lightning.tracking.plots import matching, panels_for

    names = ["train/rollouts", "train/reward", *_observe(PromptCurriculum(CurriculumConfig(), 4, seed=0), {0: 1})]
    panels, _ = panels_for(names)
    (panel,) = [p for p in panels if p.name == "curriculum"]
    assert matching(panel.lines, names) == ["curriculum/active", "curriculum/solved", "curriculum/hopeless",
                                            *sorted(n for n in names if n.startswith("curriculum/pass_rate/"))]
    assert "curriculum" not in [p.name for p in panels_for(["train/rollouts", "train/reward"])[0]]


@pytest.mark.parametrize("task, message", [
    (types.SimpleNamespace(), "data.curriculum needs a task that samples groups of completions per prompt (model: "
                              "rl_lightning.tasks.PPO), got SimpleNamespace; set data.curriculum: null"),
    (types.SimpleNamespace(rollout_config=types.SimpleNamespace(responses_per_prompt=8, async_steps=1)),
     "data.curriculum draws each rollout's prompts from the previous rollout's pass rates, but "
     "model.rollout.async_steps=1 reads them ahead; set async_steps: 0 or data.curriculum: null"),
])
def test_tasks_the_curriculum_cannot_serve_are_one_line(task, message):
    """(responses_per_prompt 1 and SFT go through the real CLI in tests/tasks/test_curriculum_resume.py.)"""
    from rl_lightning.data.curriculum import check_curriculum_task

    with pytest.raises(ConfigError) as info:
        check_curriculum_task(task)
    assert str(info.value) == message
