"""Hugging Face Trainer with GPU telemetry beside the loss: one callback.

    python examples/hf_trainer.py                          # rows in OUTPUT_DIR/gpulens.jsonl
    python examples/hf_trainer.py --report-to wandb        # rows in HF's own W&B run
    python examples/hf_trainer.py --report-to mlflow       # rows in HF's own MLflow run
    torchrun --nproc_per_node 2 examples/hf_trainer.py     # one row per log for both ranks

A two-layer GPT-2 is built from a config in code (nothing is downloaded) and trained on random
tokens. Without a GPU the monitor samples simulated GPUs (``GPULENS_BACKEND=simulated``).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gpulens.integrations.transformers import GPUMonitorCallback


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``size`` sequences of ``length`` random token ids; the labels are the inputs."""

    def __init__(self, size: int, length: int, vocab: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (size, length), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default=None, help="default: a new temporary folder")
    p.add_argument("--report-to", default="none", help="none, wandb, mlflow or 'wandb,mlflow'")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--sink", action="append", default=[],
                   help="extra gpulens sink, e.g. jsonl:runs/gpu.jsonl (repeatable)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between GPU samples")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        os.environ.setdefault("GPULENS_BACKEND", "simulated")
        # one simulated GPU per process of the node (torchrun sets LOCAL_WORLD_SIZE)
        os.environ.setdefault("GPULENS_SIMULATED_GPUS", os.environ.get("LOCAL_WORLD_SIZE", "1"))

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="gpulens-hf-")
    report_to = [r for r in args.report_to.split(",") if r and r != "none"] or "none"
    training_args = TrainingArguments(
        output_dir=output_dir,
        max_steps=args.max_steps,
        logging_steps=args.logging_steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=1e-3,
        report_to=report_to,
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=RandomTokens(512, 32, config.vocab_size),
        callbacks=[GPUMonitorCallback(sinks=args.sink, interval=args.interval)],
    )
    trainer.train()
    if training_args.process_index == 0:
        print(f"gpulens: rows written for {output_dir} (report_to={report_to})")
    # Under torchrun the Trainer set up torch.distributed (gloo on CPU). Take it down in this
    # order: first free the trainer, whose DDP model holds the process group from C++ (DDP's
    # Reducer), then destroy the group. Freed the other way round, the Reducer drops the
    # group's last reference with the GIL held and gloo's destructor joins a worker thread that
    # may still need the GIL to release the tensors of the last all-gather (the Trainer's own
    # at the end of train()): the process hangs at exit (docs/design-notes.md, "DDP exit").
    del trainer, model
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
