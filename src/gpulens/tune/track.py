"""A sweep's result into the user's tracker run: W&B or MLflow.

``log_to_tracker(result, run)`` with

* a W&B run (``wandb.init()``'s): summary keys ``tune/batch_size``, ``tune/num_workers``,
  ``tune/accumulation``, ``tune/samples_per_s``, ``tune/tokens_per_s``, ``tune/mfu_pct``,
  ``tune/speedup_pct``, ``tune/oom_batch``, ``tune/peak_reserved_gb``, ``tune/headroom_gb``
  (those that were measured), and ``tune/trials`` (a table of every trial) and ``tune/report``
  (the HTML report) in the run's pending row (``commit=False``: it takes no step of its own);
* an MLflow run (``mlflow.start_run()``'s, or ``mlflow.active_run()``): the same figures as
  params ``tune.<name>`` (the choice) and metrics ``tune_<name>``, and the artifacts
  ``gpulens_tune.json`` (every trial), ``gpulens_tune.html`` and ``gpulens_tune.md``.

Neither package is imported until this is called with its run.
"""

from __future__ import annotations

from typing import Any

from gpulens.tune.model import TuneResult
from gpulens.tune.report import COLUMNS, render_html, render_markdown, rows


def summary(result: TuneResult) -> dict[str, float | int]:
    """The choice and the figures behind it (absent when not measured)."""
    out: dict[str, float | int | None] = {}
    c = result.chosen
    if c is not None:
        out.update({
            "batch_size": c.config.batch_size, "num_workers": c.config.num_workers,
            "accumulation": c.config.accumulation, "samples_per_s": c.samples_per_s,
            "tokens_per_s": c.tokens_per_s, "mfu_pct": c.mfu_pct,
            "data_wait_pct": c.data_wait_pct, "peak_reserved_gb": c.peak_reserved_gb,
            "headroom_gb": c.headroom_gb,
        })
    out["speedup_pct"] = result.speedup_pct
    out["oom_batch"] = result.oom_batch
    out["trials"] = len(result.trials)
    return {k: v for k, v in out.items() if v is not None}


def log_to_tracker(result: TuneResult, run: Any) -> None:
    """Log ``result`` into ``run`` (module docstring); ``TypeError`` for another object."""
    kind = type(run).__module__.split(".")[0]
    if kind == "wandb":
        _wandb(result, run)
    elif kind == "mlflow":
        _mlflow(result, run)
    else:
        raise TypeError(f"gpulens tune: cannot log to a {type(run).__name__}: pass a W&B run "
                        "(wandb.init()) or an MLflow run (mlflow.start_run())")


def _wandb(result: TuneResult, run: Any) -> None:
    import wandb

    for key, value in summary(result).items():
        run.summary[f"tune/{key}"] = value
    table = wandb.Table(columns=list(COLUMNS), data=[list(r) for r in rows(result)])
    # into the run's pending row, not a row of its own: a committed row would take the step a
    # training logging with step=global_step from 0 then logs to, and W&B would drop its row
    run.log({"tune/trials": table, "tune/report": wandb.Html(render_html(result))},
            commit=False)


def _mlflow(result: TuneResult, run: Any) -> None:
    from mlflow import MlflowClient

    run_id = run.info.run_id
    client = MlflowClient()
    figures = summary(result)
    choice = ("batch_size", "num_workers", "accumulation")
    for key in choice:
        if key in figures:
            client.log_param(run_id, f"tune.{key}", figures[key])
    for key, value in figures.items():
        if key not in choice:
            client.log_metric(run_id, f"tune_{key}", float(value))
    client.log_dict(run_id, result.to_dict(), "gpulens_tune.json")
    client.log_text(run_id, render_html(result), "gpulens_tune.html")
    client.log_text(run_id, render_markdown(result), "gpulens_tune.md")
