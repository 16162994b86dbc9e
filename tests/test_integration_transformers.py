"""The Hugging Face callback with real tiny Trainer runs: rows read back from the JSONL record,
an offline W&B run file and a real MLflow server on loopback."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.jsonl import read_rows
from tests.support.mlflow_server import MlflowTracking
from tests.support.wandb_offline import reset_wandb
from tests.support.wandb_reader import find_run_file, read_history

transformers = pytest.importorskip("transformers")

import gpulens  # noqa: E402
from gpulens.integrations.session import TrainingSession  # noqa: E402
from gpulens.integrations.transformers import GPUMonitorCallback  # noqa: E402
from gpulens.work.hf import TokenCounter  # noqa: E402

GPU_KEY = "gpu/0/util_pct"
MLFLOW_GPU_KEY = "gpu_util_pct_mean"  # the tracker view's key beside HF's bare "loss"


@pytest.fixture(autouse=True)
def _simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "1")


@pytest.fixture
def mlflow_run_ends_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face logs to MLflow asynchronously, and ending the run joins MLflow's logging
    thread, which sits up to 1 s in a wait for its queue (~0.7 s a run here). With MLflow's own
    ``MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS`` that thread waits on its stop event instead (it
    sends the metrics in batches at most 1 s apart, all of them when the run ends), so the
    run ends at once; the numbers the run holds are the same."""
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "1")


class Regression(nn.Module):
    """y = w.x with a loss, the smallest model the Trainer accepts; ``fail_at`` raises in the
    forward pass of that call (to test the exception path). ``forward_s``: the
    ``perf_counter`` seconds each forward pass took."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.calls = 0
        self.fail_at = fail_at
        self.forward_s: list[float] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("boom")
        pred = self.linear(x).squeeze(-1)
        out = {"loss": nn.functional.mse_loss(pred, labels), "logits": pred}
        self.forward_s.append(time.perf_counter() - t0)
        return out


class Points(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` samples, each fetched in at least ``delay_s`` seconds; ``fetch_s``: the
    ``perf_counter`` seconds each fetch took, in the order of the fetches."""

    def __init__(self, n: int = 256, delay_s: float = 0.0) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = self.x.sum(-1)
        self.delay_s = delay_s
        self.fetch_s: list[float] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)
        sample = {"x": self.x[i], "labels": self.y[i]}
        self.fetch_s.append(time.perf_counter() - t0)
        return sample


def make_trainer(tmp_path: Path, callback: GPUMonitorCallback, *, report_to: Any = "none",
                 max_steps: int = 12, logging_steps: int = 4, grad_accum: int = 1,
                 model: nn.Module | None = None, dataset: Any = None,
                 eval_steps: int | None = None, save_steps: int | None = None,
                 **options: Any) -> Any:
    extra: dict[str, Any] = dict(options)
    if eval_steps is not None:
        extra.update({"eval_strategy": "steps", "eval_steps": eval_steps,
                      "per_device_eval_batch_size": 16})
    if save_steps is not None:
        extra.update({"save_strategy": "steps", "save_steps": save_steps})
    else:
        extra["save_strategy"] = "no"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        logging_steps=logging_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=grad_accum,
        learning_rate=1e-2,
        report_to=report_to,
        use_cpu=True,
        disable_tqdm=True,
        **extra,
    )
    return transformers.Trainer(model=model or Regression(), args=args,
                                train_dataset=dataset or Points(),
                                eval_dataset=Points(64) if eval_steps is not None else None,
                                callbacks=[callback])


def loss_steps(trainer: Any) -> list[int]:
    return [h["step"] for h in trainer.state.log_history if "loss" in h]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return read_rows(path)


def test_report_to_none_rows_on_hf_log_steps_with_hf_scalars(tmp_path: Path) -> None:
    sink = tmp_path / "gpu.jsonl"
    trainer = make_trainer(tmp_path, GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05))
    trainer.train()
    rows = read_jsonl(sink)
    assert [r["step"] for r in rows] == loss_steps(trainer) == [4, 8, 12]
    hf = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    for row in rows:
        logged = hf[row["step"]]
        assert row["train/global_step"] == row["step"]
        # exactly the numbers HF logged, under train/<name>
        for key in ("loss", "learning_rate", "grad_norm", "epoch"):
            assert row[f"train/{key}"] == pytest.approx(logged[key])
        assert GPU_KEY in row and "host/cpu_pct" in row
        shares = [row[f"perf/{p}_pct"] for p in ("data_wait", "forward_backward", "optimizer")]
        assert all(0.0 <= s <= 100.0 for s in shares)
        assert sum(shares) == pytest.approx(100.0)
        assert row["perf/steps"] == 4 or row is rows[0]


@pytest.mark.parametrize("gpm", [True, False])
def test_gpm_false_leaves_the_gpm_activity_out_of_the_rows(tmp_path: Path, gpm: bool) -> None:
    """``gpm=False`` (the switch for the GPM reads' cost, docs/benchmarks.md): the rows keep
    utilization and the rest but carry no GPM activity; the default carries it."""
    sink = tmp_path / "gpu.jsonl"
    trainer = make_trainer(tmp_path, GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05,
                                                        gpm=gpm), max_steps=8)
    trainer.train()
    rows = read_jsonl(sink)
    assert [r["step"] for r in rows] == [4, 8]
    for row in rows:
        assert GPU_KEY in row
        assert ("gpu/0/sm_active_pct" in row) is gpm
        assert ("gpu/0/tensor_active_pct" in row) is gpm


def test_on_log_writes_nothing_the_next_forward_writes_the_row(tmp_path: Path) -> None:
    """HF calls ``on_log`` right after ``loss.item()`` synchronised the device, and every
    step's hooks after its ``isnan(loss)`` sync: the callback writes its row after the next
    step's forward (its kernels queued, the device busy), never in a step hook, the last at
    the end of training; every log still has its row, at its step."""
    sink = tmp_path / "gpu.jsonl"
    callback = GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05)
    where: list[str] = []
    current = ["-"]
    settled: list[str] = []

    def hooked(name: str) -> None:
        real = getattr(callback, name)

        def hook(*args: Any, **kw: Any) -> Any:
            current[0] = name
            try:
                return real(*args, **kw)
            finally:
                current[0] = "-"
        setattr(callback, name, hook)

    for name in ("on_log", "on_step_begin", "on_pre_optimizer_step", "on_step_end",
                 "on_train_end"):
        hooked(name)
    real_log_at = gpulens.Monitor.log_at
    real_settle = TokenCounter.settle

    def log_at(self: gpulens.Monitor, *args: Any, **kw: Any) -> None:
        where.append(current[0])
        real_log_at(self, *args, **kw)

    def settle(self: TokenCounter) -> None:
        if self._raw:  # masks to turn into counts: where is that launched?
            settled.append(current[0])
        real_settle(self)

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16,
                                     vocab_size=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)

    class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            mask = torch.tensor([1] * 11 + [0] * 5)
            ids = torch.arange(16) % 64
            return {"input_ids": ids, "attention_mask": mask,
                    "labels": ids.masked_fill(mask == 0, -100)}

    trainer = make_trainer(tmp_path, callback, max_steps=12, logging_steps=4, model=model,
                           dataset=Rows())
    model.register_forward_pre_hook(lambda *_: current.__setitem__(0, "forward"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpulens.Monitor, "log_at", log_at)
        mp.setattr(TokenCounter, "settle", settle)
        trainer.train()
    assert where == ["forward", "forward", "on_train_end"]
    assert settled == ["forward"] * 12  # each step's mask, after its forward
    assert [r["step"] for r in read_jsonl(sink)] == loss_steps(trainer) == [4, 8, 12]
    assert not model._forward_hooks  # the hook goes with the run


def test_a_row_held_at_a_log_is_written_when_an_evaluation_starts(tmp_path: Path) -> None:
    """An evaluation right after a log (``eval_steps`` = ``logging_steps``) may take minutes:
    the held row is written at its first batch (``on_prediction_step``), not after it."""
    sink = tmp_path / "gpu.jsonl"
    callback = GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05)
    batches = [0]  # evaluation batches seen so far
    written_at: list[int] = []  # the batch count when a held row was written
    real_flush = TrainingSession.flush

    def flush(self: TrainingSession) -> None:
        if self._held:
            written_at.append(batches[0])
        real_flush(self)

    trainer = make_trainer(tmp_path, callback, max_steps=8, logging_steps=4, eval_steps=4)
    real_prediction = callback.on_prediction_step

    def on_prediction_step(*args: Any, **kw: Any) -> Any:
        batches[0] += 1
        return real_prediction(*args, **kw)

    callback.on_prediction_step = on_prediction_step  # type: ignore[method-assign]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TrainingSession, "flush", flush)
        trainer.train()
    per_eval = batches[0] // 2
    assert per_eval > 1  # 64 points, 16 a batch
    assert written_at == [1, per_eval + 1]  # each at its evaluation's first batch
    assert [r["step"] for r in read_jsonl(sink)] == loss_steps(trainer) == [4, 8]


def test_default_sink_is_jsonl_in_output_dir(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, GPUMonitorCallback(interval=0.05), max_steps=8)
    trainer.train()
    rows = read_jsonl(tmp_path / "out" / "gpulens.jsonl")
    assert [r["step"] for r in rows] == [4, 8]


def test_gradient_accumulation_steps_are_optimizer_steps(tmp_path: Path) -> None:
    sink = tmp_path / "gpu.jsonl"
    trainer = make_trainer(tmp_path, GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05),
                           max_steps=6, logging_steps=3, grad_accum=4)
    settled: list[int] = []
    real = TrainingSession.micro_step_end

    def micro_step_end(self: TrainingSession) -> None:
        settled.append(1)
        real(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TrainingSession, "micro_step_end", micro_step_end)
        trainer.train()
    rows = read_jsonl(sink)
    assert [r["step"] for r in rows] == loss_steps(trainer) == [3, 6]
    assert rows[1]["perf/steps"] == 3
    assert len(settled) == 6 * (4 - 1)  # every micro-batch but each step's last (on_step_end)


def test_tail_after_last_log_gets_a_row_at_the_final_summary(tmp_path: Path) -> None:
    sink = tmp_path / "gpu.jsonl"
    trainer = make_trainer(tmp_path, GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05),
                           max_steps=10, logging_steps=4)
    trainer.train()
    rows = read_jsonl(sink)
    assert [r["step"] for r in rows] == [4, 8, 10]
    assert "train/loss" not in rows[-1] and "train/train_loss" in rows[-1]



def test_the_last_rows_window_ends_at_the_end_of_training_summary(tmp_path: Path) -> None:
    """Steps after the last training log get a row at on_train_end; its window ends at
    Hugging Face's end-of-training summary log, not at our on_train_end: the callbacks whose
    on_train_end runs before ours (MLflowCallback's end_run, which flushes MLflow's async
    queue: 0.25 s a step of the last row where a step took 0.01 s) and the loading of the best
    model are no training step."""

    ended: list[float] = []

    class SlowEnd(transformers.TrainerCallback):  # type: ignore[misc]
        def on_train_end(self, *args: Any, **kwargs: Any) -> None:
            ended.append(time.time())
            time.sleep(0.6)

    sink = tmp_path / "gpu.jsonl"
    trainer = make_trainer(tmp_path, GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05),
                           max_steps=6, logging_steps=4)
    trainer.callback_handler.callbacks.insert(0, SlowEnd())  # before ours, as report_to's
    trainer.train()
    rows = read_jsonl(sink)
    assert [r["step"] for r in rows] == [4, 6]
    last = rows[-1]
    assert last["perf/steps"] == 2 and "train/train_loss" in last
    assert last["time"] < ended[0], (last["time"], ended)  # the window ended before that work


def test_evaluation_logs_make_no_row(tmp_path: Path) -> None:
    sink = tmp_path / "gpu.jsonl"
    trainer = make_trainer(tmp_path, GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05),
                           max_steps=12, logging_steps=4, eval_steps=6)
    trainer.train()
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [6, 12]
    rows = read_jsonl(sink)
    assert [r["step"] for r in rows] == loss_steps(trainer) == [4, 8, 12]
    assert not any(k.startswith("train/eval_") for r in rows for k in r)


def test_data_wait_share_follows_a_slow_dataloader(tmp_path: Path) -> None:
    """The loader's time lands in the data wait, the model's in forward/backward.

    Compared within the run on one clock (the phases and the dataset's and model's own timings
    are all ``perf_counter`` readings of the training thread): each fetch lies inside a data
    wait and each forward pass inside a forward/backward phase, so the sums compare the same
    way however long the process is starved of CPU (a stall inside a fetch lengthens both
    sides, one elsewhere only a phase), where shares between two runs would not."""
    sink = tmp_path / "gpu.jsonl"
    model, data = Regression(), Points(delay_s=0.01)  # 4 samples x >= 10 ms per step
    trainer = make_trainer(tmp_path, GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05),
                           max_steps=8, logging_steps=8, model=model, dataset=data)
    trainer.train()
    (row,) = read_jsonl(sink)
    assert row["perf/steps"] == 8
    wait, work, opt = (8 * row[f"perf/{p}_s"] for p in ("data_wait", "forward_backward",
                                                       "optimizer"))
    # the fetches of the 8 steps' batches (the loader may fetch one batch ahead: inside the
    # last step's data wait too, but left out here)
    fetched = sum(data.fetch_s[:8 * 4])
    assert len(data.fetch_s) >= 8 * 4 and fetched >= 8 * 4 * 0.01
    assert wait >= fetched - 1e-6
    assert len(model.forward_s) == 8 and work >= sum(model.forward_s) - 1e-6
    assert row["perf/data_wait_pct"] == pytest.approx(100 * wait / (wait + work + opt))


def test_wandb_rows_join_hf_run_on_train_global_step(tmp_path: Path, wandb_offline: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from wandb.sdk.wandb_run import Run

    here: list[dict[str, Any]] = []  # gpulens rows logged by this (the training) process
    real_log = Run.log

    def spy(self: Any, data: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if "gpulens/step" in data:
            here.append(data)
        return real_log(self, data, *args, **kwargs)

    monkeypatch.setattr(Run, "log", spy)
    callback = GPUMonitorCallback(interval=0.05)
    trainer = make_trainer(tmp_path, callback, report_to="wandb")
    trainer.train()
    assert here == []  # written from the engine process, attached to HF's run
    reset_wandb()  # finish the run HF started and let wandb-core write out its file
    history = read_history(find_run_file(wandb_offline))  # exactly one run: no extra run
    loss_rows = [h for h in history if "train/loss" in h]
    gpu_rows = [h for h in history if "gpulens/step" in h]
    assert [h["train/global_step"] for h in loss_rows] == loss_steps(trainer) == [4, 8, 12]
    # each row on its own axis: HF's train/global_step in the same record is HF's, not ours
    assert [h["gpulens/step"] for h in gpu_rows] == [4, 8, 12]
    for row in gpu_rows:
        assert "train/loss" not in row or row in loss_rows  # HF's loss, not written twice
        # the tracker view's name, once (not also the schema's perf/data_wait_pct)
        assert "train/data_wait_pct" in row and "perf/data_wait_pct" not in row
    # W&B's own step only counts commits: never pushed to the training step
    assert [h["_step"] for h in history] == list(range(len(history)))


def test_mlflow_rows_join_hf_run_on_global_step(tmp_path: Path,
                                                mlflow_tracking: MlflowTracking) -> None:
    trainer = make_trainer(tmp_path, GPUMonitorCallback(interval=0.05), report_to="mlflow")
    trainer.train()
    runs = mlflow_tracking.runs()
    assert len(runs) == 1  # HF's run, no extra one
    client = mlflow_tracking.client()
    run_id = runs[0].info.run_id
    loss = client.get_metric_history(run_id, "loss")
    # the tracker view: bare keys, in MLflow's "Model metrics" section beside HF's "loss"
    gpu = client.get_metric_history(run_id, MLFLOW_GPU_KEY)
    assert sorted(m.step for m in loss) == loss_steps(trainer) == [4, 8, 12]
    assert sorted(m.step for m in gpu) == [4, 8, 12]
    assert client.get_metric_history(run_id, "data_wait_pct")
    assert client.get_metric_history(run_id, GPU_KEY) == []  # per-GPU detail: JSONL, W&B
    assert client.get_metric_history(run_id, "train/loss") == []


def test_exception_in_training_stops_monitor_when_callback_is_collected(tmp_path: Path) -> None:
    sink = tmp_path / "gpu.jsonl"
    callback = GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05)
    model = Regression(fail_at=7)
    trainer = make_trainer(tmp_path, callback, model=model, max_steps=12, logging_steps=2)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    monitor = callback.monitor
    assert monitor is not None and monitor.running
    assert len(model._forward_hooks) == 1  # the session's, left by the failed train()
    del trainer, callback
    gc.collect()
    assert not monitor.running
    assert not model._forward_hooks  # the user's model outlives the callback, hook-free
    assert [r["step"] for r in read_jsonl(sink)] == [2, 4, 6]



def test_a_forward_that_raises_hands_the_row_held_since_the_log_to_the_monitor(
        tmp_path: Path) -> None:
    """The forward after a log raises (logging every 2 steps, the seventh forward fails): the
    row of step 6, held since that log for the next forward, reaches the sinks while the
    failed train()'s monitor still runs (Hugging Face has no exception hook; in a notebook
    the Trainer lives on), not only when the callback is collected. Held, it missed a W&B
    run the user finished first (wandb.finish() after the crash)."""
    from gpulens.testing import MemorySink
    from tests.support.wait import wait_until

    sink = MemorySink()
    callback = GPUMonitorCallback(sinks=[sink], interval=0.05)
    model = Regression(fail_at=7)
    trainer = make_trainer(tmp_path, callback, model=model, max_steps=12, logging_steps=2)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    monitor = callback.monitor
    assert monitor is not None and monitor.running  # as before: stopped when collected
    steps = wait_until(lambda: [r.step for r in sink.rows] if len(sink.rows) >= 3 else None,
                       timeout=20, what="the rows of steps 2, 4, 6")
    assert steps == [2, 4, 6]
    assert monitor.running
    callback._stop(collective=False)
    assert [r.step for r in sink.rows] == [2, 4, 6]  # and no row twice


CRASH_SCRIPT = """
import sys, torch
sys.path[:0] = [{root!r}, {src!r}]
import transformers
from tests.test_integration_transformers import Points, Regression
from gpulens.integrations.transformers import GPUMonitorCallback
args = transformers.TrainingArguments(
    output_dir={out!r}, max_steps=12, logging_steps=1, per_device_train_batch_size=4,
    learning_rate=1e-2, report_to="wandb", use_cpu=True, disable_tqdm=True,
    save_strategy="no")
trainer = transformers.Trainer(model=Regression(fail_at=7), args=args, train_dataset=Points(),
                               callbacks=[GPUMonitorCallback(interval=0.05)])
trainer.train()  # raises at the seventh forward; nothing catches it
"""


def test_a_train_that_raises_and_exits_still_leaves_its_rows_in_w_and_b(
        tmp_path: Path, wandb_offline: Path) -> None:
    """``train()`` raises and the script ends there (the commonest crash): the rows of the
    steps done reach HF's W&B run before W&B's exit hook ends its service. Through
    ``weakref.finalize``'s exit hook, registered when torch was imported and so run after
    W&B's, none did: "could not open", "0 rows written, 6 dropped"."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT.format(root=str(root), src=str(root / "src"),
                                          out=str(tmp_path / "out")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 1 and "RuntimeError: boom" in proc.stderr, proc.stderr[-2000:]
    assert "dropped" not in proc.stderr and "could not open" not in proc.stderr, \
        proc.stderr[-2000:]
    history = read_history(find_run_file(wandb_offline))
    loss = [h["train/global_step"] for h in history if "train/loss" in h]
    assert loss == [1, 2, 3, 4, 5, 6]
    assert [h["gpulens/step"] for h in history if "gpulens/step" in h] == loss


def test_second_train_call_restarts_after_a_failed_one(tmp_path: Path) -> None:
    sink = tmp_path / "gpu.jsonl"
    callback = GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05)
    model = Regression(fail_at=3)
    trainer = make_trainer(tmp_path, callback, model=model, max_steps=4, logging_steps=2)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    first = callback.monitor
    model.fail_at = None
    trainer.train()
    assert first is not None and not first.running
    assert callback.monitor is None  # stopped at the end
    assert not model._forward_hooks  # neither train() left its hook behind



def test_a_tracker_named_in_sinks_and_in_report_to_gets_one_sink(tmp_path: Path) -> None:
    """sinks=["wandb:all", "mlflow"] beside report_to=["wandb", "mlflow"] (the README's sink
    names): both name the runs Hugging Face writes to. One sink each, with the user's options
    and without train/* (HF logs those): two W&B sinks of one run failed to open the second
    ("Trying to attach `settings` while in the middle of attaching `settings`", its rows
    dropped), two MLflow sinks wrote every figure twice (train/loss beside HF's loss)."""
    from types import SimpleNamespace

    from gpulens.sinks import SinkSpec

    callback = GPUMonitorCallback(sinks=["wandb:all", "mlflow", "mlflow:abc123",
                                         f"jsonl:{tmp_path / 'g.jsonl'}"])
    args = SimpleNamespace(report_to=["wandb", "mlflow"], output_dir=str(tmp_path))
    sinks = [s for s in callback._sinks_for(args) if isinstance(s, SinkSpec)]
    wandb = [s for s in sinks if s.kind == "wandb"]
    mlflow = [s for s in sinks if s.kind == "mlflow"]
    assert len(wandb) == 1 and wandb[0].options["include_train"] is False
    assert wandb[0].options["keys"] == "all"  # the user's option kept
    # the active run once; a run named by id is another run, kept as given
    assert [(s.options.get("run_id"), s.options.get("include_train")) for s in mlflow] == \
        [(None, False), ("abc123", None)]
    assert [s.kind for s in sinks].count("jsonl") == 1
    args.report_to = []  # not followed: the user's sinks as they are
    assert [s.name for s in callback._sinks_for(args)] == [s.name for s in callback.settings.sinks]


def test_bad_arguments_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="interval"):
        GPUMonitorCallback(interval=0)
    with pytest.raises(ValueError, match="backend"):
        GPUMonitorCallback(backend="cuda")
    with pytest.raises(ValueError, match="unknown sink"):
        GPUMonitorCallback(sinks=["kafka:topic"])


def _mlflow_steps(tracking: MlflowTracking, run: Any, key: str) -> list[int]:
    return sorted(m.step for m in tracking.client().get_metric_history(run.info.run_id, key))


@pytest.mark.usefixtures("mlflow_run_ends_at_once")
def test_every_train_call_writes_into_the_mlflow_run_of_its_loss(
        tmp_path: Path, mlflow_tracking: MlflowTracking,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-used Trainer (a second train()) and a resume from a checkpoint on it: the GPU rows
    of each call go into the MLflow run Hugging Face writes that call's loss to."""
    monkeypatch.setenv("GPULENS_TRACKER_KEYS", "all")  # every key, perf/steps included
    trainer = make_trainer(tmp_path, GPUMonitorCallback(interval=0.05), report_to="mlflow",
                           max_steps=8, logging_steps=4, save_steps=4)
    trainer.train()
    trainer.train()
    trainer.args.max_steps = 12
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-8"))
    runs = mlflow_tracking.runs()
    assert len(runs) == 3, [r.info.run_name for r in runs]  # one per train(), none of gpulens
    for run, steps in zip(runs, ([4, 8], [4, 8], [12]), strict=True):
        assert _mlflow_steps(mlflow_tracking, run, "loss") == steps
        assert _mlflow_steps(mlflow_tracking, run, GPU_KEY) == steps
        assert run.data.tags.get("mlflow.source.name") != "gpulens"
    # the resumed call's first window covers only the steps it ran (9-12)
    (perf,) = mlflow_tracking.client().get_metric_history(runs[2].info.run_id, "perf/steps")
    assert perf.value == 4


@pytest.mark.usefixtures("mlflow_run_ends_at_once")
def test_hyper_parameter_trials_each_write_into_their_own_runs(
        tmp_path: Path, mlflow_tracking: MlflowTracking, wandb_offline: Path) -> None:
    """As a search backend does: train(trial=...) again and again on one Trainer. Hugging Face
    starts a W&B run per trial; MLflow's run comes from gpulens for the trials after the first."""
    trainer = make_trainer(tmp_path, GPUMonitorCallback(interval=0.05),
                           report_to=["wandb", "mlflow"], max_steps=8, logging_steps=4)
    for lr in (1e-2, 1e-3):
        trainer.train(trial={"learning_rate": lr})
    reset_wandb()
    runs = mlflow_tracking.runs()
    assert len(runs) == 2
    for run in runs:
        assert _mlflow_steps(mlflow_tracking, run, "loss") == [4, 8]
        assert _mlflow_steps(mlflow_tracking, run, MLFLOW_GPU_KEY) == [4, 8]
    files = sorted(wandb_offline.rglob("run-*.wandb"))
    assert len(files) == 2
    for path in files:
        history = read_history(path)
        assert [h["train/global_step"] for h in history if "train/loss" in h] == [4, 8]
        assert [h["gpulens/step"] for h in history if "gpulens/step" in h] == [4, 8]


class TokenRegression(Regression):
    main_input_name = "x"  # what include_num_input_tokens_seen counts


@pytest.mark.parametrize("options", [
    {"include_num_input_tokens_seen": True},
    {"logging_first_step": True},
    {"logging_nan_inf_filter": False},
    {"logging_strategy": "epoch", "num_train_epochs": 2, "max_steps": -1},
    {"logging_strategy": "no"},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.usefixtures("mlflow_run_ends_at_once")
def test_logging_options_one_at_a_time(tmp_path: Path, mlflow_tracking: MlflowTracking,
                                       wandb_offline: Path, options: dict[str, Any]) -> None:
    """Rows on HF's logging steps, in both trackers, whatever logging option is on; the end of
    training is HF's on_train_end, not a key some option adds to every log."""
    kwargs: dict[str, Any] = {"max_steps": 12, "logging_steps": 4, **options}
    sink = tmp_path / "gpu.jsonl"
    trainer = make_trainer(tmp_path, GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05),
                           report_to=["wandb", "mlflow"], model=TokenRegression(),
                           dataset=Points(n=48), **kwargs)
    trainer.train()
    reset_wandb()
    final = int(trainer.state.global_step)
    expected = loss_steps(trainer)
    if not expected or expected[-1] != final:
        expected = [*expected, final]  # the tail row written at on_train_end
    rows = read_jsonl(sink)
    assert [r["step"] for r in rows] == expected
    assert sum(r["perf/steps"] for r in rows) == final  # every optimizer step, once
    (run,) = mlflow_tracking.runs()
    assert _mlflow_steps(mlflow_tracking, run, MLFLOW_GPU_KEY) == expected
    assert _mlflow_steps(mlflow_tracking, run, "loss") == loss_steps(trainer)
    history = read_history(find_run_file(wandb_offline))
    assert [h["gpulens/step"] for h in history if "gpulens/step" in h] == expected
    assert [h["train/global_step"] for h in history if "train/loss" in h] == loss_steps(trainer)


def test_unreachable_tracker_is_one_line_before_training(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    sink = tmp_path / "gpu.jsonl"
    trainer = make_trainer(tmp_path, GPUMonitorCallback(sinks=["mlflow", f"jsonl:{sink}"],
                                                        interval=0.05), max_steps=4)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="cannot reach the MLflow tracking server") as err:
        trainer.train()
    assert time.monotonic() - t0 < 60  # bounds a hang: not MLflow's minutes of retries
    assert "\n" not in str(err.value)
    assert not sink.exists()  # nothing half-made


def test_a_gpu_that_does_not_exist_stops_train_before_any_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No driver answers (GPULENS_SIMULATED_GPUS=0) and the callback names GPUs 0 and 1:
    ``train()`` raises the one-line error before the first step, and no record is made."""
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "0")
    sink = tmp_path / "gpu.jsonl"
    model = Regression()
    trainer = make_trainer(tmp_path, GPUMonitorCallback(sinks=[f"jsonl:{sink}"], gpus=[0, 1],
                                                        interval=0.05), model=model)
    with pytest.raises(ValueError, match=r"^GPU 0 does not exist: no NVIDIA driver answered"):
        trainer.train()
    assert model.calls == 0 and trainer.state.global_step == 0
    assert not sink.exists()


def test_a_dashboard_sink_says_where_its_page_is(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    from gpulens.log import NOTICE

    callback = GPUMonitorCallback(sinks=["dashboard:0"], interval=0.05)
    trainer = make_trainer(tmp_path, callback, max_steps=4)
    trainer.train()
    told = [r.getMessage() for r in caplog.records if "dashboard" in r.getMessage()]
    assert len(told) == 1 and told[0].startswith("gpulens: live dashboard on http://127.0.0.1:")
    assert [r.levelno for r in caplog.records if "dashboard" in r.getMessage()] == [NOTICE]


def test_the_monitor_starts_on_the_engine_process_spawned_when_the_trainer_was_built(
    tmp_path: Path,
) -> None:
    """The Trainer's ``on_init_end`` spawns a spare engine process; ``train()`` starts the
    monitor on it (``gpulens.transport.spawn``) instead of waiting for a new interpreter."""
    from gpulens.transport import spawn

    callback = GPUMonitorCallback(sinks=[f"jsonl:{tmp_path / 'rows.jsonl'}"], interval=0.05)
    trainer = make_trainer(tmp_path, callback)
    spare = spawn._spare
    assert spare is not None, "the Trainer was built: a spare engine process waits"
    seen: list[int | None] = []

    class Look(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            seen.append(callback.monitor._transport.pid)  # type: ignore[union-attr]

    trainer.add_callback(Look())
    trainer.train()
    assert set(seen) == {spare.proc.pid}
    assert spawn._spare is None
    assert [r["step"] for r in read_jsonl(tmp_path / "rows.jsonl") if "step" in r] == [4, 8, 12]
    # the same Trainer trained again (a user's second train()): no spare is left to take, its
    # own engine process is spawned and its rows land too
    seen.clear()
    trainer.train()
    assert len(set(seen)) == 1 and spare.proc.pid not in seen and None not in seen
    assert [r["step"] for r in read_jsonl(tmp_path / "rows.jsonl") if "step" in r] == [
        4, 8, 12, 4, 8, 12]


def test_each_trial_of_a_search_starts_on_a_spare_made_at_the_previous_trials_end(
    tmp_path: Path,
) -> None:
    """``hyperparameter_search`` (optuna, three trials) calls ``train()`` per trial on one
    Trainer, with no ``on_init_end`` between: the callback makes the next trial's spare when
    a trial ends, so every trial's monitor starts on a process spawned beforehand; each
    trial's rows land."""
    pytest.importorskip("optuna")
    from gpulens.transport import spawn

    callback = GPUMonitorCallback(sinks=[f"jsonl:{tmp_path / 'rows.jsonl'}"], interval=0.05)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=8, logging_steps=4,
        per_device_train_batch_size=4, report_to="none", use_cpu=True, disable_tqdm=True,
        save_strategy="no", eval_strategy="no", per_device_eval_batch_size=16)
    trainer = transformers.Trainer(model_init=lambda: Regression(), args=args,
                                   train_dataset=Points(), eval_dataset=Points(64),
                                   callbacks=[callback])
    spares: list[int] = []  # the spare waiting as each trial's train() begins
    engines: list[int | None] = []

    class Look(transformers.TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            if spawn._spare is not None:  # runs before gpulens's callback takes it
                spares.append(spawn._spare.proc.pid)

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            engines.append(callback.monitor._transport.pid)  # type: ignore[union-attr]

    trainer.callback_handler.callbacks.insert(0, Look())
    best = trainer.hyperparameter_search(
        direction="minimize", backend="optuna", n_trials=3,
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate",
                                                                     1e-3, 1e-1, log=True)})
    assert best.run_id is not None
    assert len(spares) == 3 and len(set(spares)) == 3, spares
    assert sorted(set(engines)) == sorted(spares)  # each trial ran on the spare it found
    steps = [r["step"] for r in read_jsonl(tmp_path / "rows.jsonl") if "step" in r]
    assert steps == [4, 8] * 3
    spawn.discard()  # the last trial's spare (ends at exit otherwise)

