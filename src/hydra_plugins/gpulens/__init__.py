"""Hydra finds this module when it scans the ``hydra_plugins`` namespace package for plugins and
imports it; importing it registers gpulens' ``gpu_monitor`` config group, so that any Hydra app
accepts ``+gpu_monitor=default`` (see :mod:`gpulens.integrations.hydra`).

``hydra_plugins`` itself has no ``__init__.py``: it is a namespace package shared with other
projects' Hydra plugins.
"""

from gpulens.integrations.hydra import register_configs

register_configs()
