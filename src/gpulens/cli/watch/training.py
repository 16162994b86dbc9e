"""The training's lines under the GPUs (``--record``): its latest step, the rules firing, what to
try; and their one-line form for ``--plain``."""

from __future__ import annotations

from typing import Any

from gpulens.report.tail import TrainingStatus
from gpulens.report.text import sized


def rate(v: float) -> str:
    """A rate in few characters: ``"9,876"``, ``"163k"``, ``"1.63M"``."""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def _ago(status: TrainingStatus, now: float) -> str:
    if status.ended:
        return "run ended"
    if status.time is None:
        return ""
    age = max(0.0, now - status.time)
    return f"{age:.0f} s ago" if age < 120 else f"{age / 60:.0f} min ago"


def training_pieces(status: TrainingStatus, now: float) -> list[tuple[int, str]]:
    """``(priority, text)`` of the training line, in display order; 0 is kept longest."""
    v = status.values
    out: list[tuple[int, str]] = [(0, f"step {status.step:,}")]
    if "train/loss" in v:
        out.append((1, f"loss {v['train/loss']:.4g}"))
    if "perf/tokens_per_s" in v:
        out.append((2, f"{rate(v['perf/tokens_per_s'])} tok/s"))
    elif "perf/samples_per_s" in v:
        out.append((2, f"{rate(v['perf/samples_per_s'])} samples/s"))
    if "perf/mfu_pct" in v:
        out.append((3, f"MFU {sized(v['perf/mfu_pct'])}%"))
        if "perf/mfu_clock_adjusted_pct" in v:
            out.append((6, f"clock-adj. {sized(v['perf/mfu_clock_adjusted_pct'])}%"))
        if "perf/tflops" in v:
            out.append((5, f"{sized(v['perf/tflops'])} TFLOP/s/GPU"))
    elif "perf/tflops" in v:
        out.append((3, f"{sized(v['perf/tflops'])} TFLOP/s/GPU"))
    if "perf/tokens_per_j" in v:
        out.append((7, f"{rate(v['perf/tokens_per_j'])} tok/J"))
    ago = _ago(status, now)
    if ago:
        out.append((4, ago))
    return out


def training_text(status: TrainingStatus, width: int, now: float) -> str:
    """The training line, at most ``width`` cells: pieces of lower priority leave first."""
    head = "Training"
    if status.error or not status.exists:
        for where in (str(status.path), status.path.name):  # the name alone where too long
            text = (f"{head}: cannot read {where}: {status.error}" if status.error
                    else f"{head}: waiting for {where} (not written yet)")
            if len(text) <= width:
                break
        return text
    if status.step is None:
        return f"{head}: {'run ' + status.run_id if status.run_id else status.path.name}, " \
               "no step yet"
    pieces = training_pieces(status, now)
    while True:
        text = head + "  " + " · ".join(t for _, t in pieces)
        if len(text) <= width or len(pieces) == 1:
            return text
        pieces.remove(max(pieces, key=lambda p: p[0]))


def alerts_text(status: TrainingStatus, width: int) -> tuple[str, bool]:
    """``("Alerts firing: input_bound (step 26)", True)``, or ``("Alerts: none firing",
    False)``, at most ``width`` cells (the steps, then names, leave before it is cut)."""
    if status.step is None:
        return "", False
    firing = status.firing
    if not firing:
        judged = any(k.startswith("alerts/") for k in status.values)
        return ("Alerts: none firing" if judged else "Alerts: no rule has judged yet"), False
    named = []
    for rule in firing:
        at = status.fired_at(rule)
        named.append((rule, f"{rule} (step {at})" if at is not None and at >= 0 else rule))
    for with_step in (True, False):
        shown = [text if with_step else rule for rule, text in named]
        for n in range(len(shown), 0, -1):
            more = f", +{len(shown) - n} more" if n < len(shown) else ""
            text = "Alerts firing: " + ", ".join(shown[:n]) + more
            if len(text) <= width:
                return text, True
    return f"Alerts firing: {len(firing)}", True


def advice_text(status: TrainingStatus, width: int) -> str:
    """What to try for the newest rule that fired and still fires, cut at a word boundary
    within ``width`` cells; ``""`` when there is none."""
    firing = set(status.firing)
    for e in reversed(status.events):
        if e.state == "firing" and e.name in firing and e.advice:
            text = f"  try ({e.name}): {e.advice}"
            if len(text) <= width:
                return text
            cut = text.rfind(" ", 0, width)
            return text[:cut if cut > 0 else width].rstrip(" ,;:")
    return ""


def plain_training(status: TrainingStatus, now: float) -> str:
    """The record's latest step on one line, for ``--plain``."""
    if status.error or not status.exists or status.step is None:
        return training_text(status, 10_000, now).replace("Training: ", "train: ")
    v = status.values
    parts = [f"train step {status.step}"]
    for key, label, fmt in (("train/loss", "loss", ".4g"), ("perf/tokens_per_s", "tok/s", ".0f"),
                            ("perf/samples_per_s", "samples/s", ".4g"),
                            ("perf/mfu_pct", "MFU", ""), ("perf/tflops", "TFLOP/s/GPU", "")):
        if key in v:
            text = format(v[key], fmt) if fmt else sized(v[key])
            parts.append(f"{label} {text}" + ("%" if label == "MFU" else ""))
    firing = status.firing
    parts.append("alerts " + (",".join(firing) if firing else "-"))
    if status.ended:
        parts.append("run ended")
    return " ".join(parts)


def training_lines(status: TrainingStatus, width: int, now: float) -> list[Any]:
    from rich.text import Text

    out = [Text(training_text(status, width, now), style="bold", no_wrap=True, overflow="crop")]
    alerts, firing = alerts_text(status, width)
    if alerts:
        out.append(Text(alerts, style="bold red" if firing else "green", no_wrap=True,
                        overflow="crop"))
    advice = advice_text(status, width)
    if advice:
        out.append(Text(advice, style="yellow", no_wrap=True, overflow="crop"))
    out.append(Text(""))
    return out
