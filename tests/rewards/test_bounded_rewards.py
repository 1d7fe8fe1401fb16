"""Bounded work per completion (issue 36.6): hostile answers finish in well under a second and score 0, an
infinite loop on a row of many test cases costs one total budget and scores as failed, and the example tools answer
arithmetic errors instead of raising."""

import time

import pytest
from conftest import REPO

from rl_lightning.envs.environment import load_environment
from rl_lightning.rewards import isolation
from rl_lightning.rewards.code import TOTAL_TIMEOUT_S, code_reward
from rl_lightning.rewards.math import answers_match, math_reward
from rl_lightning.rewards.tags import think_answer_reward
from rl_lightning.rollout.config import RolloutConfig

needs_bwrap = pytest.mark.skipif(isolation.isolation_level() != "bwrap",
                                 reason=f"no bubblewrap isolation on this machine; {isolation.INSTALL_HINT}")


def _said(text):
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


HOSTILE = {
    "huge-exponent": r"\boxed{1e10000000}",
    "huge-negative-exponent": r"\boxed{1e-10000000}",
    "exponent-of-100k-digits": r"\boxed{1e" + "9" * 100_000 + "}",
    "100k-digit-integer": r"\boxed{" + "7" * 100_000 + "}",
    "100k-digit-decimal": "1." + "3" * 100_000,
    "100k-digit-fraction": r"\boxed{\frac{" + "1" * 100_000 + "}{" + "3" * 100_000 + "}}",
    "100k-digit-ratio": "7/" + "9" * 100_000,
    "nested-fractions": r"\boxed{" + r"\frac{1}{" * 5000 + "2" + "}" * 5000 + "}",
    "tower": r"\boxed{10**10**10}",
    "factorial": r"\boxed{100000000!}",
    "many-boxes": r"\boxed{1e999999}" * 20_000,
}


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_answers_score_zero_in_well_under_a_second(text):
    start = time.perf_counter()
    assert math_reward(_said(text), "42") == 0.0
    assert think_answer_reward(_said(f"<think>x</think><answer>{text}</answer>"), "42") == 0.1
    assert time.perf_counter() - start < 0.5


def test_honest_answers_still_match_within_the_caps():
    assert math_reward(_said(r"so \boxed{1.5e3}"), "1500") == 1.0
    assert math_reward(_said("The answer is 1,000."), 1000) == 1.0
    assert answers_match(r"\frac{2000}{2}", "1000") and answers_match("-1/2", "-0.5") and answers_match(".5", "0.5")
    assert answers_match("3.14159265358979323846", "3.14159265358979323846") and not answers_match("3.14", "3.15")
    assert answers_match("1e999", "1" + "0" * 999) and answers_match("5e-1000", "0.5e-999")  # at the caps
    assert not answers_match("1e1001", "1E1001") and answers_match("1e1001", "1e1001")  # beyond the cap: as text
    assert answers_match("2e-3", 0.002) and answers_match("1e+20", 1e20)


def test_code_budget_defaults_below_the_reward_timeout():
    assert TOTAL_TIMEOUT_S < RolloutConfig.__dataclass_fields__["reward_timeout_s"].default


@needs_bwrap
def test_an_infinite_loop_on_many_test_cases_costs_one_budget_and_scores_zero():
    """12 cases at the default 5 s each would be 60 s (the reward timeout: the run stopped); with a 2 s budget the
    call returns 0 in about 2 s, and an honest program still passes every case."""
    cases = [{"input": str(n), "output": str(n * n)} for n in range(12)]
    start = time.monotonic()
    assert code_reward(_said("```python\nwhile True:\n    pass\n```"), cases, total_timeout_s=2.0) == 0.0
    assert time.monotonic() - start < 4.5
    honest = "```python\nn = int(input())\nprint(n * n)\n```"
    assert code_reward(_said(honest), cases) == 1.0
    with pytest.raises(ValueError, match="total_timeout_s must be > 0"):
        code_reward(_said(honest), cases, total_timeout_s=0)


@pytest.mark.parametrize(("expression", "reply"), [
    ("*".join(["99999999"] * 40), "error: a number beyond 1e+15 (the calculator's limit)"),  # OverflowError before
    ("1e308 * 10", "error: a number beyond 1e+15 (the calculator's limit)"),  # inf before
    ("10 / (5 - 5)", "error: division by zero"),
    ("2 ** 10 ** 10", "error: only numbers, + - * / and parentheses are allowed"),
    ("1 + " * 400 + "1", "error: the expression is longer than 1000 characters"),
    ("12 * (3 + 4)", "84"),
])
def test_calculator_answers_arithmetic_errors_as_tool_results(expression, reply):
    calculator = load_environment(str(REPO / "examples" / "calculator" / "env.py"))
    said = [{"role": "assistant", "content": f"<calc>{expression}</calc>"}]
    assert calculator.interact_all([(said, "row 1")]) == [[{"role": "tool", "content": reply}]]
