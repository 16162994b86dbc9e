"""A saved W&B view, "GPU beside loss": the loss beside line plots that draw every GPU of a
metric on one chart, built with W&B's own workspace API (``wandb-workspaces``, Apache-2.0).

W&B's automatic workspace makes one panel per key, so a GPU metric of an 8-GPU job is 8
panels.  This view puts, in one pinned section on top:

* the loss (``train/loss`` on ``gpulens/step`` by default: what :class:`gpulens.Monitor`
  writes; ``loss="train/loss", loss_x="train/global_step"`` for Hugging Face's ``Trainer``);
* one line plot per headline GPU metric with a line for every GPU (``gpu/{i}/sm_active_pct``,
  ``util_pct``, ``mem_used_gb``, ``power_w``, ``temp_c``, ``tensor_active_pct``; x-axis
  ``gpulens/step``, so the same step numbers as the loss);
* the job's throughput and MFU (``train/tokens_per_s``, ``train/mfu_pct``), once logged;

and, in a closed section below, the other per-GPU figures (clocks, throttling, energy, memory
share, DRAM bandwidth).  The per-GPU keys are logged by :class:`gpulens.sinks.wandb.WandbSink`
in its default key set, hidden from the automatic panels, so only this view draws them.

Which GPUs: ``gpus=N`` lists ``gpu/0 .. gpu/N-1`` on each chart; without it each chart selects
its keys with a regular expression (``^gpu/\\d+/power_w$``), so runs of any size fit.

Building the view needs no login and makes no network call (:func:`gpu_beside_loss` returns the
``wandb_workspaces.workspaces.Workspace``; ``workspace._to_model()`` is what would be saved).
Saving it (``workspace.save()``, or ``python -m gpulens.integrations.wandb_workspace --entity
E --project P``) needs a W&B login (``wandb login`` or ``WANDB_API_KEY``) with write access to
the project, and creates a new saved view there; the project's default workspace is left
as it is.  Install: ``pip install 'gpulens[wandb-workspace]'``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

AXIS = "gpulens/step"
"""The x-axis of every key :class:`~gpulens.sinks.wandb.WandbSink` writes."""

VIEW_NAME = "GPU beside loss"
MAIN_SECTION = "GPU beside loss"
DETAIL_SECTION = "GPU detail (every GPU)"

MAIN_METRICS: tuple[tuple[str, str], ...] = (
    ("sm_active_pct", "SM active % (GPM), every GPU"),
    ("util_pct", "GPU utilization % (NVML), every GPU"),
    ("mem_used_gb", "Memory used (GB), every GPU"),
    ("power_w", "Power (W), every GPU"),
    ("temp_c", "Temperature (C), every GPU"),
    ("tensor_active_pct", "Tensor cores active % (GPM), every GPU"),
)
"""Per-GPU metrics of the pinned section: (schema suffix, chart title)."""

JOB_METRICS: tuple[tuple[str, str], ...] = (
    ("tokens_per_s", "Throughput (tokens/s, job)"),
    ("mfu_pct", "MFU % (job)"),
)
"""Job-level figures of the pinned section: (name in the tracker view, chart title)."""

DETAIL_METRICS: tuple[tuple[str, str], ...] = (
    ("sm_clock_mhz", "SM clock (MHz)"),
    ("throttle_pct", "Clocks held down (% of window)"),
    ("energy_j", "Energy per window (J)"),
    ("mem_pct", "Memory used (% of total)"),
    ("dram_bw_pct", "DRAM bandwidth (% of max, GPM)"),
    ("sm_occupancy_pct", "SM occupancy % (GPM)"),
)
"""Per-GPU metrics of the closed detail section."""


def import_workspaces() -> tuple[Any, Any]:
    """``(wandb_workspaces.workspaces, wandb_workspaces.reports.v2)``, or an ``ImportError``
    with the install hint."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as exc:
        raise ImportError("the W&B saved view needs wandb-workspaces: pip install "
                          "'gpulens[wandb-workspace]'") from exc
    return ws, wr


def gpu_series(suffix: str, gpus: int | None) -> dict[str, Any]:
    """The ``LinePlot`` arguments that put every GPU's ``gpu/{i}/{suffix}`` on one chart."""
    if gpus is None:
        return {"y": [], "metric_regex": rf"^gpu/\d+/{re.escape(suffix)}$"}
    return {"y": [f"gpu/{i}/{suffix}" for i in range(gpus)]}


def gpu_beside_loss(entity: str, project: str, *, name: str = VIEW_NAME,
                    loss: str = "train/loss", loss_x: str = AXIS, section: str = "train",
                    gpus: int | None = None) -> Any:
    """The "GPU beside loss" view (module docstring) as a ``wandb_workspaces`` ``Workspace``,
    not saved.

    Args:
        entity, project: where the view would be saved.
        name: the view's name.
        loss: the loss key; ``loss_x`` its x-axis (``"train/global_step"`` for Hugging Face,
            ``"Step"`` for a loss logged with W&B's own step).
        section: the section of the tracker view's job figures (``"train"``: ``train/mfu_pct``;
            ``""``: bare ``mfu_pct``), as given to the W&B sink.
        gpus: the number of GPUs to list on each chart; ``None``: every GPU, by pattern.
    """
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise ValueError(f"gpus must be a whole number >= 1, got {gpus!r}")
    ws, wr = import_workspaces()
    prefix = f"{section}/" if section else ""
    main: list[Any] = [wr.LinePlot(title=f"Loss ({loss})", x=loss_x, y=[loss])]
    for suffix, title in MAIN_METRICS:
        main.append(wr.LinePlot(title=title, x=AXIS, **gpu_series(suffix, gpus)))
    for key, title in JOB_METRICS:
        main.append(wr.LinePlot(title=title, x=AXIS, y=[prefix + key]))
    detail = [wr.LinePlot(title=title, x=AXIS, **gpu_series(suffix, gpus))
              for suffix, title in DETAIL_METRICS]
    columns = 3
    return ws.Workspace(
        name=name, entity=entity, project=project,
        sections=[
            ws.Section(name=MAIN_SECTION, panels=main, is_open=True, pinned=True,
                       layout_settings=ws.SectionLayoutSettings(
                           columns=columns, rows=-(-len(main) // columns))),
            ws.Section(name=DETAIL_SECTION, panels=detail, is_open=False,
                       layout_settings=ws.SectionLayoutSettings(
                           columns=columns, rows=-(-len(detail) // columns))),
        ],
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpulens.integrations.wandb_workspace --entity E --project P``: save the view
    (needs a W&B login); ``--print`` shows what would be saved instead, offline."""
    parser = argparse.ArgumentParser(
        prog="python -m gpulens.integrations.wandb_workspace",
        description="Save the 'GPU beside loss' view into a W&B project (needs a W&B login).")
    parser.add_argument("--entity", required=True, help="W&B entity (user or team)")
    parser.add_argument("--project", required=True, help="W&B project")
    parser.add_argument("--name", default=VIEW_NAME, help="the view's name")
    parser.add_argument("--loss", default="train/loss", help="the loss key (train/loss)")
    parser.add_argument("--loss-x", default=AXIS,
                        help="the loss's x-axis (gpulens/step; train/global_step for HF)")
    parser.add_argument("--section", default="train",
                        help="section of the job figures, as given to the wandb sink")
    parser.add_argument("--gpus", type=int, default=None,
                        help="list GPUs 0..N-1 on each chart (default: every GPU, by pattern)")
    parser.add_argument("--print", action="store_true", dest="show",
                        help="print the view that would be saved (JSON), save nothing")
    args = parser.parse_args(argv)
    try:
        view = gpu_beside_loss(args.entity, args.project, name=args.name, loss=args.loss,
                               loss_x=args.loss_x, section=args.section, gpus=args.gpus)
    except (ImportError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.show:
        print(view._to_model().model_dump_json(by_alias=True, exclude_none=True, indent=1))
        return 0
    try:
        view.save()
    except Exception as exc:  # no login, no access: W&B's message, on one line
        text = " ".join(str(exc).split())[:400]
        print(f"error: could not save the view to W&B ({type(exc).__name__}: {text}); a W&B "
              "login with write access to the project is needed (wandb login)", file=sys.stderr)
        return 1
    print(f"saved the view {args.name!r}: {view.url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
