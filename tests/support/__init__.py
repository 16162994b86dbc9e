"""Helpers for gpulens' own tests: a real MLflow server on loopback, and a reader for the
``.wandb`` files of offline W&B runs. Not part of the installed package."""
