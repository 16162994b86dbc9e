"""What the Hugging Face callback's own work costs a step, with its monitor running throughout:
short stretches of steps with and without that work, alternated within ONE training run
(issue 18).

``paths_aa.py`` compares whole arms (gpulens started and stopped with each block of ~25 steps)
and needs 50-200 rounds of ~3 s blocks to resolve +-0.3 pp, because a block's mean moves by about
1 pp from block to block. This script asks a narrower question at a finer grain: the monitor
(its engine process, its NVML reads) runs for the whole ``train()``; only what the callback does
on the training thread is switched, per *segment* of ``--segment`` optimizer steps:

``on``     every hook of ``GPUMonitorCallback`` (the phase marks: a CUDA event each; the token
           counter's forward pre-hook; its after-forward hook, where the attention masks are
           summed and a held row is written; ``on_log``'s row), as in a user's run;
``off``    none of it: the hooks return at once (HF still calls them), no row is written;
``off_b``  the same again: the A/A segment.

A round is the three segments in a balanced, seeded order (``paired.round_order``). A segment's
value is the mean GPU time of its steps (CUDA events recorded at each ``on_step_end``, as
``paths.py``'s ``Clock``), its first ``--skip`` steps left out (a row held at the previous
segment's last log is written in the next ``on`` segment's first step; the switch itself). Per
round: ``on`` minus ``off`` and ``off_b`` minus ``off`` in percentage points of ``off``; their
means with 95 % bootstrap intervals (``paired.py``). The A/A line is the design's own noise.

Also printed, from the ``on`` segments: the host time spent inside each gpulens hook per step
(``perf_counter`` around each; the forward hooks included), and nested in them the phase marks
(``_mark``: a CUDA event each on a GPU; ``record``: the event's record alone, inside a mark),
so a cost on the GPU's timeline can be set beside the host time that causes it.
``--host-marks`` times the phases on the host clock instead (no CUDA event): the hooks' time
without the events. ``--settings JSON`` changes the monitor's settings for the whole run (what
the ``on`` segments' rows make the engine do: ``{"backend": "simulated"}`` reads no NVML).

    python benchmarks/step_work_ab.py --log-every 1 --budget-s 150 --json out.json  # one GPU
    python benchmarks/step_work_ab.py --quick --rounds 3                            # CPU smoke
    torchrun --nproc-per-node 2 benchmarks/step_work_ab.py --rounds 12 --batch 19   # DDP

Compare two trees by running the script against each tree's ``src`` (``PYTHONPATH``), one after
the other on one warm machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead_gpu as og  # the model and its warm-up
import paired
import paths

SEGMENTS = ("on", "off", "off_b")


class Gate:
    """Whether the current step's segment runs gpulens's hooks, and the host time they took."""

    def __init__(self, segment: int, rounds: int, warmup: int, seed: int, skip: int = 1) -> None:
        self.segment, self.warmup, self.skip = segment, warmup, skip
        self.order = [paired.round_order(SEGMENTS, seed, r) for r in range(rounds)]
        self.on = True  # the warm-up runs every hook
        self.counting = False
        self.host_s: dict[str, float] = {}
        self.on_steps = 0
        self.in_mark = False

    @property
    def total_steps(self) -> int:
        return self.warmup + len(self.order) * len(SEGMENTS) * self.segment

    def kind_of(self, step: int) -> str | None:
        """The segment kind of optimizer step ``step`` (1-based); ``None`` in the warm-up."""
        k = step - self.warmup - 1
        if k < 0:
            return None
        seg = k // self.segment
        rnd, pos = divmod(seg, len(SEGMENTS))
        return self.order[rnd][pos] if rnd < len(self.order) else None

    def begin_step(self, step: int) -> None:
        kind = self.kind_of(step)
        self.on = kind in (None, "on")
        # timed: an `on` segment's steps after its first --skip (the warm-up's first calls,
        # and a row held across the `off` segments, written at the next `on` segment's first
        # log, are not a step's usual work; the GPU times skip them too)
        self.counting = kind == "on" and (step - self.warmup - 1) % self.segment >= self.skip
        if self.counting:
            self.on_steps += 1

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` run only while the gate is on, its host time added to ``name``'s."""
        def run(*args: Any, **kwargs: Any) -> Any:
            if name == "record":  # only inside a mark, never skipped
                if not self.in_mark:
                    return fn(*args, **kwargs)
            elif not self.on:
                return None
            if name == "_mark":
                self.in_mark = True
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.counting:
                    self.host_s[name] = self.host_s.get(name, 0.0) + time.perf_counter() - t0
                if name == "_mark":
                    self.in_mark = False
        return run


@contextlib.contextmanager
def gated_library(gate: Gate) -> Iterator[None]:
    """The token counter's per-batch hook and the session's after-forward work, gated and timed
    (patched on their classes for the run)."""
    from gpulens.integrations import session as session_mod
    from gpulens.integrations.phases import StepPhases
    from gpulens.work.hf import TokenCounter

    saved = [(TokenCounter, "observe", TokenCounter.observe),
             (StepPhases, "_mark", StepPhases._mark)]
    if hasattr(session_mod.TrainingSession, "_busy_device"):
        saved.append((session_mod.TrainingSession, "_busy_device",
                      session_mod.TrainingSession._busy_device))
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        # the CUDA event record alone, inside a mark (the benchmark's own clock records too:
        # only records made while a mark runs count)
        saved.append((torch.cuda.Event, "record", torch.cuda.Event.record))
    try:
        for owner, name, fn in saved:
            setattr(owner, name, gate.timed(name, fn))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def make_callbacks(gate: Gate, inner: Any, clock: paths.Clock) -> list[Any]:
    from transformers import TrainerCallback

    per_step = ("on_step_begin", "on_pre_optimizer_step", "on_substep_end", "on_step_end",
                "on_log", "on_epoch_begin", "on_prediction_step", "on_evaluate", "on_save")
    for name in per_step:
        setattr(inner, name, gate.timed(name, getattr(inner, name)))

    class Switch(TrainerCallback):  # type: ignore[misc]
        """First in the list: decides each step's segment before gpulens's hooks run."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            gate.begin_step(int(state.global_step) + 1)

    class Stamp(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: Any, **kw: Any) -> None:
            clock.stamp()

    return [Switch(), inner, Stamp()]


def train(s: og.Setup, hf: paths.HfPath, gate: Gate, clock: paths.Clock, out: Path,
          host_marks: bool = False, monitor: dict[str, Any] | None = None) -> None:
    import copy

    from transformers import PrinterCallback, Trainer, TrainingArguments

    from gpulens.integrations.transformers import GPUMonitorCallback

    cuda = s.device.type == "cuda"
    targs = TrainingArguments(
        output_dir=str(out), max_steps=gate.total_steps, per_device_train_batch_size=s.batch_size,
        logging_steps=hf.log_every, report_to=[], save_strategy="no", eval_strategy="no",
        optim="adamw_torch_fused" if cuda else "adamw_torch", learning_rate=1e-4,
        lr_scheduler_type="constant", warmup_steps=0, dataloader_num_workers=0,
        dataloader_pin_memory=cuda, disable_tqdm=True, use_cpu=not cuda, seed=0, bf16=False)
    model = copy.deepcopy(s.model)
    model.register_forward_pre_hook(lambda *_: clock.forward_begins())
    inner = GPUMonitorCallback(interval=hf.interval)
    if monitor:  # the monitor's own settings changed for the whole run (e.g. no NVML read)
        import dataclasses

        inner.settings = dataclasses.replace(inner.settings, **monitor)
    if host_marks:  # the phases on the host clock: the hooks' time without a CUDA event
        from gpulens.integrations.phases import StepPhases

        inner._phases = lambda device: StepPhases(cuda=False)
    trainer = Trainer(model=model, args=targs, train_dataset=hf.dataset(gate.total_steps),
                      callbacks=make_callbacks(gate, inner, clock))
    trainer.remove_callback(PrinterCallback)  # a line a log on stdout: not the report
    with gated_library(gate):
        trainer.train()


def analyse(gate: Gate, clock: paths.Clock, skip: int) -> dict[str, Any]:
    times, _ = clock.steps(1)  # times[i]: step i + 2 (stamp i + 1 minus stamp i)
    by_step = {i + 2: t for i, t in enumerate(times)}
    per_round: dict[str, dict[int, float]] = {k: {} for k in SEGMENTS}
    split: dict[str, dict[int, tuple[float, float]]] = {k: {} for k in SEGMENTS}
    for rnd, kinds in enumerate(gate.order):
        for pos, kind in enumerate(kinds):
            first = gate.warmup + (rnd * len(SEGMENTS) + pos) * gate.segment + 1
            steps = range(first + skip, first + gate.segment)
            vals = [by_step[k] for k in steps if k in by_step]
            parts = [p for p in (clock.split(k - 2) for k in steps) if p is not None]
            if vals:
                per_round[kind][rnd] = statistics.fmean(vals)
            if parts:
                split[kind][rnd] = (statistics.fmean(p[0] for p in parts),
                                    statistics.fmean(p[1] for p in parts))
    base = per_round["off"]
    out: dict[str, Any] = {"rounds": len(base),
                           "step_ms": statistics.fmean(base.values()) * 1e3 if base else math.nan}
    for kind in ("on", "off_b"):
        est = paired.Estimate.of(paired.per_round_pp(per_round[kind], base))
        out[f"{kind}_minus_off"] = est.as_dict()
        for j, part in enumerate(("gap", "busy")):
            diffs = {r: (split[kind][r][j] - split["off"][r][j]) * 1e3
                     for r in split[kind] if r in split["off"]}
            m, lo, hi = paired.mean_ci(list(diffs.values()))
            out[f"{kind}_minus_off_{part}_ms"] = {"mean": m, "ci95": [lo, hi]}
    steps = max(1, gate.on_steps)
    out["host_us_per_on_step"] = {k: v / steps * 1e6 for k, v in sorted(gate.host_s.items())}
    out["per_round_s"] = {k: {str(r): v for r, v in d.items()} for k, d in per_round.items()}
    # every step's GPU time (s) by step number, and each step's segment kind: the noise's
    # structure (outlier steps or drift) can be read afterwards, e.g. a median per segment
    out["per_step_s"] = {str(k): v for k, v in sorted(by_step.items())}
    out["kind_of_step"] = {str(k): gate.kind_of(k) for k in sorted(by_step)}
    return out


def report(res: dict[str, Any], meta: dict[str, Any]) -> str:
    def line(name: str, key: str) -> str:
        e = res[key]
        lo, hi = e["ci95_pp"]
        gap, busy = res[f"{key}_gap_ms"], res[f"{key}_busy_ms"]
        return (f"| {name} | {e['mean_pp']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {e['sd_pp']:.2f} | "
                f"{gap['mean']:+.3f} [{gap['ci95'][0]:+.3f}, {gap['ci95'][1]:+.3f}] | "
                f"{busy['mean']:+.3f} [{busy['ci95'][0]:+.3f}, {busy['ci95'][1]:+.3f}] |")
    host = res["host_us_per_on_step"]
    rows = "\n".join(f"| `{k}` | {v:.1f} |" for k, v in host.items())
    return "\n".join([
        f"# The HF callback's own work, segments of {meta['segment']} steps "
        f"(logging every {meta['log_every']})", "",
        f"gpulens {meta['gpulens']}; {meta['device']} (rank {meta['rank']} of "
        f"{meta['world_size']}); batch {meta['batch']} x {meta['seq']}; "
        f"{res['rounds']} rounds; `off` step {res['step_ms']:.2f} ms; the first {meta['skip']} "
        f"step(s) of each segment left out.", "",
        "| segment minus `off` | pp of the step, 95 % | SD a round | gap (ms) | busy part (ms) |",
        "|---|---|---|---|---|",
        line("`on` (every hook)", "on_minus_off"),
        line("`off_b` (A/A)", "off_b_minus_off"), "",
        f"Host time inside gpulens per `on` step (us, total {sum(host.values()):.1f}; hooks "
        "nest: `_busy_device` runs inside the forward and the marks):", "",
        "| hook | us a step |", "|---|---|", rows, ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--segment", type=int, default=10, help="optimizer steps a segment")
    p.add_argument("--skip", type=int, default=1, help="first steps of a segment left out")
    p.add_argument("--rounds", type=int, default=None, help="default: as --budget-s allows")
    p.add_argument("--budget-s", type=float, default=120.0)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--target-ms", type=float, default=120.0)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seed", type=int, default=None,
                   help="the segment orders' seed (default: drawn afresh, recorded)")
    p.add_argument("--quick", action="store_true", help="a tiny model on the CPU")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--host-marks", action="store_true",
                   help="phase marks on the host clock (no CUDA event): what the events cost")
    p.add_argument("--settings", default="{}",
                   help='the monitor\'s settings for the whole run, JSON: {"driver_samples": '
                        'false}, {"backend": "simulated"} (no NVML read at all)')
    args = p.parse_args(argv)
    if args.segment % args.log_every:
        p.error("--segment must be a multiple of --log-every (a log in every segment)")

    import os

    import gpulens

    paths.bench_options_from_env()
    og.quiet_libraries()
    if args.quick:
        os.environ["GPULENS_BACKEND"] = "simulated"
        os.environ.setdefault("GPULENS_SIMULATED_GPUS", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rank, device = 0, None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: HF's DDP, each rank its GPU
        if args.rounds is None or args.batch is None:
            p.error("under torchrun give --rounds and --batch (every rank runs the same)")
        import torch
        import torch.distributed as dist

        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available() and not args.quick
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if cuda else "gloo")
        device = f"cuda:{local}" if cuda else "cpu"
        if args.seed is None:  # every rank the same: rank 0's draw
            box = [paired.fresh_seed()]
            dist.broadcast_object_list(box, src=0)
            args.seed = box[0]
    if args.seed is None:
        args.seed = paired.fresh_seed()
    s = og.setup(args.quick, args.target_ms, args.batch, None, device)
    step_s = og.time_steps(s, 3)
    fits = max(2, int(args.budget_s / (step_s * 1.1 * args.segment * 3)))
    rounds = args.rounds or paired.whole_designs(fits, fits, len(SEGMENTS))
    with tempfile.TemporaryDirectory() as tmp:
        hf = paths.HfPath(s, Path(tmp), args.log_every, [], args.interval)
        gate = Gate(args.segment, rounds, args.warmup, args.seed, args.skip)
        clock = paths.Clock(s.device.type == "cuda")
        og.log(f"{rounds} rounds of 3 segments x {args.segment} steps, ~{step_s * 1e3:.0f} ms "
               "a step")
        train(s, hf, gate, clock, Path(tmp) / "hf", args.host_marks, json.loads(args.settings))
    res = analyse(gate, clock, args.skip)
    meta = {"gpulens": gpulens.__file__, "device": str(s.device), "rank": rank,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")), "batch": s.batch_size,
            "seq": s.seq_len, "segment": args.segment, "skip": args.skip,
            "log_every": args.log_every, "seed": args.seed, "host_marks": args.host_marks,
            "monitor": args.settings,
            "hardware": og.hardware(s), "versions": og.versions()}
    print(report(res, meta))
    if args.json is not None:
        out = args.json if rank == 0 else args.json.with_name(
            f"{args.json.stem}.rank{rank}{args.json.suffix}")
        out.write_text(json.dumps({"meta": meta, "result": res}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
