"""The seam between the client (:class:`gpulens.Monitor`) and the engine: one message protocol,
carried by a pipe to a process of gpulens's own (the product) or, as a fallback, in-process.
"""
