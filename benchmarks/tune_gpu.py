"""``gpulens tune`` on a GPU against a brute-force sweep of the same grid, Lightning's
``Tuner.scale_batch_size`` and Hugging Face's ``auto_find_batch_size`` (issue 19).

The training: GPT-2 small (124M, ``GPT2Config()`` built in code: no download), bf16 autocast
with fp32 weights, AdamW, random tokens, sequence ``--seq`` (512). So that loader workers
matter on synthetic data, every sample costs ``--sample-ms`` (2.5 ms) of busy CPU time in the
process that loads it (the training process without workers, else a worker).

Arms, in one process on one GPU, each bounded in time:

1. **tune**: ``gpulens.tune.tune`` over the batch sizes ``--batch-sizes`` (powers of two and the
   1.5x points between them, up to 384) and workers ``--workers`` (0,2,4,8).
2. **brute force**: every (batch size, workers) of the same grid with the same trial runner
   (warm-up, timed window), larger batch sizes skipped after the first out-of-memory one.
3. **lightning**: ``Tuner(trainer).scale_batch_size(mode="power")`` on a LightningModule around
   the same model (precision ``bf16-mixed``).
4. **hf**: ``Trainer(auto_find_batch_size=True, bf16=True)`` starting at ``--hf-start`` (256).
   (3 and 4 run first, each with a model of its own, freed before the next arm; their
   loaders have the current workers, ``--current-workers``.)
5. **head to head**: tune's choice, the brute-force best, and the Lightning and HF choices
   (with the workers of tune's choice), measured in alternation, ``--rounds`` rounds.
6. **after an OOM**: tune's choice measured, then an out-of-memory trial, then the choice again
   (in the same process: do the two agree within 2 %?).

Done when: tune's choice is within 3 % of the brute-force best (head to head), its sweep took
at most half the brute-force time, and no arm crashed at the out-of-memory edge.

    python benchmarks/tune_gpu.py                 # one H100/H200, < 8 minutes
    python benchmarks/tune_gpu.py --smoke         # CPU, tiny GPT-2, OOM injected: the plumbing

Writes ``$OUT/tune_gpu.json`` (every trial of every arm, times, choices), ``$OUT/tune_gpu.md``
(the summary table) and tune's own report (``$OUT/tune_report.html``, ``.md``); without
``$OUT``, under ``--out`` (default ``.``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from gpulens.tune import Config, Trial, TuneJob, TuneResult, TuneSettings, tune
from gpulens.tune.plain import PlainWorkload
from gpulens.tune.report import render_html, render_markdown
from gpulens.tune.runner import make_context
from gpulens.tune.trial import run_trial


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Random token rows; each costs ``sample_ms`` of busy CPU in the loading process."""

    def __init__(self, n: int, seq: int, vocab: int, sample_ms: float) -> None:
        self.n, self.seq, self.vocab, self.cost = n, seq, vocab, sample_ms / 1000

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        end = time.perf_counter() + self.cost
        while time.perf_counter() < end:  # the controlled per-sample CPU cost
            pass
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.seq,), generator=g)
        return {"input_ids": ids, "labels": ids}


@dataclasses.dataclass
class Setup:
    args: argparse.Namespace
    device: torch.device
    config: Any
    dataset: Tokens
    scratch: str
    """A temporary folder for the frameworks' own files (Lightning's finder checkpoint)."""

    def model(self) -> Any:
        from transformers import GPT2LMHeadModel

        torch.manual_seed(0)
        return GPT2LMHeadModel(self.config).to(self.device)

    def autocast(self) -> Any:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loader(self, batch: int, workers: int) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=batch, num_workers=workers, shuffle=True,
                          drop_last=True, pin_memory=self.device.type == "cuda")


def plain_job(s: Setup) -> TuneJob:
    """The training as gpulens tune's plain-PyTorch pieces (a fresh model and optimizer)."""
    model = s.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=s.device.type == "cuda")
    oom_at = s.args.inject_oom_at

    def step(batch: dict[str, torch.Tensor]) -> None:
        ids = batch["input_ids"].to(s.device, non_blocking=True)
        if oom_at is not None and ids.shape[0] >= oom_at:
            raise torch.OutOfMemoryError("CUDA out of memory. (injected by --inject-oom-at)")
        with s.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return TuneJob(loader=s.loader(8, 0), step=step, model=model, optimizer=opt,
                   dtype="bf16" if s.device.type == "cuda" else None, device=s.device,
                   current=Config(s.args.current_batch, s.args.current_workers))


class Runner:
    """Measures single configurations of a job with gpulens's trial runner."""

    def __init__(self, s: Setup, job: TuneJob, settings: TuneSettings) -> None:
        self.job, self.settings = job, settings
        self.ctx = make_context(model=job.model, device=job.device, dtype=job.dtype)
        self.workload = PlainWorkload(job)

    def __call__(self, config: Config) -> Trial:
        return run_trial(lambda rec: self.workload.run(config, rec), config, self.settings,
                         self.ctx, self.workload.cleanup)

    def close(self) -> None:
        if self.ctx.token_counter is not None:
            self.ctx.token_counter.detach()


def free(smoke: bool = False) -> float | None:
    """Collect what an arm left and empty the allocator's cache; the GB still allocated.
    ``smoke``: then move every object alive out of the collector's sight (``gc.freeze``), so
    that later collections (the trial runner's after an out-of-memory trial) scan only what
    was made since: with torch, transformers and Lightning loaded a full one takes ~0.4 s."""
    gc.collect()
    if smoke:
        gc.freeze()
    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 1e9


def brute_force(run: Runner, sizes: list[int], workers: list[int],
                limit_s: float) -> dict[str, Any]:
    """Every (batch, workers) of the grid; no batch size at or above the first that ran out
    of memory; stops at ``limit_s``."""
    start = time.perf_counter()
    trials: list[Trial] = []
    oom: int | None = None
    complete = True
    for w in workers:
        for b in sizes:
            if oom is not None and b >= oom:
                break
            if time.perf_counter() - start > limit_s:
                complete = False
                break
            t = run(Config(b, w))
            trials.append(t)
            log(f"brute force: {t.config.label()}: {t.status} {t.samples_per_s or 0:.0f}/s")
            if t.status == "oom":
                oom = b
    best = max((t for t in trials if t.ok), key=lambda t: t.throughput, default=None)
    return {"seconds": time.perf_counter() - start, "complete": complete, "oom_batch": oom,
            "best": best.to_dict() if best else None, "trials": [t.to_dict() for t in trials]}


def lightning_arm(s: Setup, workers: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    setup = s

    class Lit(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 2
            self.model = setup.model()

        def train_dataloader(self) -> DataLoader[Any]:
            return setup.loader(self.batch_size, workers)

        def training_step(self, batch: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            ids = batch["input_ids"]
            if setup.args.inject_oom_at is not None and ids.shape[0] >= setup.args.inject_oom_at:
                raise torch.OutOfMemoryError("CUDA out of memory. (injected)")
            out: torch.Tensor = self.model(input_ids=ids, labels=ids).loss
            return out

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    cuda = s.device.type == "cuda"
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=1,
                         precision="bf16-mixed" if cuda else "32-true", max_steps=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=s.scratch)
    module = Lit()
    start = time.perf_counter()
    found = Tuner(trainer).scale_batch_size(module, mode="power", steps_per_trial=3,
                                            init_val=2, max_trials=25)
    seconds = time.perf_counter() - start
    return {"batch_size": found, "seconds": seconds, "workers": workers}


def hf_arm(s: Setup, workers: int) -> dict[str, Any]:
    import accelerate  # noqa: F401  (the Trainer's auto_find_batch_size needs it)
    from transformers import Trainer, TrainingArguments

    from gpulens.tune.trial import is_oom

    model = s.model()
    if s.args.inject_oom_at is not None:
        oom_at = s.args.inject_oom_at
        forward = model.forward

        @functools.wraps(forward)  # the Trainer reads forward's signature for its columns
        def guarded(*a: Any, **k: Any) -> Any:
            if k["input_ids"].shape[0] >= oom_at:
                raise RuntimeError("CUDA out of memory. (injected)")
            return forward(*a, **k)

        model.forward = guarded
    cuda = s.device.type == "cuda"
    args = TrainingArguments(output_dir=s.scratch, auto_find_batch_size=True,
                             per_device_train_batch_size=s.args.hf_start, max_steps=3,
                             bf16=cuda, use_cpu=not cuda, report_to="none", save_strategy="no",
                             logging_steps=1000, dataloader_num_workers=workers,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=s.dataset)
    start = time.perf_counter()
    error = None
    try:
        trainer.train()
    except Exception as e:  # recorded, as a crash of this arm
        error = f"{type(e).__name__}: {e}"[:300]
        log(f"hf auto_find_batch_size raised {error} (oom: {is_oom(e)})")
    seconds = time.perf_counter() - start
    found = int(trainer._train_batch_size)
    return {"batch_size": found if error is None else None, "seconds": seconds,
            "workers": workers, "start": s.args.hf_start, "error": error}


def alternate(run: Runner, configs: dict[str, Config], rounds: int) -> dict[str, Any]:
    """Each named configuration measured ``rounds`` times, in alternation."""
    seen: dict[str, list[Trial]] = {k: [] for k in configs}
    for _ in range(rounds):
        for name, c in configs.items():
            seen[name].append(run(c))
    out: dict[str, Any] = {}
    for name, trials in seen.items():
        rates = [t.throughput for t in trials if t.ok]
        out[name] = {"config": dataclasses.asdict(configs[name]),
                     "samples_per_s": statistics.mean(rates) if rates else None,
                     "rates": rates, "peak_reserved_gb": trials[-1].peak_reserved_gb,
                     "status": [t.status for t in trials]}
    return out


def markdown(data: dict[str, Any]) -> str:
    h2h = data["head_to_head"]
    best = h2h.get("brute force best", {}).get("samples_per_s")

    def row(name: str, batch: Any, workers: Any, seconds: Any, note: str = "") -> str:
        m = h2h.get(name, {})
        rate = m.get("samples_per_s")
        vs = f"{100 * (rate / best - 1):+.1f} %" if rate and best else "-"
        mem = m.get("peak_reserved_gb")
        return (f"| {name} | {batch} | {workers} | {seconds} | "
                f"{f'{rate:.1f}' if rate else '-'} | {vs} | "
                f"{f'{mem:.1f}' if mem is not None else '-'} | {note} |")

    t, b = data["tune"], data["brute_force"]
    a = data["args"]
    model = ("a tiny GPT-2 (--smoke), fp32, out-of-memory injected from batch "
             f"{a['inject_oom_at']}" if a["smoke"] else "GPT-2 small, bf16 autocast")
    lines = [f"# gpulens tune on {data['device']}", "",
             f"{model}, seq {a['seq']}, AdamW, random tokens; {a['sample_ms']} ms of CPU per "
             f"sample in the loading process; {a['warmup']} warm-up + {a['steps']} timed steps "
             f"per trial; head to head: {a['rounds']} round(s).", "",
             "| arm | batch | workers | sweep s | samples/s (head to head) | vs brute-force "
             "best | peak GB | note |", "|---|---|---|---|---|---|---|---|"]
    tc = t["chosen"]["config"] if t["chosen"] else {}
    lines.append(row("tune", tc.get("batch_size"), tc.get("num_workers"),
                     f"{t['seconds']:.0f}", f"{len(t['result']['trials'])} trials"))
    bb = b["best"]["config"] if b["best"] else {}
    lines.append(row("brute force best", bb.get("batch_size"), bb.get("num_workers"),
                     f"{b['seconds']:.0f}", f"{len(b['trials'])} trials, OOM from "
                     f"{b['oom_batch']}"))
    for name in ("lightning", "hf"):
        arm = data.get(name) or {}
        if "seconds" in arm:
            lines.append(row(name, arm["batch_size"], h2h.get(name, {}).get(
                "config", {}).get("num_workers"), f"{arm['seconds']:.0f}",
                arm.get("error") or "largest batch that fits, by its own search"))
        else:
            why = arm.get("skipped") or arm.get("error") or "not run"
            lines.append(f"| {name} | - | - | - | - | - | - | {why} |")
    v = data["verdict"]
    lines += ["", f"- tune's choice against the brute-force best (head to head): "
                  f"{v['choice_vs_best_pct']:+.2f} % (done when >= -3 %)",
              f"- sweep time, tune / brute force: {v['time_ratio']:.2f} (done when <= 0.5)",
              f"- out-of-memory edge: tune {t['oom_batch']}, brute force {b['oom_batch']}; "
              f"no crash: {v['no_crash']}",
              f"- after an out-of-memory trial: {v['after_oom_pct']}"
              " % (same configuration before/after, in one process; done when within 2 %)",
              "- tune's confirmation trial (its choice measured again at the end): "
              + ("-" if t["confirm_diff_pct"] is None else f"{t['confirm_diff_pct']:+.2f} %")]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def phase(name: str, times: dict[str, float]) -> Iterator[None]:
    log(f"{name} ...")
    start = time.perf_counter()
    try:
        yield
    finally:
        times[name] = time.perf_counter() - start
        log(f"{name}: {times[name]:.1f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch-sizes", default="1,2,4,8,12,16,24,32,48,64,96,128,192,256,384")
    p.add_argument("--workers", default="0,2,4,8")
    p.add_argument("--sample-ms", type=float, default=2.5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--current-batch", type=int, default=8)
    p.add_argument("--current-workers", type=int, default=0)
    p.add_argument("--hf-start", type=int, default=256)
    p.add_argument("--brute-limit-s", type=float, default=240.0)
    p.add_argument("--tune-budget-s", type=float, default=120.0)
    p.add_argument("--time-limit-s", type=float, default=450.0,
                   help="the whole run: the brute force gets what is left after the other "
                        "arms' share, so the script ends within this (Lightning's and HF's "
                        "finders run to their own end)")
    p.add_argument("--inject-oom-at", type=int, default=None,
                   help="raise an out-of-memory error from this batch size on (CPU smoke)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny GPT-2, small grid, OOM injected at 8: the plumbing")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = p.parse_args(argv)
    from transformers import GPT2Config

    if args.smoke:
        args.seq, args.sample_ms, args.warmup, args.steps, args.rounds = 32, 0.5, 1, 2, 1
        args.batch_sizes, args.workers, args.hf_start = "2,4,8", "0,1", 8
        args.current_batch, args.inject_oom_at = 2, args.inject_oom_at or 8
        config = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=256,
                            bos_token_id=0, eos_token_id=0)
        device = torch.device("cpu")
        torch.set_num_threads(1)  # a tiny model: more threads only contend on a small machine
        free(smoke=True)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --smoke on a CPU", file=sys.stderr)
            return 2
        config = GPT2Config(n_positions=max(1024, args.seq))
        device = torch.device("cuda", 0)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    workers = [int(x) for x in args.workers.split(",")]
    s = Setup(args, device, config, Tokens(200_000, args.seq, config.vocab_size,
                                             args.sample_ms),
              tempfile.mkdtemp(prefix="tune-gpu-"))
    deadline = time.perf_counter() + args.time_limit_s
    settings = TuneSettings(warmup_steps=args.warmup, steps=args.steps, batch_sizes=tuple(sizes),
                            workers=tuple(workers), budget_s=args.tune_budget_s,
                            workers_per_cpu=False).check()
    times: dict[str, float] = {}
    data: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v
                                     for k, v in vars(args).items()},
                            "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                            else "CPU", "torch": torch.__version__}

    # Lightning's and HF's finders first, each with a model of its own that is freed before
    # the next arm: no arm runs beside another's weights. Their loaders have the current
    # workers (what a user of those tools has); they choose only the batch size.
    crashes: list[str] = []
    for name, arm in (("lightning", lightning_arm), ("hf", hf_arm)):
        with phase(name, times):
            try:
                data[name] = arm(s, args.current_workers)
            except ImportError as e:  # a framework this machine lacks: skipped, said
                data[name] = {"skipped": f"{type(e).__name__}: {e}"}
                log(f"{name} skipped: {e}")
                continue
            except Exception as e:  # a crash is a result
                crashes.append(f"{name}: {type(e).__name__}: {e}"[:300])
                data[name] = {"error": crashes[-1]}
                log(crashes[-1])
        if data[name].get("error") and data[name]["error"] not in crashes:
            crashes.append(f"{name}: {data[name]['error']}")
        data[name]["allocated_after_gb"] = free(args.smoke)
    with phase("tune", times):
        job = plain_job(s)
        start = time.perf_counter()
        result: TuneResult = tune(job.loader, job.step, model=job.model, optimizer=job.optimizer,
                                  dtype=job.dtype, device=job.device, current=job.current,
                                  settings=settings)
        tune_s = time.perf_counter() - start
    data["tune"] = {"seconds": tune_s, "result": result.to_dict(),
                    "chosen": result.chosen.to_dict() if result.chosen else None,
                    "oom_batch": result.oom_batch, "confirm_diff_pct": result.confirm_diff_pct}
    title = "gpulens tune: " + ("a tiny GPT-2 (--smoke)" if args.smoke else "GPT-2 small")
    (args.out / "tune_report.html").write_text(render_html(result, title))
    (args.out / "tune_report.md").write_text(render_markdown(result, title))
    run = Runner(s, job, dataclasses.replace(settings, budget_s=None))
    with phase("brute force", times):
        # what is left, less about 20 % for the head to head and the after-OOM trials
        left = 0.8 * (deadline - time.perf_counter())
        data["brute_force"] = brute_force(run, sizes, workers, min(args.brute_limit_s, left))
    chosen = result.chosen.config if result.chosen else Config(sizes[0], workers[0])
    head: dict[str, Config] = {"tune": chosen}
    best = data["brute_force"]["best"]
    if best:
        head["brute force best"] = Config(**best["config"])
    for name in ("lightning", "hf"):
        b = data[name].get("batch_size")
        if b:
            head[name] = Config(int(b), chosen.num_workers)
    with phase("head to head", times):
        data["head_to_head"] = alternate(run, head, args.rounds)
    oom = result.oom_batch or data["brute_force"]["oom_batch"]
    after: float | None = None
    if oom is not None:
        with phase("after an OOM", times):
            before_t = run(chosen)
            oom_t = run(dataclasses.replace(chosen, batch_size=oom))
            after_t = run(chosen)
            if before_t.ok and after_t.ok:
                after = 100 * (after_t.throughput / before_t.throughput - 1)
            data["after_oom"] = {"before": before_t.to_dict(), "oom": oom_t.to_dict(),
                                 "after": after_t.to_dict(), "diff_pct": after}
    run.close()
    h2h = data["head_to_head"]
    t_rate = h2h["tune"]["samples_per_s"]
    b_rate = h2h.get("brute force best", {}).get("samples_per_s")
    data["verdict"] = {
        "choice_vs_best_pct": 100 * (t_rate / b_rate - 1) if t_rate and b_rate else float("nan"),
        "time_ratio": tune_s / data["brute_force"]["seconds"],
        "no_crash": not crashes and result.chosen is not None,
        "crashes": crashes,
        "after_oom_pct": None if after is None else round(after, 2),
    }
    data["phase_seconds"] = times
    shutil.rmtree(s.scratch, ignore_errors=True)
    (args.out / "tune_gpu.json").write_text(json.dumps(data, indent=1, default=str))
    md = markdown(data)
    (args.out / "tune_gpu.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
