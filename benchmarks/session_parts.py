"""Which part of a framework callback's per-step work costs a step that syncs every step?
(issue 18)

The Hugging Face ``Trainer`` logging every step is the one user path whose cost stayed above
its A/A arm (about +0.5 pp on an H200), and its own per-round noise (2-3 pp) is too wide to take
it apart. This runs the same parts on a plain loop over the same GPT-2-small-sized model
(``overhead_gpu.py``; a forward with an all-ones attention mask, ``loss.item()`` every step,
as the ``Trainer`` does at each log), whose noise is a fraction of that. Arms, each a block of
``--burn`` + ``--steps`` steps, every arm once a round in a seeded shuffled order:

``off``, ``off_b``  no gpulens (the A/A pair)
``mon``            a ``TrainingSession`` over a ``Monitor`` (JSONL sink), started at the block's
                   first step (in the burn-in, as ``paths_aa.py`` does) and stopped after its
                   last; ``row(step, loss)`` every step: the row path and the engine process
``phases``         ``mon`` plus the step marks (``StepPhases`` on CUDA events: four a step)
``tokens``         ``mon`` plus the token counter (``TokenCounter``: a forward pre-hook, the
                   mask's row sums per micro-batch, the lengths' copy at each row)
``full``           ``mon`` with both, each row written at the log (just after the sync)
``later``          ``full`` with ``row(..., later=True)``, as the Hugging Face callback runs it:
                   the row written at the next step's optimizer mark, the device busy

Each step is timed on the GPU's timeline (an event at each step's end); a block's value is
the mean of its measured steps, read in percentage points of the same round's ``off``
(``paired.py``). Also printed: each arm's step by position in its block, less ``off``'s.

    python benchmarks/session_parts.py --budget-s 300 --json $OUT/session_parts.json
    python benchmarks/session_parts.py --quick     # a CPU smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead_gpu as og
import paired

ARMS = ("off", "off_b", "mon", "phases", "tokens", "full", "later")


def session_for(arm: str, s: og.Setup, out: Path, step: int, interval: float) -> Any:
    """The started ``TrainingSession`` of ``arm`` (``None`` for ``off`` arms)."""
    if arm.startswith("off"):
        return None
    import gpulens
    from gpulens.integrations.phases import StepPhases
    from gpulens.integrations.session import TrainingSession
    from gpulens.work.hf import TokenCounter, model_flops

    mon = gpulens.Monitor(interval=interval, sinks=[f"jsonl:{out / f'{arm}-{step}.jsonl'}"])
    phases = StepPhases() if arm in ("phases", "full", "later") else None
    work = TokenCounter(model_flops(s.model)).attach(s.model) \
        if arm in ("tokens", "full", "later") else None
    return TrainingSession(mon, start_step=step - 1, steps_done=step - 1, phases=phases,
                           work=work).start()


def block(s: og.Setup, arm: str, burn: int, steps: int, start: int, out: Path,
          interval: float) -> list[float]:
    """Seconds of each step of one block (burn-in included), on the GPU timeline."""
    torch = s.torch
    cuda = s.device.type == "cuda"
    events: list[Any] = []
    walls: list[float] = []
    mark = (lambda: events.append(_event(torch))) if cuda else (lambda: None)
    mark()
    walls.append(time.perf_counter())
    session: Any = None
    for i in range(burn + steps):
        step = start + i
        if i == 0:
            session = session_for(arm, s, out, step, interval)
        x = s.batches[step % len(s.batches)]
        if session is not None:
            session.resume()
            session.step_begin()
        loss = s.model(input_ids=x, attention_mask=s.masks[step % len(s.masks)], labels=x).loss
        loss.backward()
        if session is not None:
            session.before_optimizer()
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        if session is not None:
            session.step_end()
        value = float(loss.item())
        if session is not None:
            session.row(step, step, {"loss": value}, later=arm == "later")
        mark()
        walls.append(time.perf_counter())
    if session is not None:
        session.stop()
    if cuda:
        events[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(events)]
    return [b - a for a, b in itertools.pairwise(walls)]


def _event(torch: Any) -> Any:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--target-ms", type=float, default=100.0)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--burn", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--max-rounds", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default=",".join(ARMS), help="a subset, off first")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.burn, args.steps, args.max_rounds = 2, 4, 2
    s: Any = og.setup(args.quick, args.target_ms, None, None)
    s.masks = [s.torch.ones_like(b) for b in s.batches]
    arms = tuple(args.arms.split(","))
    if arms[0] != "off" or not set(arms) <= set(ARMS):
        raise SystemExit(f"--arms: a subset of {ARMS}, off first")
    values: dict[str, dict[int, float]] = {a: {} for a in arms}
    profile: dict[str, list[float]] = {a: [0.0] * (args.burn + args.steps) for a in arms}
    tmp = Path(tempfile.mkdtemp(prefix="session-parts-"))
    t_end = time.monotonic() + args.budget_s
    rnd, step = 0, 1000
    while rnd < args.max_rounds and (rnd < 2 or time.monotonic() < t_end):
        for arm in paired.round_order(list(arms), args.seed, rnd):
            times = block(s, arm, args.burn, args.steps, step, tmp, args.interval)
            step += args.burn + args.steps
            values[arm][rnd] = statistics.fmean(times[args.burn:])
            profile[arm] = [a + b for a, b in zip(profile[arm], times, strict=True)]
        rnd += 1
        og.log(f"round {rnd}: " + ", ".join(f"{a} {values[a][rnd - 1] * 1e3:.2f}" for a in arms))
        if args.json:
            args.json.write_text(json.dumps({"values": values, "rounds": rnd}))
    comps = paired.compare(values, dict.fromkeys(arms, "off"), seed=args.seed)
    base = profile["off"]
    hw = og.hardware(s)
    lines = [f"## A framework session's parts on a plain loop that syncs every step "
             f"({hw.get('gpu', hw['device'])})",
             f"model {s.n_params / 1e6:.1f}M params, batch {s.batch_size} x {s.seq_len}; "
             f"{rnd} rounds of {args.burn} + {args.steps} steps an arm; monitor interval "
             f"{args.interval:g} s", "", paired.table(comps, 0.3), "",
             f"step by position in the block (ms, mean of rounds), less off's; the first "
             f"{args.burn} are burn-in", "",
             "| arm | " + " | ".join(str(i) for i in range(len(base))) + " |",
             "|---|" + "---|" * len(base)]
    for arm in arms:
        cells = [f"{1e3 * v / rnd:.1f}" if arm == "off" else f"{1e3 * (v - b) / rnd:+.2f}"
                 for v, b in zip(profile[arm], base, strict=True)]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        args.md.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({
            "values": values, "rounds": rnd, "profile_ms": {
                a: [1e3 * v / rnd for v in profile[a]] for a in arms},
            "comparisons": [c.as_dict() for c in comps], "versions": og.versions(),
            "hardware": hw, "args": vars(args)}, indent=1, default=str))


if __name__ == "__main__":
    main()
