"""A small OpenEnv (``openenv-core`` 0.3) environment, run in-process, for
``model.rollout.env_path: openenv:rl_lightning/recipes/envs/openenv_arithmetic.py`` (`rl_lightning.envs.adapters`).

An addition quiz: ``reset(a=1, b=9)`` asks "What is 1 + 9?"; each step reads the completion's last number, and a
wrong one gets feedback and another try (up to `MAX_TRIES`; with ``model.rollout.max_turns`` > 1 the feedback comes
back as a user turn). Its rubric is a weighted sum of two rubrics, logged as ``train/reward/correct`` and
``train/reward/bare_number``. Rows: ``python -m rl_lightning.envs.adapters
openenv:rl_lightning/recipes/envs/openenv_arithmetic.py rows.jsonl --resets '[{"a": 1, "b": 9}, {"a": 2, "b": 5}]'``.
"""

import re
import uuid

from openenv.core.env_server import Action, Environment, Observation, State
from openenv.core.rubrics import Rubric, WeightedSum

NUMBER = re.compile(r"-?\d+")
MAX_TRIES = 3


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    feedback: str = ""


class Correct(Rubric):
    def __init__(self, game: "ArithmeticGame") -> None:
        super().__init__()
        object.__setattr__(self, "game", game)  # not a child rubric

    def forward(self, action: GuessAction, observation: GuessObservation) -> float:
        numbers = NUMBER.findall(action.message)
        # at most 30 characters: int() of a 10k-digit model output would raise (and cost time)
        return float(bool(numbers) and len(numbers[-1]) <= 30 and int(numbers[-1]) == self.game.answer)


class BareNumber(Rubric):
    def forward(self, action: GuessAction, observation: GuessObservation) -> float:
        return float(NUMBER.fullmatch(action.message.strip()) is not None)


class ArithmeticGame(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # all state is per instance: a server may hold one per session

    def __init__(self) -> None:
        super().__init__(rubric=WeightedSum([Correct(self), BareNumber()], weights=[0.8, 0.2]))
        self.answer, self._state = 0, State()

    def reset(self, seed=None, episode_id=None, a: int = 0, b: int = 0, **kwargs) -> GuessObservation:
        self._reset_rubric()
        self.answer, self._state = a + b, State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return GuessObservation(feedback=f"What is {a} + {b}?")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        observation = GuessObservation()
        observation.reward = self._apply_rubric(action, observation)
        solved = self.rubric.rubric_0.last_score == 1.0
        observation.done = solved or self._state.step_count >= MAX_TRIES
        observation.feedback = "Correct." if solved else "Not quite. Check your sum and answer again."
        return observation

    @property
    def state(self) -> State:
        return self._state
