"""The live web dashboard: a page of per-step charts that follows a run as it goes.

One HTTP port serves three things (:class:`DashboardServer`):

* ``/`` the page: an HTML file with its own style and code beside it (``/page.css``,
  ``/chart.js``, ``/page.js``; charts drawn on canvases by that code; no CDN, nothing
  fetched from elsewhere);
* ``/events`` a stream of server-sent events: the run's context (GPU names, backend), the
  history kept so far, then every new row and event as it arrives;
* ``/metrics`` Prometheus's text format, when the server was given a metrics provider
  (``gpulens serve``); 404 otherwise.

Reach it from a training (``Monitor(sinks=["dashboard:8765"])``, see
:class:`gpulens.sinks.dashboard.DashboardSink`), around a command
(``gpulens record --sink dashboard:8765 -- python train.py``) or for the whole node
(``gpulens serve``).  It binds 127.0.0.1 unless told otherwise.
"""

from gpulens.dashboard.server import (
    DEFAULT_HISTORY_ROWS,
    DEFAULT_PORT,
    DashboardServer,
    DashboardStats,
    PortInUse,
)

__all__ = [
    "DEFAULT_HISTORY_ROWS",
    "DEFAULT_PORT",
    "DashboardServer",
    "DashboardStats",
    "PortInUse",
]
