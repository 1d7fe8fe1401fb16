"""What a run leaves in MLflow beyond metrics.

The run's marks and system metrics (`mlflow_run`), its lineage and logged/registered model (`lineage`), and the Hugging
Face export with its model card (`export`).

Callbacks a recipe or the CLI adds. May import models, parallel, rollout and below; never tasks or cli.
"""
