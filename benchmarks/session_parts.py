"""Which part of a framework callback's per-step work costs a step that syncs every step?
(issue 18)

The Hugging Face ``Trainer`` logging every step is the one user path whose cost stayed above
its A/A arm (about +0.5 pp on an H200), and its own per-round noise (2-3 pp) is too wide to take
it apart. This runs the same parts on a plain loop over the same GPT-2-small-sized model
(``overhead_gpu.py``; a forward with an all-ones attention mask, ``loss.item()`` every step,
as the ``Trainer`` does at each log), whose noise is a fraction of that. Arms, each a block of
``--burn`` + ``--steps`` steps, every arm once a round in a balanced, seeded order:

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
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loop_rounds as lr
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
    clock = lr.StepClock(s)
    clock.stamp()
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
        clock.stamp()
    if session is not None:
        session.stop()
    return clock.times()


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    lr.add_args(p, burn=5, max_rounds=300)
    p.add_argument("--interval", type=float, default=0.1, help="the monitor's interval")
    p.add_argument("--arms", default=",".join(ARMS), help="a subset, off first")
    args = p.parse_args()
    if args.quick:
        args.burn, args.steps, args.max_rounds = 2, 4, 2
    s: Any = og.setup(args.quick, args.target_ms, None, None)
    s.masks = [s.torch.ones_like(b) for b in s.batches]
    arms = tuple(args.arms.split(","))
    if arms[0] != "off" or not set(arms) <= set(ARMS):
        raise SystemExit(f"--arms: a subset of {ARMS}, off first")
    tmp = Path(tempfile.mkdtemp(prefix="session-parts-"))
    rounds = lr.Rounds(arms)
    rounds.run(args, lambda arm, step: block(s, arm, args.burn, args.steps, step, tmp,
                                             args.interval))
    hw = og.hardware(s)
    lines = [f"## A framework session's parts on a plain loop that syncs every step "
             f"({hw.get('gpu', hw['device'])})",
             f"model {s.n_params / 1e6:.1f}M params, batch {s.batch_size} x {s.seq_len}; "
             f"{rounds.rounds} rounds of {args.burn} + {args.steps} steps an arm; monitor "
             f"interval {args.interval:g} s", "",
             paired.table(rounds.comparisons("off", args.seed), 0.3), "",
             *rounds.profile_table("off", args.burn)]
    lr.write(args, lines, rounds, "off", {}, s)


if __name__ == "__main__":
    main()
