"""Framework integrations on top of :class:`gpulens.Monitor`.

Each submodule imports its framework when it is imported, never before, so ``import gpulens``
stays light:

* :mod:`gpulens.integrations.transformers`: ``GPUMonitorCallback`` for the Hugging Face ``Trainer``.
* :mod:`gpulens.integrations.lightning`: ``GPUMonitorCallback`` for ``lightning.pytorch``.
* :mod:`gpulens.integrations.pytorch_lightning`: the same callback for the standalone
  ``pytorch_lightning`` package (its ``Callback`` class is a different class).
* :mod:`gpulens.integrations.hydra`: ``from_config(cfg)`` and the ``gpu_monitor`` structured config.
* :mod:`gpulens.integrations.verl`: ``MergingLogger``, GPU rows beside a trainer's own
  ``logger.log(data, step)`` calls (verl's ``Tracking``, an ``Accelerator``, ...).
* :mod:`gpulens.integrations.accelerate`: ``attach(accelerator)``, GPU rows into the trackers an
  Accelerate ``Accelerator`` started, on the user's ``accelerator.log`` steps.

The callbacks only translate hooks into ``Monitor.start`` / ``log`` / ``stop`` and time the
phases of a step with :class:`gpulens.integrations.phases.StepPhases`.
"""
