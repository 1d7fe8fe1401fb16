"""Third-party internals in one place: one module per library, each a few named functions over its private names.

Nothing outside this package touches a leading-underscore name of jsonargparse/argparse, Lightning, MLflow,
transformers, vLLM or torch (tests/house/test_architecture.py checks the source); each module is pinned by
tests/compat/test_<library>.py, which names the private name and the version range tested when a release changes it.
The modules import their library lazily, inside the functions, so importing one costs nothing.

May import: nothing of ours.
"""
