"""Memory: the plan that says whether a run fits before it loads, and what a run does when it does not.

- `model_shape`: a model's parameter and activation shape from its config alone; `activations`: what a training
  forward saves per token and layer (lean forwards included); `plan`: the predicted peak per device, phase by phase;
  `fit`: the settings that would make a run fit;
- `phases`: each phase's measured peak, and giving freed host memory back; `backoff`: halving the token budget after
  an out-of-memory error.

May import: assets.
"""
