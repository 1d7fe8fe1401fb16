"""What a run leaves in MLflow beyond metrics.

The CLI's MLflow logger, one step axis and counters only when they move (`logger`), the run's marks and system
metrics (`mlflow_run`), its lineage and logged/registered model (`lineage`), its pictures
(`plots`, from the metric history: `history`), and the Hugging Face export (`export`) with its model card
(`model_card`).

Callbacks a recipe or the CLI adds.

May import: engines, parallel, models, memory, assets, compat.
"""
