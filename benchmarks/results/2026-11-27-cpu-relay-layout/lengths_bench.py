"""CPU of summing a take's sequence lengths on the host (tokens and the FLOPs formula): in
Python over the list, or with torch on the host tensor, for 16 to 4,096 lengths (a batch's
sequences times its accumulation steps).

    PYTHONPATH=src python benchmarks/results/2026-11-27-cpu-relay-layout/lengths_bench.py
"""
import time

import torch
import transformers

from gpulens.work.flops import formula_from_config
from gpulens.work.hf import TokenCounter

cfg = transformers.LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                               intermediate_size=512, vocab_size=1000)
formula = formula_from_config(cfg)
assert formula is not None
counter = TokenCounter(formula, "causal")
for n in (16, 64, 128, 256, 1024, 4096):
    lens = torch.randint(100, 1024, (n,))
    t0 = time.thread_time()
    for _ in range(200):
        values = lens.tolist()
        sum(values)
        formula.training_flops(values, "causal")
    py = (time.thread_time() - t0) / 200 * 1e6
    t0 = time.thread_time()
    for _ in range(200):
        lens.sum()
        counter._flops_of_lengths(lens)
    th = (time.thread_time() - t0) / 200 * 1e6
    print(f"{n:5d} lengths: Python {py:7.1f} us, torch on the host {th:6.1f} us")
