"""gpulens.work.hf and gpulens.work.precision: real tokens per optimizer step from a real
Hugging Face Trainer run (padding, gradient accumulation), packed batches, and the run's dtype."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from gpulens.log import reset_warnings  # noqa: E402
from gpulens.work.flops import formula_from_config  # noqa: E402
from gpulens.work.hf import (  # noqa: E402
    TokenCounter,
    TokensSeenDelta,
    dtype_from_training_args,
    input_tokens_mode,
    model_flops,
)
from gpulens.work.precision import (  # noqa: E402
    dtype_from_lightning_precision,
    dtype_from_torch,
    float32_matmul_dtype,
)

VOCAB = 128
LENGTHS = [5, 9, 12, 3, 7, 16, 4, 11, 8, 6, 10, 2]  # one epoch: 3 steps x 2 micro x 2 rows


@pytest.fixture(autouse=True)
def _quiet_and_one_thread() -> Iterator[None]:
    reset_warnings()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    reset_warnings()


def _tiny_llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config)


class _Seqs(torch.utils.data.Dataset):  # type: ignore[misc]
    def __init__(self) -> None:
        self.items = [[1 + (i + j) % (VOCAB - 1) for j in range(n)] for i, n in enumerate(LENGTHS)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> list[int]:
        return self.items[i]


def _pad(rows: list[list[int]]) -> dict[str, Any]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_trainer_steps_with_padding_and_gradient_accumulation(tmp_path: Path) -> None:
    model = _tiny_llama()
    formula = model_flops(model)
    assert formula is not None and formula.method == "formula"
    counter = TokenCounter(formula).attach(model)
    seen = TokensSeenDelta()
    steps: list[tuple[Any, int | None]] = []

    class Probe(transformers.TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            seen.update(state.num_input_tokens_seen)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append((counter.take(), seen.update(state.num_input_tokens_seen)))

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=3, include_num_input_tokens_seen="non_padding", use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, learning_rate=1e-3,
        seed=0)
    assert input_tokens_mode(args) == "non_padding"
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Seqs(),
                                   data_collator=_pad, callbacks=[Probe()])
    trainer.train()
    counter.detach()

    assert len(steps) == 3
    for work, hf_delta in steps:
        assert work.micro_batches == 2  # both micro-batches of the step
        assert int(work.tokens) == hf_delta  # the Trainer's own non-padding count agrees
    assert sum(int(w.tokens) for w, _ in steps) == sum(LENGTHS)
    total_flops = sum(float(w.flops) for w, _ in steps)
    assert total_flops == pytest.approx(formula.training_flops(LENGTHS), rel=1e-9)
    # Padding was there, and was not counted as work.
    padded = sum(max(LENGTHS[i], LENGTHS[i + 1]) * 2 for i in range(0, len(LENGTHS), 2))
    assert padded > sum(LENGTHS)


def test_packed_and_varlen_batches() -> None:
    model = _tiny_llama()
    formula = formula_from_config(model.config)
    assert formula is not None
    counter = TokenCounter(formula, attention="causal").attach(model)
    lens = [5, 3, 8]
    ids = torch.randint(1, VOCAB, (1, sum(lens)))
    position_ids = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    model(input_ids=ids, position_ids=position_ids)
    packed = counter.take()
    assert isinstance(packed.flops, torch.Tensor)  # left on the batch's device: no sync
    assert int(packed.tokens) == 16
    assert float(packed.flops) == pytest.approx(formula.training_flops(lens, "causal"))
    assert float(packed.flops) < formula.training_flops([16], "causal")

    counter.observe({"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 5, 8, 16])})
    varlen = counter.take()
    assert float(varlen.flops) == pytest.approx(formula.training_flops(lens, "causal"))

    model.eval()  # evaluation forwards are not training work
    model(input_ids=ids)
    assert counter.take().micro_batches == 0
    counter.detach()


def test_sliding_window_tokens_from_positions() -> None:
    """Per-token positions give the same attention term as the per-sequence form."""
    config = transformers.MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, sliding_window=4)
    formula = formula_from_config(config)
    assert formula is not None and formula.attention_forward_per_pair[0][0] == 4
    lens = [9, 2, 6]
    position_ids = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    for attention in ("full", "causal"):
        c = TokenCounter(formula, attention=attention)  # type: ignore[arg-type]
        c.observe({"input_ids": torch.ones((1, 17), dtype=torch.long),
                   "position_ids": position_ids})
        c.observe({"input_ids": torch.ones((3, 9), dtype=torch.long),
                   "attention_mask": torch.tensor([[1] * n + [0] * (9 - n) for n in lens])})
        work = c.take()
        assert float(work.flops) == pytest.approx(
            2 * formula.training_flops(lens, attention))  # type: ignore[arg-type]


class OpCount(TorchDispatchMode):  # type: ignore[misc]
    """Counts the operators dispatched while it is active that compute (views, such as a
    slice, launch no kernel and are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _mixed_batches() -> list[dict[str, Any]]:
    lens = [5, 3, 8]
    return [
        {"input_ids": torch.ones((3, 9), dtype=torch.long),
         "attention_mask": torch.tensor([[1] * n + [0] * (9 - n) for n in lens])},
        {"input_ids": torch.ones((1, 16), dtype=torch.long),
         "cu_seq_lens_q": torch.tensor([0, 5, 8, 16], dtype=torch.int32)},
        {"input_ids": torch.ones((1, 16), dtype=torch.long),
         "position_ids": torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)},
        {"input_ids": torch.ones((2, 10), dtype=torch.long)},
    ]


def test_deferred_counts_cost_the_training_thread_one_op_a_batch_and_agree() -> None:
    """What the callbacks use: the forward hook launches nothing (it runs just after a log's
    sync, where a launch is idle device time); ``settle()`` (where the device is busy) at most
    one device operation per micro-batch; at the take at most the lengths' ``cat`` and copy;
    the sums and FLOPs run where the values are read (another thread), once, and agree with
    take()'s on-device reduction."""
    import threading

    formula = formula_from_config(_tiny_llama().config)
    assert formula is not None
    eager, deferred = TokenCounter(formula, "causal"), TokenCounter(formula, "causal")
    for batch in _mixed_batches():
        eager.observe(batch)
        with OpCount() as count:
            deferred.observe(batch)
        assert count.ops == [], count.ops
        with OpCount() as count:
            deferred.settle()
        assert len(count.ops) <= 1, count.ops
    expected = eager.take()
    with OpCount() as count:
        work = deferred.take_deferred()
    assert len(count.ops) <= 2 and set(work) == {"tokens", "flops"}, count.ops
    read: dict[str, float] = {}
    reader = threading.Thread(target=lambda: read.update(
        tokens=work["tokens"].item(), flops=float(work["flops"])))
    reader.start()
    reader.join(timeout=60)
    assert read["tokens"] == float(expected.tokens) == 16 + 16 + 16 + 20
    assert read["flops"] == pytest.approx(float(expected.flops), rel=1e-12)
    assert deferred.take_deferred() == {}  # started again
    shapes_only = TokenCounter(formula)
    shapes_only.observe({"input_ids": torch.ones((2, 10), dtype=torch.long)})
    plain = shapes_only.take_deferred()  # nothing to read off a device: plain numbers
    assert plain == {"tokens": 20, "flops": pytest.approx(formula.training_flops([10, 10]))}


def test_deferred_sums_reach_the_host_through_a_polled_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the sums are read like a logged CUDA tensor: a copy to host memory with an
    event behind it, polled (``transport.relay.stage``), never a blocking ``.item()``."""
    from gpulens.transport import relay

    polls: list[int] = []

    class SlowEvent:
        def __init__(self) -> None:
            self.queries = 0

        def query(self) -> bool:
            self.queries += 1
            polls.append(self.queries)
            return self.queries > 3

    staged_on: list[str] = []

    def stage(value: Any, event: Any = None) -> Any:  # what a CUDA tensor gets
        staged_on.append(threading.current_thread().name)
        return relay.Staged(value.clone(), SlowEvent())

    monkeypatch.setattr(relay, "stage", stage)
    formula = formula_from_config(_tiny_llama().config)
    counter = TokenCounter(formula)
    counter.observe({"input_ids": torch.ones((2, 6), dtype=torch.long),
                     "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2])})
    work = counter.take_deferred()
    assert staged_on == ["MainThread"] and polls == []  # the copy starts at the take
    # log() asks whether it can read the counts now (never waits): once the event says so
    assert [work["tokens"].landed() for _ in range(4)] == [False, False, False, True]
    value: dict[str, float] = {}
    reader = threading.Thread(target=lambda: value.update(tokens=float(work["tokens"])),
                              name="reader")
    reader.start()
    reader.join(timeout=60)
    assert value["tokens"] == 10.0 and staged_on == ["MainThread"]
    assert float(work["flops"]) == pytest.approx(formula.training_flops([6, 4]))
    assert polls.count(4) == 1  # the lengths came over as one copy, waited for by polling
    staged_on.clear()
    polls.clear()
    counter.observe({"input_ids": torch.ones((1, 5), dtype=torch.long),
                     "position_ids": torch.tensor([[0, 1, 2, 0, 1]])})  # packed: on the device
    work = counter.take_deferred()
    assert not work["tokens"].landed()  # reduced on the device by its reader: the relay thread
    assert float(work["tokens"]) == 5.0
    assert float(work["flops"]) == pytest.approx(formula.training_flops([3, 2]))
    # tokens are the positions' number (a shape); their FLOPs sum came by a polled copy,
    # started by the reader, here this thread (packed positions are reduced on the device there)
    assert polls.count(4) == 1 and staged_on == ["MainThread"]


def test_a_take_of_lengths_costs_its_reader_no_device_operation() -> None:
    """The reader is the relay thread, which shares the GIL with the training thread, and a
    CUDA call from it contends with the training thread's launches: a take of attention-mask
    lengths starts its one ``cat`` and copy on the taking thread, the reader only sums the
    host's integers (the FLOPs formula too), and the figures agree with ``take()``'s."""
    formula = formula_from_config(_tiny_llama().config)
    assert formula is not None
    eager, deferred = TokenCounter(formula, "causal"), TokenCounter(formula, "causal")
    for n in (3, 9, 1):
        batch = {"input_ids": torch.ones((2, 9), dtype=torch.long),
                 "attention_mask": torch.tensor([[1] * n + [0] * (9 - n), [1] * 9])}
        eager.observe(batch)
        deferred.observe(batch)
    deferred.settle()  # where the session's marks call it: the masks' row sums
    expected = eager.take()
    with OpCount() as taking:
        work = deferred.take_deferred()
    # on a CPU the copy is left out (stage() returns a host tensor as it is)
    assert [op.split(".")[1] for op in taking.ops] == ["cat"], taking.ops
    with OpCount() as count:
        tokens, flops = work["tokens"].item(), work["flops"].item()
    assert count.ops == [], count.ops
    assert tokens == float(expected.tokens) == 3 + 9 + 9 + 9 + 1 + 9
    assert flops == pytest.approx(float(expected.flops), rel=1e-12)
    assert flops == pytest.approx(formula.training_flops([3, 9, 9, 9, 1, 9], "causal"))


def test_a_take_of_many_lengths_is_summed_with_torch_on_the_host_and_agrees() -> None:
    """Beyond ``PYTHON_SUM_MAX`` lengths (a big batch, accumulation) the host copy is summed
    with torch, whose cost does not grow with the lengths as Python's does; same figures."""
    from gpulens.work.deferred import PYTHON_SUM_MAX

    formula = formula_from_config(_tiny_llama().config)
    assert formula is not None
    eager, deferred = TokenCounter(formula, "causal"), TokenCounter(formula, "causal")
    rows = PYTHON_SUM_MAX + 7
    lens = [1 + (7 * r) % 9 for r in range(rows)]
    batch = {"input_ids": torch.ones((rows, 9), dtype=torch.long),
             "attention_mask": torch.tensor([[1] * n + [0] * (9 - n) for n in lens])}
    eager.observe(batch)
    deferred.observe(batch)
    expected = eager.take()
    work = deferred.take_deferred()
    assert work["tokens"].item() == float(expected.tokens) == sum(lens)
    assert work["flops"].item() == pytest.approx(float(expected.flops), rel=1e-12)
    assert work["flops"].item() == pytest.approx(formula.training_flops(lens, "causal"),
                                                 rel=1e-12)


def test_counts_kept_between_takes_are_folded_and_stay_right() -> None:
    from gpulens.work.hf import FOLD_AT

    counter = TokenCounter(None)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    for _ in range(FOLD_AT + 3):
        counter.observe({"input_ids": torch.ones((2, 4), dtype=torch.long),
                         "attention_mask": mask})
    # the first FOLD_AT were reduced into a running total; the 3 since wait for settle()
    assert len(counter._lengths) + len(counter._raw) == 3
    work = counter.take_deferred()
    assert set(work) == {"tokens"} and work["tokens"].item() == 4.0 * (FOLD_AT + 3)


def test_batches_without_a_padding_mask(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpulens")
    c = TokenCounter()  # no formula: tokens only
    c.observe({"input_ids": torch.ones((2, 10), dtype=torch.long)})
    c.observe({"input_ids": torch.ones((2, 10), dtype=torch.long),
               "attention_mask": torch.ones((2, 1, 10, 10))})
    work = c.take()
    assert int(work.tokens) == 40 and work.flops is None and work.micro_batches == 2
    assert any("4-D attention mask" in r.getMessage() for r in caplog.records)


def test_tokens_seen_delta() -> None:
    d = TokensSeenDelta()
    assert d.update(100) is None
    assert d.update(160) == 60
    assert d.update(160) == 0
    assert d.update(40) is None  # went backwards: a resumed run
    assert d.update(90) == 50
    assert input_tokens_mode(SimpleNamespace(include_num_input_tokens_seen=True)) == "all"
    assert input_tokens_mode(SimpleNamespace(include_num_input_tokens_seen="no")) == "no"


def test_dtype_from_training_args(tmp_path: Path) -> None:
    assert dtype_from_training_args(SimpleNamespace(bf16=True, fp16=False)) == "bf16"
    assert dtype_from_training_args(SimpleNamespace(bf16=False, fp16=True)) == "fp16"
    assert dtype_from_training_args(SimpleNamespace(bf16=False, fp16=False, tf32=True)) == "tf32"
    real = transformers.TrainingArguments(output_dir=str(tmp_path / "unused"), use_cpu=True,
                                          report_to=[])
    assert dtype_from_training_args(real) == "fp32"
    half_model = _tiny_llama().to(torch.bfloat16)  # a model loaded in bf16, no autocast
    assert dtype_from_training_args(real, half_model) == "bf16"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 allowed for FP32 products
        assert dtype_from_training_args(real) == "tf32"
        assert float32_matmul_dtype() == "tf32"
        assert dtype_from_torch(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
    assert dtype_from_torch(torch.float32) == "fp32"
    assert dtype_from_torch(torch.bfloat16) == "bf16"
    assert dtype_from_torch(torch.int64) is None


@pytest.mark.parametrize(("precision", "dtype"), [
    ("bf16-mixed", "bf16"), ("bf16-true", "bf16"), ("bf16", "bf16"),
    ("16-mixed", "fp16"), ("16-true", "fp16"), (16, "fp16"),
    ("32-true", "fp32"), (32, "fp32"), ("64-true", "fp64"),
    ("transformer-engine", "fp8"), ("transformer-engine-float16", "fp8"),
    ("nf4-dq", None), ("int8-training", None), ("mixed-whatever", None),
])
def test_lightning_precision(precision: object, dtype: str | None) -> None:
    assert dtype_from_lightning_precision(precision) == dtype


def test_model_flops_without_a_config(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpulens")
    assert model_flops(torch.nn.Linear(4, 4)) is None
    assert any("no Hugging Face config" in r.getMessage() for r in caplog.records)


def test_a_mask_that_cannot_be_summed_is_not_counted_and_never_reported_as_zero(
        caplog: pytest.LogCaptureFixture) -> None:
    """A kept mask whose row sums fail at :meth:`settle` is one WARNING; that micro-batch
    goes uncounted (as a batch ``observe`` cannot read), and a window with no other batch
    has no token figure at all, never a 0."""
    caplog.set_level(logging.WARNING, logger="gpulens")

    class Unsummable(torch.Tensor):
        def sum(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("no sums here")

    bad = {"input_ids": torch.ones((1, 4), dtype=torch.long),
           "attention_mask": torch.ones((1, 4), dtype=torch.long).as_subclass(Unsummable)}
    good = {"input_ids": torch.ones((1, 4), dtype=torch.long),
            "attention_mask": torch.tensor([[1, 1, 0, 0]])}
    counter = TokenCounter(None)
    counter.observe(bad)
    assert counter.take_deferred() == {}
    counter.observe(bad)
    counter.observe(good)
    assert counter.take_deferred()["tokens"].item() == 2
    assert sum("no sums here" in r.getMessage() for r in caplog.records) == 1


def test_a_cut_of_an_attached_counter_leaves_the_hook_with_the_counter() -> None:
    """A cut part holds counts, not the model's hook: closing it (a held row dropped) does not
    stop the live counter from counting the next forwards."""
    model = _tiny_llama().train()
    counter = TokenCounter(model_flops(model)).attach(model)
    mask = torch.tensor([[1, 1, 1, 0]])
    model(input_ids=torch.ones((1, 4), dtype=torch.long), attention_mask=mask)
    part = counter.cut()
    part.close()
    model(input_ids=torch.ones((1, 4), dtype=torch.long), attention_mask=mask)
    assert counter.take_deferred()["tokens"].item() == 3
    counter.close()


def test_a_cut_takes_its_own_batches_later_and_unsettled_masks_still_count() -> None:
    """``cut()`` (the row of a log written at the next step's mark): the counts so far move
    out without a device operation, the next step's batches stay for the next take, and masks
    never settled are summed by the take itself."""
    formula = formula_from_config(_tiny_llama().config)
    assert formula is not None
    counter = TokenCounter(formula, "causal")
    first = {"input_ids": torch.ones((2, 9), dtype=torch.long),
             "attention_mask": torch.tensor([[1] * 4 + [0] * 5, [1] * 9])}
    second = {"input_ids": torch.ones((1, 9), dtype=torch.long),
              "attention_mask": torch.tensor([[1] * 7 + [0] * 2])}
    counter.observe(first)
    with OpCount() as count:
        part = counter.cut()
    assert count.ops == []
    counter.observe(second)  # the next step's forward, before the held row is written
    counter.settle()
    assert part.take_deferred()["tokens"].item() == 4 + 9  # never settled: the take sums it
    assert counter.take_deferred()["tokens"].item() == 7
    assert part.take_deferred() == {} and counter.take_deferred() == {}


def test_replica_threads_count_every_batch_with_folds_between() -> None:
    """``nn.DataParallel`` runs its replicas' forwards, the counter's pre-hook included, on a
    thread each at once: no batch may be lost, also while one thread folds the kept counts."""
    import sys

    from gpulens.work.hf import FOLD_AT

    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    ids = torch.ones((2, 4), dtype=torch.long)
    threads, each = 4, FOLD_AT + 40
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches inside observe(), as often as can be
    try:
        for _ in range(6):  # unlocked, 3 trials in 5 lost batches on a 2-core machine
            counter = TokenCounter(None)
            start = threading.Barrier(threads)

            def replica(counter: TokenCounter = counter,
                        start: threading.Barrier = start) -> None:
                start.wait()
                for _ in range(each):
                    counter.observe({"input_ids": ids, "attention_mask": mask})

            workers = [threading.Thread(target=replica) for _ in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            work = counter.take()
            assert work.micro_batches == threads * each
            assert int(work.tokens) == 4 * threads * each
    finally:
        sys.setswitchinterval(before)


class _Dev:
    """A stand-in for a tensor on a device: where it is, and where it was copied to."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.moved_to: Any = None

    def to(self, device: Any, non_blocking: bool = False) -> _Dev:
        assert non_blocking  # never a wait on the training thread
        out = _Dev(device)
        out.moved_to = device
        return out


def test_counts_on_several_devices_meet_on_the_lowest_numbered() -> None:
    from gpulens.work.deferred import home_device, on_one_device

    one = [_Dev(torch.device("cuda", 0)), _Dev(torch.device("cuda", 0))]
    assert home_device(one) is None and on_one_device(one) is one  # nothing moves
    spread = [_Dev(torch.device("cuda", 3)), _Dev(torch.device("cuda", 1)), 7.0]
    assert home_device(spread) == torch.device("cuda", 1)  # whatever order they came in
    moved = on_one_device(spread)
    assert moved[0].moved_to == torch.device("cuda", 1)
    assert moved[1] is spread[1] and moved[2] == 7.0  # already there; not a tensor
    # counts on the host and on a GPU meet on the GPU (a copy to the host is not waited for)
    mixed = [_Dev(torch.device("cpu")), _Dev(torch.device("cuda", 2))]
    assert home_device(mixed) == torch.device("cuda", 2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (nn.DataParallel)")
@pytest.mark.filterwarnings("ignore:Was asked to gather along dimension 0")  # DataParallel's own
def test_trainer_under_data_parallel_counts_every_replicas_tokens(tmp_path: Path) -> None:
    """Hugging Face wraps the model in ``nn.DataParallel`` when it sees several GPUs and no
    launcher: each replica keeps its chunk's mask on its own GPU."""
    model = _tiny_llama()
    formula = model_flops(model)
    counter = TokenCounter(formula).attach(model)
    seen = TokensSeenDelta()
    steps: list[tuple[Any, Any, int | None]] = []

    class Probe(transformers.TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            assert args.n_gpu >= 2  # the Trainer chose DataParallel
            seen.update(state.num_input_tokens_seen)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            deferred = counter.take_deferred()
            steps.append((deferred, None, seen.update(state.num_input_tokens_seen)))

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3,
        include_num_input_tokens_seen="non_padding", report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, learning_rate=1e-3, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Seqs(),
                                   data_collator=_pad, callbacks=[Probe()])
    trainer.train()
    counter.detach()
    per_step = 2 * args.n_gpu
    assert len(steps) == 3
    for deferred, _, hf_delta in steps:
        assert int(deferred["tokens"].item()) == hf_delta
    assert sum(int(d["tokens"].item()) for d, _, _ in steps) == sum(LENGTHS[:3 * per_step])
    assert sum(d["flops"].item() for d, _, _ in steps) == pytest.approx(
        formula.training_flops(LENGTHS[:3 * per_step]), rel=1e-9)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (nn.DataParallel)")
@pytest.mark.filterwarnings("ignore:Was asked to gather along dimension 0")  # DataParallel's own
def test_callback_rows_under_data_parallel_carry_tokens(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from gpulens.integrations.transformers import GPUMonitorCallback
    from tests.support.jsonl import read_rows

    sink = tmp_path / "gpu.jsonl"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, logging_steps=1,
        report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-3, seed=0)
    trainer = transformers.Trainer(
        model=_tiny_llama(), args=args, train_dataset=_Seqs(), data_collator=_pad,
        callbacks=[GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05)])
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        trainer.train()
    assert args.n_gpu >= 2
    rows = [r for r in read_rows(sink) if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r.get("perf/tokens_per_s", 0) > 0 for r in rows), rows
    assert not [m for m in caplog.messages if "token" in m], caplog.messages
