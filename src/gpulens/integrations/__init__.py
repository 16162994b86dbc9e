"""Framework integrations on top of :class:`gpulens.Monitor`.

Each submodule imports its framework when it is imported, never before, so ``import gpulens``
stays light:

* :mod:`gpulens.integrations.transformers`: ``GPUMonitorCallback`` for the Hugging Face ``Trainer``.
* :mod:`gpulens.integrations.lightning`: ``GPUMonitorCallback`` for ``lightning.pytorch``.
* :mod:`gpulens.integrations.pytorch_lightning`: the same callback for the standalone
  ``pytorch_lightning`` package (its ``Callback`` class is a different class).
* :mod:`gpulens.integrations.hydra`: ``from_config(cfg)`` and the ``gpu_monitor`` structured config.
* :mod:`gpulens.integrations.verl`: hand finished rows back to a trainer's own tracking logger.

The callbacks only translate hooks into ``Monitor.start`` / ``log`` / ``stop`` and time the
phases of a step with :class:`gpulens.integrations.phases.StepPhases`.
"""
