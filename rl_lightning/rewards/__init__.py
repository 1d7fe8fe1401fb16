"""Built-in reward functions (``reward_fn(messages, answer) -> float``) and the sandbox that runs model-written code.

May import: data, models.
"""
