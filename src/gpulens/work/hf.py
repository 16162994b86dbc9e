"""What a Hugging Face integration calls to get work per step: model FLOPs and real tokens.

* :func:`model_flops` — the model's :class:`~gpulens.work.flops.FlopsFormula`: the analytic
  formula when the architecture is known, else one measurement with ``FlopCounterMode`` on the
  meta device; ``FlopsFormula.method`` records which (``"formula"`` / ``"flop_counter"``).
* :class:`TokenCounter` — counts the real (non-padding) tokens of every training micro-batch
  the model runs, from a forward pre-hook on the model, and their model FLOPs (the per-sequence
  ``Σ seqlen²`` attention term included). Gradient accumulation is counted right because every
  micro-batch's forward is seen, and :meth:`TokenCounter.take` is called once per optimizer
  step. It never synchronises the device: on a GPU the counts stay 0-d device tensors (a few
  tiny kernels per micro-batch) until something reads them off the training thread.
* :class:`TokensSeenDelta` — the same from the Trainer's own ``state.num_input_tokens_seen``
  (``TrainingArguments(include_num_input_tokens_seen="non_padding")`` excludes padding; ``"all"``
  counts it). The Trainer gathers that count over ranks and calls ``.item()`` per micro-batch:
  that cost is the Trainer's, paid only when the user turned it on.
* :func:`dtype_from_training_args` — the compute dtype from ``TrainingArguments``.

transformers and torch are imported only by the functions that need them.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpulens.log import warn_once
from gpulens.work.counter import CounterError, measure_formula
from gpulens.work.deferred import DeferredCount, _Pending, home_device, on_one_device
from gpulens.work.flops import Attention, FlopsFormula, _check_attention, formula_from_config
from gpulens.work.precision import float32_matmul_dtype, normalize_dtype

if TYPE_CHECKING:
    import torch


def _config_of(model_or_config: object) -> object | None:
    if hasattr(model_or_config, "model_type") or isinstance(model_or_config, Mapping):
        return model_or_config
    config = getattr(model_or_config, "config", None)
    if config is None:  # PEFT and similar wrappers
        base = getattr(model_or_config, "base_model", None)
        config = getattr(getattr(base, "model", base), "config", None)
    return config


def model_flops(model_or_config: object, *, measure: bool = True) -> FlopsFormula | None:
    """Model FLOPs of a ``PreTrainedModel`` (or its config): formula first, measured second.

    The measured fallback builds the same class on the meta device (no memory) and counts one
    forward + backward of a causal-LM step with ``FlopCounterMode``; it runs once, when called.
    ``None`` (with one WARNING) when neither gives a figure; ``measure=False`` skips the
    fallback.
    """
    config = _config_of(model_or_config)
    if config is None:
        warn_once("flops:noconfig",
                  "gpulens: %s has no Hugging Face config: model FLOPs unknown, MFU not "
                  "reported", type(model_or_config).__name__)
        return None
    found = formula_from_config(config)
    if found is not None or not measure:
        return found
    name = type(model_or_config).__name__
    try:
        return _measure(model_or_config, config)
    except (CounterError, ImportError, ValueError) as exc:
        warn_once(f"flops:counter:{name}",
                  "gpulens: no FLOPs formula for %s (model_type %r) and measuring it on the "
                  "meta device failed (%s): MFU not reported", name,
                  getattr(config, "model_type", None), exc)
        return None


def _measure(model_or_config: object, config: object) -> FlopsFormula:
    import torch

    if isinstance(config, Mapping):
        raise CounterError("a plain dict config cannot be built into a model")
    cfg = copy.deepcopy(config)
    model_cls: Any = None
    if not hasattr(model_or_config, "model_type"):
        model_cls = type(model_or_config)
        if not hasattr(model_cls, "_from_config"):
            raise CounterError(f"{model_cls.__name__} is not a transformers model class")

    def build() -> torch.nn.Module:
        kwargs = {"attn_implementation": "eager", "dtype": torch.bfloat16}
        if model_cls is not None:
            built: torch.nn.Module = model_cls._from_config(cfg, **kwargs)
            return built
        from transformers import AutoModelForCausalLM

        auto: torch.nn.Module = AutoModelForCausalLM.from_config(
            cfg, **kwargs)
        return auto

    def step(model: torch.nn.Module, seq_len: int) -> None:
        ids = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
        model.train()
        out = model(input_ids=ids, labels=ids)
        loss = out["loss"] if isinstance(out, Mapping) else out[0]
        loss.backward()

    family = str(getattr(config, "model_type", None) or type(model_or_config).__name__)
    return measure_formula(build, step, family=family)


def dtype_from_training_args(args: object, model: object | None = None) -> str | None:
    """The compute dtype of a Trainer run: ``bf16``/``fp16`` when ``TrainingArguments`` asks for
    mixed precision; else the dtype of the model's parameters when they are bf16/fp16 (a model
    loaded in half precision); else fp32 products — ``tf32`` when ``args.tf32`` is true or torch
    allows TF32 for FP32 products, ``fp32`` otherwise."""
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    if model is not None:
        params = getattr(model, "parameters", None)
        if callable(params):
            for p in params():
                name = normalize_dtype(getattr(p, "dtype", None))
                if name in ("bf16", "fp16"):
                    return name
                break
    tf32 = getattr(args, "tf32", None)
    if tf32 is True:
        return "tf32"
    if tf32 is False:
        return "fp32"
    return float32_matmul_dtype()


@dataclass(frozen=True)
class StepWork:
    """Work of the micro-batches seen since the last :meth:`TokenCounter.take`.

    ``tokens`` and ``flops`` are numbers, or 0-d tensors on the batch's device when the batch
    was on a GPU (convert them with ``float()`` off the training thread: that waits for the GPU).
    """

    tokens: Any
    """Real tokens (padding excluded where the batch says what is padding)."""
    flops: Any
    """Training model FLOPs of those tokens (``None`` without a formula)."""
    micro_batches: int


FOLD_AT = 256
"""Micro-batches of tensor counts kept between two takes before they are reduced on the
training thread (a few device operations), which bounds the memory they hold."""


class TokenCounter:
    """Counts the tokens (and model FLOPs) of every training forward of a model.

    ``counter = TokenCounter(model_flops(model)).attach(model)``; after each optimizer step,
    ``work = counter.take()`` (the micro-batches since the previous take). Forwards in eval mode
    (``model.training`` false) are not counted.

    Per micro-batch, from the model's keyword inputs:

    * ``attention_mask`` (2-D): real tokens = its sum; sequence lengths = its row sums.
    * else ``cu_seq_lens_q`` (flattened varlen batches): lengths = its differences.
    * else ``position_ids`` (2-D; packed sequences restart at 0): every token counts, the
      attention term from each token's position (``Σ_pos (2·pos + 1) = Σ s²``).
    * else ``input_ids`` / ``inputs_embeds``: every position is a token, each row a sequence.

    Padding without a mask (a pad id the model only masks in the loss) cannot be told apart and
    counts as work.

    **Cost on the training thread.** The forward pre-hook launches nothing: it keeps the
    micro-batch's mask (or ``cu_seq_lens_q``; packed ``position_ids``; shapes alone cost none).
    :meth:`settle` turns the kept masks into sequence lengths (one device operation each, never
    a synchronisation); the integrations call it where the host runs ahead of the device (the
    Hugging Face callback: at the end of each training forward, whose kernels are queued),
    since work launched just after a synchronisation (the step's first forward, after a log's
    ``loss.item()``; after Hugging Face's ``isnan(loss)`` of every backward) is time the
    device sits idle: on
    an H200 the row sums made in the hook cost +0.25 pp of a 98 ms step
    (``benchmarks/results/2026-11-27-h200-session-parts``). A mask is kept (a reference, no
    copy) no longer than the step that uses it; one a data pipeline rewrites in place before
    it is settled is counted as rewritten. The rest (sums, the FLOPs
    formula) waits for the take: :meth:`take` runs it on the device (a few operations per take,
    the results left there); :meth:`take_deferred` starts the lengths' one copy to the host
    (a ``cat``, the copy and an event: three launches, no wait) and hands the sums to whoever
    reads the values (``Monitor.log``, at a later call once the copy has landed, on the host's
    numbers).
    Every :data:`FOLD_AT` micro-batches without a take, the kept counts are reduced on the
    device into running totals, so the memory they hold stays bounded.
    """

    def __init__(self, formula: FlopsFormula | None = None, attention: Attention = "full"):
        _check_attention(attention)
        self.formula = formula
        self.attention: Attention = attention
        self._handle: Any = None
        self._shape_flops: dict[tuple[int, int], float | None] = {}
        self._observing = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._tokens: int = 0
        """Tokens counted from shapes alone (no tensor to read)."""
        self._flops: float = 0.0
        self._lengths: list[Any] = []
        """Per micro-batch, the lengths of its sequences (1-D integer tensors)."""
        self._positions: list[Any] = []
        """Packed micro-batches' ``position_ids`` (2-D integer tensors)."""
        self._raw: list[tuple[str, Any]] = []
        """Micro-batches' attention masks (``"mask"``) and ``cu_seq_lens_q`` (``"cu"``) not
        yet turned into lengths (:meth:`settle`)."""
        self._folded: tuple[Any, Any] | None = None
        """Running (tokens, FLOPs) of folded tensor counts (0-d tensors on their device)."""
        self._micro = 0

    def attach(self, model: torch.nn.Module) -> TokenCounter:
        """Count every training forward of ``model`` (a forward pre-hook; :meth:`detach`)."""
        self.detach()

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if module.training:
                if args and "input_ids" not in kwargs:
                    kwargs = {**kwargs, "input_ids": args[0]}
                self.observe(kwargs)

        self._handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def close(self) -> None:
        """Stop counting and let go of the counts kept (the end of a run)."""
        self.detach()
        self._reset()

    def observe(self, batch: Mapping[str, Any]) -> None:
        """Add one micro-batch (the model's keyword inputs). Thread-safe: ``nn.DataParallel``
        runs its replicas' forwards, this hook included, on a thread each at once."""
        with self._observing:
            try:
                counted = self._keep(batch)
            except Exception as exc:  # a batch layout this does not understand: say so, go on
                warn_once("tokens:batch",
                          "gpulens: cannot count the tokens of a batch (%s: %s): throughput "
                          "and MFU are not reported for such batches", type(exc).__name__, exc)
                return
            if counted:
                self._micro += 1
                if len(self._lengths) + len(self._positions) + len(self._raw) >= FOLD_AT:
                    self.settle()
                    self._fold()

    def settle(self) -> None:
        """Turn the kept masks into sequence lengths on their device (one operation each, no
        synchronisation), so that no mask is kept past its step. Call it where the host is ahead
        of the device; :meth:`take` and :meth:`take_deferred` call it too."""
        raw, self._raw = self._raw, []
        if not raw:
            return
        import torch

        for kind, t in raw:
            try:
                self._lengths.append(t.sum(dim=1, dtype=torch.int64) if kind == "mask"
                                     else t[1:] - t[:-1])
            except Exception as exc:  # never into training: this micro-batch goes uncounted,
                self._micro -= 1  # as one observe() cannot read (a window of none: no figure)
                warn_once("tokens:settle", "gpulens: cannot count the tokens of a batch (%s: "
                          "%s): throughput and MFU are not reported for such batches",
                          type(exc).__name__, exc)

    def cut(self) -> TokenCounter:
        """The counts kept so far, moved into a counter of their own whose
        :meth:`take_deferred` can run later (no device operation here); this one starts
        again. A row written after its step ended (at a point where the host is ahead of the
        device) reads its own micro-batches, not the next step's."""
        # every count kept so far, whatever fields a count has: the instance's fields copied
        # as one dict, not copy.copy (its reduce protocol is many Python calls; this runs in
        # Hugging Face's on_log, where the device waits)
        part = object.__new__(type(self))
        part.__dict__.update(self.__dict__)
        part._handle = None  # the hook stays this counter's: closing the part detaches nothing
        self._reset()  # new lists here; the part keeps the old ones
        return part

    def take(self) -> StepWork:
        """The work since the previous take, and start again. Tensor counts are reduced on
        their device here (no synchronisation): the values are 0-d tensors there."""
        self.settle()
        micro = self._micro
        tokens, flops = self._reduce_kept()
        work = StepWork(tokens=tokens, flops=flops if (self.formula is not None and micro) else
                        None, micro_batches=micro)
        self._reset()
        return work

    def take_deferred(self) -> dict[str, Any]:
        """The work since the previous take as :meth:`gpulens.Monitor.log` keywords
        (``tokens``, and ``flops`` with a formula; ``{}`` when no micro-batch was counted),
        and start again. Values that need the kept tensors are :class:`DeferredCount` objects
        whose ``item()`` sums them where it is called (``Monitor.log`` calls it at a later
        ``log()`` once :meth:`DeferredCount.landed` holds, or in its relay thread). For
        sequence lengths (the usual case) the copy of the lengths to the host starts here, on
        the calling thread (a ``cat``, the copy, an event: no wait), so reading them takes no
        device operation; packed ``position_ids`` are reduced on the device by the reader."""
        self.settle()  # first: a batch it cannot count leaves the count
        if not self._micro:
            self._reset()
            return {}
        out: dict[str, Any]
        if self._lengths or self._positions or self._folded is not None:
            pending = _Pending(self, self._lengths, self._positions, self._folded)
            out = {"tokens": DeferredCount(pending, 0)}
            if self.formula is not None:
                out["flops"] = DeferredCount(pending, 1)
        else:
            out = {"tokens": self._tokens}
            if self.formula is not None:
                out["flops"] = self._flops
        self._reset()
        return out

    # -- one micro-batch ---------------------------------------------------------------------

    def _keep(self, batch: Mapping[str, Any]) -> bool:
        """Keep what one micro-batch's count needs; False when it has nothing to count."""
        import torch

        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            self._raw.append(("mask", mask))
            return True
        if isinstance(mask, torch.Tensor):
            warn_once("tokens:mask4d",
                      "gpulens: a %d-D attention mask does not say which tokens are padding: "
                      "every position is counted as a token", mask.dim())
        cu = batch.get("cu_seq_lens_q")
        if isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() >= 2:
            self._raw.append(("cu", cu))
            return True
        pos = batch.get("position_ids")
        if isinstance(pos, torch.Tensor) and pos.dim() == 2:
            self._positions.append(pos)
            return True
        ids = batch.get("input_ids")
        if ids is None:
            ids = batch.get("inputs_embeds")
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            rows, length = int(ids.shape[0]), int(ids.shape[1])
            self._tokens += rows * length
            flops = self._shape_flops.get((rows, length), -1.0)
            if flops == -1.0:
                flops = self._shape_flops[(rows, length)] = (
                    None if self.formula is None
                    else self.formula.training_flops([length] * rows, self.attention))
            if flops is not None:
                self._flops += flops
            return True
        return False

    def _fold(self) -> None:
        """Reduce the kept tensor counts into running totals on their device."""
        tokens, flops = self._reduce_tensors(self._lengths, self._positions, self._folded)
        self._lengths, self._positions = [], []
        self._folded = (tokens, flops)

    def _reduce_kept(self) -> tuple[Any, Any]:
        """(tokens, FLOPs) of everything kept: numbers, or 0-d tensors where tensors were."""
        if not (self._lengths or self._positions or self._folded is not None):
            return self._tokens, self._flops
        tokens, flops = self._reduce_tensors(self._lengths, self._positions, self._folded)
        return tokens + self._tokens, (flops + self._flops if flops is not None else None)

    def _reduce_tensors(self, lengths: list[Any], positions: list[Any],
                        folded: tuple[Any, Any] | None) -> tuple[Any, Any]:
        """(tokens, FLOPs) of kept tensor counts, computed where the tensors are."""
        import torch

        tokens: Any = 0
        flops: Any = 0.0 if self.formula is not None else None
        home = home_device([*lengths, *positions, *(folded or ())])
        if home is not None:  # nn.DataParallel's replicas kept counts on every GPU
            lengths, positions = on_one_device(lengths, home), on_one_device(positions, home)
            if folded is not None:
                tokens_f, flops_f = on_one_device(list(folded), home)
                folded = (tokens_f, flops_f)
        if folded is not None:
            tokens, flops = folded
        if lengths:
            lens = torch.cat(lengths) if len(lengths) > 1 else lengths[0]
            tokens = tokens + lens.sum()
            if flops is not None:
                flops = flops + self._flops_of_lengths(lens)
        for pos in positions:
            positions64 = pos.to(torch.int64)
            tokens = tokens + positions64.numel()
            if flops is not None:
                flops = flops + self._flops_of_positions(positions64)
        return tokens, flops

    def _flops_of_lengths(self, lengths: torch.Tensor) -> Any:
        import torch

        f = self.formula
        if f is None:
            return None
        fl = lengths.to(torch.float64)
        total = f.dense_forward_per_token * fl.sum()
        for window, per_pair in f.attention_forward_per_pair:
            if self.attention == "full":
                pairs = fl * (fl if window is None else fl.clamp(max=window))
            elif window is None:
                pairs = fl * (fl + 1) / 2
            else:
                pairs = torch.where(fl <= window, fl * (fl + 1) / 2,
                                    window * (window + 1) / 2 + (fl - window) * window)
            total = total + per_pair * pairs.sum()
        return 3.0 * total

    def _flops_of_positions(self, positions: torch.Tensor) -> Any:
        import torch

        f = self.formula
        if f is None:
            return None
        p = positions.to(torch.float64)
        total: Any = f.dense_forward_per_token * float(positions.numel())
        for window, per_pair in f.attention_forward_per_pair:
            if self.attention == "full":
                # s·min(s, w) = Σ_pos (2·pos + 1 if pos < w else w)
                per_tok = 2 * p + 1 if window is None else torch.where(
                    p < window, 2 * p + 1, torch.full_like(p, float(window)))
            else:
                per_tok = p + 1 if window is None else (p + 1).clamp(max=window)
            total = total + per_pair * per_tok.sum()
        return 3.0 * total


class TokensSeenDelta:
    """Tokens per step from the Trainer's cumulative ``state.num_input_tokens_seen``.

    ``update(state.num_input_tokens_seen)`` returns the tokens since the previous call
    (``None`` the first time, and after the count went backwards: a resumed run). The count
    covers every micro-batch of the step on every rank (the Trainer gathers it).
    """

    def __init__(self) -> None:
        self._last: int | None = None

    def update(self, total: int | float) -> int | None:
        now = int(total)
        last, self._last = self._last, now
        if last is None or now < last:
            return None
        return now - last


def input_tokens_mode(args: object) -> str:
    """``TrainingArguments.include_num_input_tokens_seen`` as ``"all"``, ``"non_padding"`` or
    ``"no"``: only ``"non_padding"`` leaves padding out of :class:`TokensSeenDelta`."""
    mode = getattr(args, "include_num_input_tokens_seen", "no")
    if mode is True:
        return "all"
    if mode is False or mode is None:
        return "no"
    return str(mode)
