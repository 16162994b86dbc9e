"""MFU as the rows carry it, against MFU by hand (issue 12's check on a real GPU).

An HF ``Trainer`` trains GPT-2 small (124M, built from its config: no download) in bf16 on one
GPU with :class:`gpulens.integrations.transformers.GPUMonitorCallback` (its defaults: tokens
counted by a forward hook, FLOPs from the config's formula, dtype from ``TrainingArguments``),
rows into a JSONL record.  By hand: the FLOPs of one training step counted by
``torch.utils.flop_counter.FlopCounterMode`` on the real model, divided by the step time that
CUDA events measure around the Trainer's steps (``on_step_begin`` -> ``on_step_end``, one
synchronisation at the end) and by the same datasheet peak the row names.  Prints both, and
runs ``examples/lightning_fit.py --model gpt2 --precision bf16-mixed`` to show that Lightning
writes the same keys.

    python benchmarks/mfu_rows_gpu.py                 # on a GPU; ~1.5 minutes
    python benchmarks/mfu_rows_gpu.py --quick         # CPU: tiny GPT-2, simulated GPU, plumbing

Prints a Markdown table; writes ``$OUT/mfu_rows.json`` (or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def rows_of(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    header: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "run_start":
            header = record
        elif "event" not in record:
            rows.append(record)
    return header, rows


def tensor_ratio(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """MFU against GPM's tensor-pipe activity, row by row: what ``perf/mfu_when_tensor_active_pct``
    is, including the rows the engine leaves it out of (over 100 %), with the SM clock beside
    (a datasheet peak is at its boost clock, 1830 MHz on an H100 SXM, below NVML's maximum).
    One GPU: ``gpu/0/``."""
    by_row = []
    for r in rows:
        mfu, active = r.get("perf/mfu_pct"), r.get("gpu/0/tensor_active_pct")
        if mfu is None or not active:
            continue
        by_row.append({"step": r.get("step"), "mfu_pct": mfu,
                       "mfu_clock_adjusted_pct": r.get("perf/mfu_clock_adjusted_pct"),
                       "tensor_active_pct": active, "sm_clock_mhz": r.get("gpu/0/sm_clock_mhz"),
                       "ratio_pct": 100.0 * mfu / active,
                       "in_row": "perf/mfu_when_tensor_active_pct" in r})
    ratios = [b["ratio_pct"] for b in by_row]
    return {"rows": len(by_row), "by_row": by_row,
            "median_pct": statistics.median(ratios) if ratios else None,
            "min_pct": min(ratios) if ratios else None,
            "max_pct": max(ratios) if ratios else None,
            "over_100": sum(x > 100.0 for x in ratios)}


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="CPU, tiny model, simulated GPU")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    from gpulens.integrations.transformers import GPUMonitorCallback

    cuda = torch.cuda.is_available() and not args.quick
    if args.quick:
        os.environ.setdefault("GPULENS_BACKEND", "simulated")
        os.environ.setdefault("GPULENS_SIMULATED_GPUS", "1")
        args.steps, args.logging_steps, args.batch, args.seq = 6, 2, 2, 64
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512,
                                         n_positions=128)
    else:
        if not cuda:
            print("no CUDA device: run with --quick on a CPU", file=sys.stderr)
            return 2
        config = transformers.GPT2Config()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (args.batch * (args.steps + 2), args.seq))

    class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": ids[i], "labels": ids[i],
                    "attention_mask": torch.ones_like(ids[i])}

    class StepTimer(transformers.TrainerCallback):  # type: ignore[misc]
        """CUDA events around each optimizer step; read once at the end."""

        def __init__(self) -> None:
            self.events: list[tuple[Any, Any]] = []

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self.events.append((e, None))

        def on_step_end(self, *a: Any, **k: Any) -> None:
            if cuda and self.events and self.events[-1][1] is None:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self.events[-1] = (self.events[-1][0], e)

    out = Path(tempfile.mkdtemp(prefix="gpulens-mfu-rows-"))
    record = out / "rows.jsonl"
    timer = StepTimer()
    targs = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=args.steps,
        logging_steps=args.logging_steps, per_device_train_batch_size=args.batch,
        bf16=cuda, use_cpu=not cuda, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=2 if cuda else 0, learning_rate=1e-4)
    trainer = transformers.Trainer(
        model=model, args=targs, train_dataset=Tokens(),
        callbacks=[GPUMonitorCallback(sinks=[f"jsonl:{record}"], interval=0.1), timer])
    trainer.train()

    # FLOPs of one training step on the real model, as FlopCounterMode counts them
    batch = {"input_ids": ids[: args.batch], "labels": ids[: args.batch],
             "attention_mask": torch.ones_like(ids[: args.batch])}
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    counter = FlopCounterMode(display=False)
    with counter, torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    flops_step = float(counter.get_total_flops())
    # MFU counts model FLOPs: FlopCounterMode also counts the attention backward's recompute of
    # the scores (one of the five equal-sized products of torch's SDPA backward count when the
    # query and value head sizes match, as in GPT-2), which is hardware work, not model work
    sdpa_bwd = sum(float(n) for op, n in counter.get_flop_counts().get("Global", {}).items()
                   if "scaled_dot_product" in str(op) and "backward" in str(op))
    flops_step_model = flops_step - sdpa_bwd / 5.0

    header, rows = rows_of(record)
    meta = header.get("meta", {})
    peak = meta.get("peak_tflops")
    if cuda:
        torch.cuda.synchronize()
        times = [b.elapsed_time(e) / 1000.0 for b, e in timer.events if e is not None]
        warm = times[len(times) // 4:]
        step_s = statistics.median(warm)
    else:
        step_s = statistics.median(r["perf/step_time_s"] for r in rows)
    by_hand = 100.0 * flops_step / step_s / 1e12 / peak if peak else None
    by_hand_model = 100.0 * flops_step_model / step_s / 1e12 / peak if peak else None
    later = rows[len(rows) // 4:] or rows
    row_mfu = [r["perf/mfu_pct"] for r in later if "perf/mfu_pct" in r]
    row_med = statistics.median(row_mfu) if row_mfu else None
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "meta": meta, "flops_step_flopcounter": flops_step, "step_s_cuda_events": step_s,
        "rows": len(rows), "row_mfu_pct_median": row_med, "mfu_pct_by_hand": by_hand,
        "flops_step_model": flops_step_model, "mfu_pct_by_hand_model_flops": by_hand_model,
        "row_keys": sorted(k for k in rows[-1] if k.startswith("perf/")) if rows else [],
        "row_step_time_s_median": statistics.median(r["perf/step_time_s"] for r in later)
        if later else None,
    }
    if row_med is not None and by_hand:
        result["rows_vs_by_hand"] = row_med / by_hand - 1
    result["tensor_ratio"] = tensor_ratio(rows)
    if row_med is not None and by_hand_model:
        result["rows_vs_by_hand_model_flops"] = row_med / by_hand_model - 1

    # Lightning writes the same keys
    lf = out / "lightning"
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    lcmd = [sys.executable, str(ROOT / "examples" / "lightning_fit.py"), "--model", "gpt2",
            "--max-steps", "30" if cuda else "6", "--log-every", "5" if cuda else "2",
            "--save-dir", str(lf), "--sink", f"jsonl:{lf / 'rows.jsonl'}"]
    if cuda:
        lcmd += ["--precision", "bf16-mixed"]
    done = subprocess.run(lcmd, env=env, capture_output=True, text=True, timeout=300)
    lrows = rows_of(lf / "rows.jsonl")[1] if (lf / "rows.jsonl").exists() else []
    result["lightning_exit"] = done.returncode
    result["lightning_perf_keys"] = sorted(k for k in lrows[-1] if k.startswith("perf/")) \
        if lrows else []
    result["lightning_mfu_pct_last"] = lrows[-1].get("perf/mfu_pct") if lrows else None

    print("| figure | value |\n|---|---|")
    for key in ("device", "flops_step_flopcounter", "step_s_cuda_events",
                "row_step_time_s_median", "row_mfu_pct_median", "mfu_pct_by_hand",
                "rows_vs_by_hand", "flops_step_model", "mfu_pct_by_hand_model_flops",
                "rows_vs_by_hand_model_flops", "lightning_exit", "lightning_mfu_pct_last"):
        print(f"| {key} | {result.get(key)} |")
    t = result["tensor_ratio"]
    if t["rows"]:
        print(f"\nMFU / GPM tensor activity, by row ({t['rows']} rows with both; the engine "
              f"writes perf/mfu_when_tensor_active_pct only where it is <= 100 %): median "
              f"{t['median_pct']:.1f} %, {t['min_pct']:.1f}-{t['max_pct']:.1f} %, "
              f"{t['over_100']} over 100 % (left out of the rows)")
        print("\n| step | MFU % | clock-adjusted MFU % | tensor active % | SM clock MHz | "
              "MFU / tensor active % | in the row |\n|---|---|---|---|---|---|---|")
        for r in t["by_row"]:
            print(f"| {r['step']} | {r['mfu_pct']:.2f} | {_num(r['mfu_clock_adjusted_pct'])} | "
                  f"{r['tensor_active_pct']:.2f} | {_num(r['sm_clock_mhz'])} | "
                  f"{r['ratio_pct']:.1f} | {'yes' if r['in_row'] else 'no'} |")
    print(f"\npeak: {meta.get('peak_gpu')} {meta.get('peak_dtype')} "
          f"{meta.get('peak_tflops')} TFLOP/s ({meta.get('peak_source')})")
    print(f"HF row perf keys: {result['row_keys']}")
    print(f"Lightning row perf keys: {result['lightning_perf_keys']}")
    target = args.json or (Path(os.environ["OUT"]) / "mfu_rows.json" if "OUT" in os.environ
                           else None)
    if target is not None:
        target.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
