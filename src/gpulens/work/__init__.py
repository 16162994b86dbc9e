"""Work, throughput and MFU: the pure core (no engine, no vendor import at module level).

* :mod:`.flops` — analytic model FLOPs from a Hugging Face config or plain dimensions;
* :mod:`.counter` — the measured fallback (``FlopCounterMode`` on the meta device);
* :mod:`.peaks` — dense peak FLOP/s per GPU and dtype, each with its vendor citation;
* :mod:`.precision` — the run's compute dtype (torch dtype, TrainingArguments, Lightning);
* :mod:`.mfu` — the ``perf/*`` keys of one window (tokens/s, TFLOP/s, MFU, tokens per joule);
* :mod:`.hf` — what a Hugging Face integration calls (model FLOPs, real tokens per step).

``docs/mfu.md`` says how each number is made and which pitfalls of other tools it avoids.
"""
