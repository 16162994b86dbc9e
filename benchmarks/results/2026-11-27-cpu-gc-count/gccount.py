"""GC collections per step, HF Trainer with and without gpulens's callback (CPU, simulated)."""

import gc
import os
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("GPULENS_BACKEND", "simulated")
sys.path.insert(0, os.environ.get("GPULENS_SRC", "src"))

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.set_num_threads(1)
COUNTS: dict[int, list[float]] = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
STARTED: dict[str, float] = {}


def on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        STARTED["t"] = time.perf_counter()
    else:
        g = info["generation"]
        COUNTS[g][0] += 1
        COUNTS[g][1] += time.perf_counter() - STARTED["t"]


gc.callbacks.append(on_gc)
CFG = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
IDS = torch.randint(0, 512, (64, 64))


class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = IDS[i % 64]
        return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}


def run(with_gpulens: bool, steps: int) -> tuple[float, dict[int, tuple[int, float]]]:
    from gpulens.integrations.transformers import GPUMonitorCallback

    out = tempfile.mkdtemp()
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4,
                             logging_steps=1, report_to=[], save_strategy="no",
                             disable_tqdm=True, use_cpu=True)
    callbacks = ([GPUMonitorCallback(interval=0.1, sinks=[f"jsonl:{out}/g.jsonl"])]
                 if with_gpulens else [])
    trainer = Trainer(model=GPT2LMHeadModel(CFG), args=args, train_dataset=Rows(),
                      callbacks=callbacks)
    for g in COUNTS:
        COUNTS[g] = [0, 0.0]
    t0 = time.perf_counter()
    trainer.train()
    took = time.perf_counter() - t0
    return took, {g: (int(v[0]), round(v[1] * 1e3, 1)) for g, v in COUNTS.items()}


STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 300
for rnd in range(3):
    for arm in (False, True):
        took, stats = run(arm, STEPS)
        print(f"round {rnd} gpulens={arm}: {took / STEPS * 1e3:.2f} ms/step; "
              f"gc per gen (count, ms total): {stats}", flush=True)
