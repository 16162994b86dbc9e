"""The engine: sources -> sampler -> windows -> step logger (+ rules, work) -> sinks.

It runs in a process of gpulens's own (:mod:`gpulens.transport.process`), or, as a fallback,
in a thread of the training process (:mod:`gpulens.transport.inproc`).  Nothing here imports
the client (:mod:`gpulens.monitor`).
"""
