"""Check gpulens.work's MFU on a real GPU before it is wired into the engine (issue 12).

Trains GPT-2 small (124M, built from its config: no download) in bf16 autocast on one GPU and
prints, for the same measured steps:

* the model FLOPs per step from gpulens's formula and from ``FlopCounterMode`` on the real
  model on the GPU (one counted step), and from gpulens's meta-device counter;
* MFU by hand (``FlopCounterMode`` FLOPs / measured step time / the peak) against
  ``gpulens.work.mfu.window_perf`` fed with the formula (the issue asks for 3 %);
* the peak gpulens picked for this GPU (name, memory, default power limit from NVML) and why;
* that ``TokenCounter.observe`` on a GPU batch never synchronises the device
  (``torch.cuda.set_sync_debug_mode("error")`` around it) and what it costs per micro-batch.

Step time comes from CUDA events over ``--steps`` steps after a warm-up, one sync at the end.

    python benchmarks/mfu_check_gpu.py                 # on a GPU; ~1 minute
    python benchmarks/mfu_check_gpu.py --quick         # CPU: tiny GPT-2, no peak, the plumbing

Prints a Markdown table; writes ``$OUT/mfu_check.json`` (or ``--json PATH``).
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


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def nvml_facts(index: int) -> dict[str, Any]:
    """Name, memory (GB), default power limit (W) and max SM clock (MHz) of one GPU."""
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(h)
        facts: dict[str, Any] = {"name": name if isinstance(name, str) else name.decode()}
        facts["memory_gb"] = pynvml.nvmlDeviceGetMemoryInfo(h).total / 1e9
        for key, call in (
            ("default_power_limit_w",
             lambda: pynvml.nvmlDeviceGetPowerManagementDefaultLimit(h) / 1000.0),
            ("enforced_power_limit_w", lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0),
            ("max_sm_clock_mhz",
             lambda: float(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM))),
        ):
            try:
                facts[key] = call()
            except pynvml.NVMLError as exc:
                facts[key] = None
                log(f"NVML {key}: {exc}")
        return facts
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="CPU, tiny model, a few steps")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    from gpulens.work.hf import TokenCounter, model_flops
    from gpulens.work.mfu import window_perf
    from gpulens.work.peaks import identify_gpu, peak_for

    cuda = torch.cuda.is_available() and not args.quick
    if args.quick:
        args.steps, args.warmup, args.batch, args.seq = 3, 1, 2, 64
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512,
                                         n_positions=128, bos_token_id=0, eos_token_id=0)
    else:
        if not cuda:
            log("no CUDA device: run with --quick on a CPU")
            return 2
        config = transformers.GPT2Config()  # GPT-2 small, 124M
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)

    def step() -> None:
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # FLOPs: formula, FlopCounterMode on the real model, the meta-device counter.
    formula = model_flops(model)
    assert formula is not None
    flops_formula = formula.training_flops([args.seq] * args.batch)
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    flops_counted = float(counter.get_total_flops())
    from gpulens.work import hf

    measured = hf._measure(model, model.config)
    flops_meta = measured.training_flops([args.seq] * args.batch)
    log(f"flops/step formula {flops_formula:.4e}  FlopCounterMode {flops_counted:.4e}  "
        f"meta counter {flops_meta:.4e}")

    # Step time.
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            step()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000.0
    else:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        seconds = time.perf_counter() - t0
    step_s = seconds / args.steps
    tokens = args.batch * args.seq * args.steps

    # The peak.
    facts: dict[str, Any] = {}
    peak = None
    if cuda:
        facts = nvml_facts(torch.cuda.current_device())
        found = identify_gpu(facts["name"], memory_gb=facts["memory_gb"],
                             power_limit_w=facts["default_power_limit_w"])
        facts["identified_as"] = found.gpu or None
        facts["why_not"] = found.reason or None
        peak = peak_for(facts["name"], "bf16", memory_gb=facts["memory_gb"],
                        power_limit_w=facts["default_power_limit_w"])
    peak_tflops = peak.tflops if peak is not None else None

    perf = window_perf(seconds=seconds, gpus=1, tokens=tokens,
                       flops_per_token=flops_formula / (args.batch * args.seq),
                       peak_tflops=peak_tflops, max_sm_clock_mhz=facts.get("max_sm_clock_mhz"))
    mfu_by_hand = (100.0 * flops_counted / step_s / 1e12 / peak_tflops
                   if peak_tflops else None)

    # TokenCounter on the device: no synchronisation, cost per micro-batch.
    tc = TokenCounter(formula)
    mask = torch.ones_like(ids)
    mask[:, args.seq - args.seq // 4:] = 0
    pos = torch.arange(args.seq, device=device).repeat(args.batch, 1)
    costs: list[float] = []
    sync_checked = False
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        sync_checked = True
    try:
        for _ in range(50):
            t = time.perf_counter()
            tc.observe({"input_ids": ids, "attention_mask": mask})
            tc.observe({"input_ids": ids, "position_ids": pos})
            costs.append((time.perf_counter() - t) / 2 * 1e6)
        work = tc.take()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    tokens_counted = int(work.tokens)  # reading it syncs: outside the checked region
    expected_tokens = 50 * (args.batch * (args.seq - args.seq // 4) + args.batch * args.seq)

    result = {
        "device": facts.get("name", "cpu"), "facts": facts,
        "peak": peak.describe() if peak is not None else None,
        "batch": args.batch, "seq": args.seq, "steps": args.steps, "step_s": step_s,
        "flops_formula": flops_formula, "flops_flopcounter": flops_counted,
        "flops_meta_counter": flops_meta,
        "formula_vs_flopcounter": flops_formula / flops_counted - 1,
        "mfu_pct_gpulens": perf.get("perf/mfu_pct"), "mfu_pct_by_hand": mfu_by_hand,
        "perf": perf, "token_counter_sync_checked": sync_checked,
        "token_counter_us_per_microbatch_median": statistics.median(costs),
        "token_counter_tokens_ok": tokens_counted == expected_tokens,
    }
    if result["mfu_pct_gpulens"] is not None and mfu_by_hand:
        result["mfu_gpulens_vs_by_hand"] = result["mfu_pct_gpulens"] / mfu_by_hand - 1

    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    print("| figure | value |")
    print("|---|---|")
    for key in ("device", "step_s", "flops_formula", "flops_flopcounter", "flops_meta_counter",
                "formula_vs_flopcounter", "mfu_pct_gpulens", "mfu_pct_by_hand",
                "mfu_gpulens_vs_by_hand", "token_counter_sync_checked",
                "token_counter_us_per_microbatch_median", "token_counter_tokens_ok"):
        print(f"| {key} | {fmt(result.get(key))} |")
    print(f"| peak | {result['peak']} |")
    print(f"| identified as | {facts.get('identified_as')} (why not: {facts.get('why_not')}) |")
    print(f"| perf keys | {', '.join(f'{k}={v:.4g}' for k, v in perf.items())} |")
    out = args.json or Path(os.environ.get("OUT", ".")) / "mfu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
