"""Issue 13's GPU check of the advice rules: which rules fire on real training, judged by the
rule engine on the rows gpulens writes.

Three runs on one GPU, each a plain PyTorch loop with ``gpulens.Monitor(interval=0.1)`` (rows to
JSONL, one row per step) and the step anatomy on the GPU's timeline (``StepPhases(cuda=True)``):

``bf16``      GPT-2 small (124M, built in code from ``GPT2Config``, bf16 weights, fused AdamW),
              batches from a ``DataLoader`` over token ids in memory: the healthy run, where
              no rule should fire;
``slow_data`` the same with a slow ``__getitem__`` (``--delay-ms`` per sample, no workers): the
              input-bound rule should fire within 20 steps;
``fp32_mm``   a loop of fp32 matrix products with TF32 off, in a run declared bf16: the
              low-tensor-core-use rule should fire (GPUs with GPM: Hopper and newer).

After each run the rows are read back and fed to ``RuleEngine(RulesConfig(dtype="bf16",
gpus=context.gpus))``; the script prints a Markdown table (per run: steps, median step time,
data wait, SM and tensor activity, power against the limit, power-cap throttling, the rules that
fired and at which step) and leaves the rows and every event under ``--out`` (``$OUT`` on the
device machine).  Once the engine runs the rules itself, the same events should be in the rows.

    python benchmarks/rules_gpu.py --out "$OUT"          # one GPU, about 2 minutes
    python benchmarks/rules_gpu.py --quick --out /tmp/x  # CPU, tiny model, simulated GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import gpulens
from gpulens.integrations.phases import StepPhases


def gpt2(torch: Any, quick: bool, device: Any) -> tuple[Any, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    if quick:
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=512,
                         bos_token_id=0, eos_token_id=0)
    else:
        cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    cfg.use_cache = False
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(device=device, dtype=torch.bfloat16)
    model.train()
    return model, cfg


class Tokens:
    """Random token sequences in memory; ``delay_s`` of sleep per sample (a slow loader)."""

    def __init__(self, torch: Any, n: int, seq: int, vocab: int, delay_s: float) -> None:
        self.data = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))
        self.delay_s = delay_s

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def __getitem__(self, i: int) -> Any:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.data[i]


def run(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    rows_path = out / f"{name}.rows.jsonl"
    rows_path.unlink(missing_ok=True)
    phases = StepPhases(cuda=cuda)
    steps = args.steps
    if name == "fp32_mm":
        torch.backends.cuda.matmul.allow_tf32 = False
        n = 256 if args.quick else 8192
        a = torch.randn(n, n, device=device)
        b = torch.randn(n, n, device=device)
        with gpulens.Monitor(interval=0.1, sinks=[f"jsonl:{rows_path}"], dtype="bf16") as mon:
            for step in range(1, steps + 1):
                phases.step_begin()
                for _ in range(args.matmuls):
                    c = a @ b
                phases.step_end()
                mon.log(step, loss=float(c[0, 0].item()), **phases.collect(1))
                phases.resume()
            context = mon.context
    else:
        model, cfg = gpt2(torch, args.quick, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
        seq = 64 if args.quick else args.seq
        delay = args.delay_ms / 1000 if name == "slow_data" else 0.0
        data = Tokens(torch, 4096, seq, cfg.vocab_size, delay)
        loader = torch.utils.data.DataLoader(
            data, batch_size=args.batch, shuffle=True, drop_last=True,
            num_workers=0 if name == "slow_data" or args.quick else 2,
            pin_memory=cuda, persistent_workers=name != "slow_data" and not args.quick)
        batches = iter(loader)
        with gpulens.Monitor(interval=0.1, sinks=[f"jsonl:{rows_path}"], dtype="bf16") as mon:
            phases.resume()
            for step in range(1, steps + 1):
                try:
                    x = next(batches)
                except StopIteration:
                    batches = iter(loader)
                    x = next(batches)
                x = x.to(device, non_blocking=True)
                phases.step_begin()
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                phases.before_optimizer()
                opt.step()
                opt.zero_grad(set_to_none=True)
                phases.step_end()
                mon.log(step, loss=loss.item(), **phases.collect(1))
                phases.resume()
            context = mon.context
    assert context is not None
    # the engine's own verdicts, as the record keeps them (event lines beside the rows)
    lines = [json.loads(line) for line in rows_path.read_text().splitlines()]
    rows = [r for r in lines if "event" not in r]
    events = [e for e in lines if e.get("event") in ("alert", "notice")]
    with (out / f"{name}.events.jsonl").open("w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")

    def med(key: str) -> float | None:
        xs = [r[key] for r in rows[5:] if key in r]
        return statistics.median(xs) if xs else None

    fired: dict[str, int] = {}
    for e in events:
        if e["event"] == "alert" and e["state"] == "firing":
            fired.setdefault(e["name"], e["step"])
    return {"run": name, "steps": len(rows), "step_s": med("perf/step_time_s"),
            "data_wait_pct": med("perf/data_wait_pct"), "sm_pct": med("gpu/0/sm_active_pct"),
            "tensor_pct": med("gpu/0/tensor_active_pct"), "util_pct": med("gpu/0/util_pct"),
            "power_w": med("gpu/0/power_w"), "limit_w": med("gpu/0/power_limit_w"),
            "throttle_power_pct": med("gpu/0/throttle_power_pct"),
            "headroom_pct": (None if med("gpu/0/mem_pct") is None
                             else 100 - (med("gpu/0/mem_pct") or 0.0)),
            "fired": fired, "gpu": context.gpus[0].name if context.gpus else "none",
            "events": events}


def fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "rules-gpu-out"))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--delay-ms", type=float, default=10.0,
                    help="sleep per sample in the slow_data run (x batch per step)")
    ap.add_argument("--matmuls", type=int, default=4, help="fp32 matmuls per step (fp32_mm)")
    ap.add_argument("--runs", default="bf16,slow_data,fp32_mm")
    ap.add_argument("--quick", action="store_true", help="CPU, tiny model, simulated GPU")
    args = ap.parse_args(argv)
    if args.quick:
        os.environ.setdefault("GPULENS_BACKEND", "simulated")
        os.environ.setdefault("GPULENS_SIMULATED_GPUS", "1")
        args.steps = min(args.steps, 30)
        args.batch = min(args.batch, 4)
        import torch

        torch.set_num_threads(1)  # a tiny model: more threads only contend on a small machine
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.runs.split(","):
        t0 = time.monotonic()
        results.append(run(name, args, out))
        print(f"# {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"# Advice rules on real runs ({results[0]['gpu']}; "
          f"{'quick, simulated GPU' if args.quick else 'GPT-2 small bf16'})\n")
    print("| run | rows | step s | data wait % | SM % | tensor % | util % | power W / limit | "
          "power-cap % | rules fired (first step) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        fired = ", ".join(f"{k} ({v})" for k, v in r["fired"].items()) or "none"
        print(f"| {r['run']} | {r['steps']} | {fmt(r['step_s'], 3)} | "
              f"{fmt(r['data_wait_pct'])} | {fmt(r['sm_pct'])} | {fmt(r['tensor_pct'])} | "
              f"{fmt(r['util_pct'])} | {fmt(r['power_w'], 0)} / {fmt(r['limit_w'], 0)} | "
              f"{fmt(r['throttle_power_pct'])} | {fired} |")
    print()
    for r in results:
        for e in r["events"]:
            print(f"- {r['run']} step {e['step']} {e['event']} {e['name']} {e['state']}: "
                  f"{e['message']}")
    (out / "rules_gpu.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
