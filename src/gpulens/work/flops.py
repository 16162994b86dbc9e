"""Analytic model FLOPs of decoder-only transformers, from a Hugging Face config or plain dims.

What is counted (2 FLOPs per multiply-accumulate):

* every product with a weight matrix: the attention projections (Q, K, V, output; DeepSeek's
  latent down/up projections), the MLP (3 matrices when gated — SwiGLU, GeGLU — 2 when plain),
  for MoE layers the router, the ``k`` routed experts each token goes to and the shared
  experts (plus Qwen2-MoE's shared-expert gate), and the LM head (the logits: once, whether
  or not it shares its weight with the input embedding);
* the attention-score products, Q·Kᵀ and scores·V, per query-key pair of each sequence.

Not counted: embedding lookups (a gather, not a product), norms, activations, softmax, rotary
embeddings, biases, dropout and the loss: elementwise work, under 1 % of a modern LLM's FLOPs.

Training = 3 x forward: each product runs once forward and twice backward (gradient of the
input and of the weight), Megatron-LM's ``num_floating_point_operations`` convention.

These are **model FLOPs** (what MFU divides by the peak), not hardware FLOPs: activation
recompute (gradient checkpointing) and FlashAttention's recomputation of the scores in the
backward pass run more products than these, and are deliberately not counted, so a run with
recompute shows a lower MFU for the same tokens per second (PaLM's definition of MFU).

Two conventions for the attention-score term, chosen by ``attention=``:

* ``"full"`` (the default) — each query against every key of its sequence, ``s²`` pairs per
  sequence of ``s`` tokens: PaLM's MFU appendix, torchtitan, verl, nanoGPT, and what
  ``torch.utils.flop_counter.FlopCounterMode`` counts for eager or SDPA attention.
* ``"causal"`` — only the unmasked half, ``s(s+1)/2`` pairs: Megatron-LM (``seq_length / 2``,
  "causal mask") and FlashAttention's benchmarks.

Sliding-window layers count at most ``window`` keys per query in both conventions (``s·min(s, w)``
pairs for "full", as verl does; ``Σ min(i, w)`` for "causal").

Packed or variable-length batches: the step functions take the list of sequence lengths, so the
attention term is ``Σ seqlen²`` (not ``(Σ seqlen)²``, nor ``batch x max_len²``).

:func:`dims_from_config` reads the families it knows (below) and returns ``None`` for anything
else — never a guess — so the caller can fall back to the measured count (:mod:`.counter`).
Known ``model_type`` values: llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, olmo,
olmo2, cohere, granite, phi3 (gated MLP, GQA); gpt2, gpt_bigcode, gpt_neox, gptj, opt, falcon,
phi, starcoder2 (plain MLP); mixtral, olmoe, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3
(MoE; DeepSeek with multi-head latent attention). DeepSeek-V3's multi-token-prediction layers
are not counted: Hugging Face's model does not run them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Attention = Literal["full", "causal"]
"""Convention for the attention-score term (module docstring)."""

ATTENTION_CONVENTIONS: tuple[str, ...] = ("full", "causal")


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank query and key-value paths."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    """``None``: the query is one ``hidden -> heads x qk_head_dim`` projection (V2-Lite)."""


@dataclass(frozen=True)
class ModelDims:
    """The dimensions that set a decoder-only transformer's FLOPs.

    Build one by hand for a model without a Hugging Face config, or get one from
    :func:`dims_from_config`.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    """Query/key width per head (for MLA: ``qk_nope_head_dim + qk_rope_head_dim``)."""
    vocab_size: int
    num_kv_heads: int | None = None
    """Key/value heads (GQA/MQA); ``None`` means as many as query heads (MHA)."""
    intermediate_size: int = 0
    """Width of a dense MLP layer."""
    gated_mlp: bool = True
    """SwiGLU/GeGLU (gate, up, down: 3 matrices) rather than a plain MLP (up, down: 2)."""
    num_experts: int = 0
    """Routed experts of an MoE layer (0: no MoE)."""
    experts_per_token: int = 0
    """Routed experts each token goes to (top-k)."""
    moe_intermediate_size: int = 0
    """Width of one routed expert."""
    shared_expert_intermediate_size: int = 0
    """Total width of the shared experts every token goes through (0: none)."""
    shared_expert_gate: bool = False
    """A ``hidden -> 1`` gate on the shared expert (Qwen2-MoE)."""
    moe_layers: tuple[int, ...] | None = None
    """Indices of the MoE layers; ``None``: every layer when ``num_experts > 0``."""
    mla: MlaDims | None = None
    v_head_dim: int | None = None
    """Value width per head when it differs from ``head_dim``; ``None``: ``head_dim``."""
    layer_windows: tuple[int | None, ...] | None = None
    """Sliding-window size per layer (``None`` entries: full attention); ``None``: all full."""
    logits_input_size: int | None = None
    """Width feeding the LM head (OPT's ``word_embed_proj_dim``); ``None``: ``hidden_size``."""
    extra_forward_macs_per_token: int = 0
    """Other weight products per token outside the layers (OPT's project_in/out)."""
    family: str = "custom"


@dataclass(frozen=True)
class FlopsFormula:
    """Model FLOPs as a function of the sequences in a batch.

    ``forward(seq_lens) = dense_forward_per_token x Σ s  +  Σ_windows per_pair x pairs(s, w)``.
    """

    dense_forward_per_token: float
    """Forward FLOPs per token of every weight product (attention projections, MLP/experts,
    router, LM head)."""
    attention_forward_per_pair: tuple[tuple[int | None, float], ...]
    """``(window, FLOPs)``: forward FLOPs of Q·Kᵀ and scores·V per query-key pair, summed over
    the layers with that sliding window (``None``: full attention)."""
    family: str
    """The architecture family (``model_type``), or the measured model's class."""
    method: str = "formula"
    """``"formula"`` (analytic, this module) or ``"flop_counter"`` (measured, :mod:`.counter`)."""

    def forward_flops(self, seq_lens: Iterable[int], attention: Attention = "full") -> float:
        """Forward FLOPs of one batch holding sequences of these lengths (tokens each)."""
        _check_attention(attention)
        lens = _check_lens(seq_lens)
        total = self.dense_forward_per_token * sum(lens)
        for window, per_pair in self.attention_forward_per_pair:
            total += per_pair * sum(attention_pairs(s, window, attention) for s in lens)
        return total

    def training_flops(self, seq_lens: Iterable[int], attention: Attention = "full") -> float:
        """Forward + backward model FLOPs of one batch: 3 x :meth:`forward_flops`."""
        return 3.0 * self.forward_flops(seq_lens, attention)

    def flops_per_token(
        self, seq_len: int, *, training: bool = True, attention: Attention = "full"
    ) -> float:
        """FLOPs per token when every sequence has ``seq_len`` tokens (the fixed-length form)."""
        if seq_len <= 0:
            raise ValueError(f"seq_len must be a positive number of tokens, got {seq_len}")
        fwd = self.forward_flops([seq_len], attention) / seq_len
        return 3.0 * fwd if training else fwd

    def describe(self) -> dict[str, str | float]:
        """What gave the figure, for the run's metadata."""
        return {
            "flops_method": self.method,
            "flops_family": self.family,
            "flops_dense_forward_per_token": self.dense_forward_per_token,
        }


def attention_pairs(seq_len: int, window: int | None, attention: Attention = "full") -> float:
    """Query-key pairs one layer scores for one sequence of ``seq_len`` tokens.

    ``"full"``: ``s · min(s, w)``; ``"causal"``: ``Σ_{i=1..s} min(i, w)`` (``s(s+1)/2`` without
    a window).
    """
    s = seq_len
    if attention == "full":
        return float(s * (s if window is None else min(s, window)))
    if window is None or s <= window:
        return s * (s + 1) / 2.0
    return window * (window + 1) / 2.0 + (s - window) * float(window)


def formula(dims: ModelDims) -> FlopsFormula:
    """The :class:`FlopsFormula` of a model of these dimensions."""
    _check_dims(dims)
    h, n_heads = dims.hidden_size, dims.num_heads
    kv = dims.num_kv_heads if dims.num_kv_heads is not None else n_heads
    mlp_mats = 3 if dims.gated_mlp else 2
    if dims.mla is not None:
        m = dims.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        v = m.v_head_dim
        q_macs = h * n_heads * qk if m.q_lora_rank is None else (
            h * m.q_lora_rank + m.q_lora_rank * n_heads * qk
        )
        attn_macs = (
            q_macs
            + h * (m.kv_lora_rank + m.qk_rope_head_dim)  # kv down-projection (+ shared rope key)
            + m.kv_lora_rank * n_heads * (m.qk_nope_head_dim + v)  # kv up-projection
            + n_heads * v * h  # output
        )
    else:
        qk = dims.head_dim
        v = dims.v_head_dim if dims.v_head_dim is not None else dims.head_dim
        attn_macs = h * n_heads * qk + h * kv * qk + h * kv * v + n_heads * v * h

    moe_layers = _moe_layer_set(dims)
    dense_mlp = mlp_mats * h * dims.intermediate_size
    moe_mlp = (
        h * dims.num_experts  # router
        + dims.experts_per_token * mlp_mats * h * dims.moe_intermediate_size
        + mlp_mats * h * dims.shared_expert_intermediate_size
        + (h if dims.shared_expert_gate else 0)
    )
    layer_macs = sum(
        attn_macs + (moe_mlp if i in moe_layers else dense_mlp) for i in range(dims.num_layers)
    )
    logits_in = dims.logits_input_size if dims.logits_input_size is not None else h
    macs = layer_macs + logits_in * dims.vocab_size + dims.extra_forward_macs_per_token

    per_pair_layer = 2.0 * n_heads * (qk + v)  # Q·Kᵀ and scores·V, 2 FLOPs per MAC
    windows = dims.layer_windows if dims.layer_windows is not None else (None,) * dims.num_layers
    by_window: dict[int | None, float] = {}
    for w in windows:
        by_window[w] = by_window.get(w, 0.0) + per_pair_layer
    ordered = sorted(by_window.items(), key=lambda kv_: (kv_[0] is not None, kv_[0] or 0))
    return FlopsFormula(
        dense_forward_per_token=2.0 * macs,
        attention_forward_per_pair=tuple(ordered),
        family=dims.family,
    )


def formula_from_config(config: object) -> FlopsFormula | None:
    """:func:`formula` of :func:`dims_from_config`, or ``None`` for an unknown architecture."""
    dims = dims_from_config(config)
    return formula(dims) if dims is not None else None


def flops_per_token(
    dims: ModelDims, seq_len: int, *, training: bool = True, attention: Attention = "full"
) -> float:
    """Model FLOPs per token at a fixed sequence length (training: forward + backward)."""
    return formula(dims).flops_per_token(seq_len, training=training, attention=attention)


def step_flops(
    dims: ModelDims, seq_lens: Sequence[int], *, training: bool = True,
    attention: Attention = "full",
) -> float:
    """Model FLOPs of one batch (packed or padded-free) holding sequences of these lengths."""
    f = formula(dims)
    return f.training_flops(seq_lens, attention) if training else f.forward_flops(
        seq_lens, attention
    )


# --------------------------------------------------------------------------------------------
# Hugging Face configs


class _Unknown(Exception):
    """The config does not say enough to count without guessing."""


_MISSING = object()


def _get(cfg: object, *names: str, default: object = _MISSING) -> object:
    for name in names:
        if isinstance(cfg, Mapping):
            if name in cfg:
                return cfg[name]
        else:
            try:
                return getattr(cfg, name)
            except AttributeError:
                continue
    if default is _MISSING:
        raise _Unknown(f"config has none of {names}")
    return default


def _int(cfg: object, *names: str, default: object = _MISSING) -> int:
    value = _get(cfg, *names, default=default)
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        raise _Unknown(f"{names[0]} is {value!r}")
    if not float(value).is_integer() or value < 0:
        raise _Unknown(f"{names[0]} is {value!r}")
    return int(value)


def _opt_int(cfg: object, *names: str) -> int | None:
    value = _get(cfg, *names, default=None)
    if value is None:
        return None
    return _int(cfg, *names)


def _positive(value: int, what: str) -> int:
    if value <= 0:
        raise _Unknown(f"{what} is {value}")
    return value


_GATED = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2",
    "cohere", "granite", "phi3",
})
_PLAIN = frozenset({
    "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "opt", "falcon", "phi", "starcoder2",
})
_MOE = frozenset({"mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"})

KNOWN_MODEL_TYPES: frozenset[str] = _GATED | _PLAIN | _MOE
"""The ``model_type`` values :func:`dims_from_config` reads."""


def dims_from_config(config: object) -> ModelDims | None:
    """:class:`ModelDims` from a Hugging Face ``PretrainedConfig`` (or a dict of its fields).

    Returns ``None`` for an architecture outside :data:`KNOWN_MODEL_TYPES`, or when a field the
    count needs is missing or not understood (an attention layer type other than full or
    sliding, for example): never a guess.
    """
    model_type = _get(config, "model_type", default=None)
    if not isinstance(model_type, str) or model_type not in KNOWN_MODEL_TYPES:
        return None
    try:
        if model_type in ("gpt2", "gpt_bigcode", "gptj"):
            return _gpt2_like(config, model_type)
        if model_type == "opt":
            return _opt(config)
        if model_type == "falcon":
            return _falcon(config)
        return _decoder(config, model_type)
    except _Unknown:
        return None


def _gpt2_like(cfg: object, family: str) -> ModelDims:
    h = _positive(_int(cfg, "n_embd", "hidden_size"), "hidden size")
    heads = _positive(_int(cfg, "n_head", "num_attention_heads"), "heads")
    inner = _opt_int(cfg, "n_inner")
    kv = heads
    if family == "gpt_bigcode" and _get(cfg, "multi_query", default=True):
        kv = 1
    return ModelDims(
        hidden_size=h, num_layers=_positive(_int(cfg, "n_layer", "num_hidden_layers"), "layers"),
        num_heads=heads, num_kv_heads=kv, head_dim=_head_dim(h, heads),
        vocab_size=_positive(_int(cfg, "vocab_size"), "vocab"),
        intermediate_size=inner if inner else 4 * h, gated_mlp=False, family=family,
    )


def _opt(cfg: object) -> ModelDims:
    h = _positive(_int(cfg, "hidden_size"), "hidden size")
    heads = _positive(_int(cfg, "num_attention_heads"), "heads")
    proj = _opt_int(cfg, "word_embed_proj_dim") or h
    return ModelDims(
        hidden_size=h, num_layers=_positive(_int(cfg, "num_hidden_layers"), "layers"),
        num_heads=heads, head_dim=_head_dim(h, heads),
        vocab_size=_positive(_int(cfg, "vocab_size"), "vocab"),
        intermediate_size=_positive(_int(cfg, "ffn_dim"), "ffn_dim"), gated_mlp=False,
        logits_input_size=proj,
        extra_forward_macs_per_token=0 if proj == h else 2 * proj * h,  # project_in + _out
        family="opt",
    )


def _falcon(cfg: object) -> ModelDims:
    h = _positive(_int(cfg, "hidden_size"), "hidden size")
    heads = _positive(_int(cfg, "num_attention_heads"), "heads")
    if _get(cfg, "new_decoder_architecture", default=False):
        kv = _positive(_int(cfg, "num_kv_heads"), "kv heads")
    elif _get(cfg, "multi_query", default=True):
        kv = 1
    else:
        kv = heads
    ffn = _opt_int(cfg, "ffn_hidden_size") or 4 * h
    return ModelDims(
        hidden_size=h, num_layers=_positive(_int(cfg, "num_hidden_layers"), "layers"),
        num_heads=heads, num_kv_heads=kv, head_dim=_head_dim(h, heads),
        vocab_size=_positive(_int(cfg, "vocab_size"), "vocab"),
        intermediate_size=ffn, gated_mlp=False, family="falcon",
    )


def _decoder(cfg: object, family: str) -> ModelDims:
    h = _positive(_int(cfg, "hidden_size"), "hidden size")
    layers = _positive(_int(cfg, "num_hidden_layers"), "layers")
    heads = _positive(_int(cfg, "num_attention_heads"), "heads")
    kv = _opt_int(cfg, "num_key_value_heads") or heads
    head_dim = _opt_int(cfg, "head_dim") or _head_dim(h, heads)
    vocab = _positive(_int(cfg, "vocab_size"), "vocab")
    gated = family not in _PLAIN
    inter = _opt_int(cfg, "intermediate_size") or 0
    if family in ("gpt_neox", "phi", "starcoder2") or family in _GATED:
        _positive(inter, "intermediate size")
    common: dict[str, object] = {}
    if family in _MOE:
        common = _moe_fields(cfg, family, layers, inter)
    mla: MlaDims | None = None
    if family in ("deepseek_v2", "deepseek_v3"):
        mla = MlaDims(
            kv_lora_rank=_positive(_int(cfg, "kv_lora_rank"), "kv_lora_rank"),
            qk_nope_head_dim=_positive(_int(cfg, "qk_nope_head_dim"), "qk_nope_head_dim"),
            qk_rope_head_dim=_positive(_int(cfg, "qk_rope_head_dim"), "qk_rope_head_dim"),
            v_head_dim=_positive(_int(cfg, "v_head_dim"), "v_head_dim"),
            q_lora_rank=_opt_int(cfg, "q_lora_rank") or None,
        )
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    fields: dict[str, object] = {
        "hidden_size": h, "num_layers": layers, "num_heads": heads, "num_kv_heads": kv,
        "head_dim": head_dim, "vocab_size": vocab, "intermediate_size": inter,
        "gated_mlp": gated, "mla": mla, "layer_windows": _windows(cfg, family, layers),
        "family": family,
    }
    fields.update(common)
    return ModelDims(**fields)  # type: ignore[arg-type]


def _moe_fields(cfg: object, family: str, layers: int, inter: int) -> dict[str, object]:
    k = _positive(_int(cfg, "num_experts_per_tok"), "experts per token")
    if family in ("mixtral", "olmoe"):
        experts = _positive(_int(cfg, "num_local_experts", "num_experts"), "experts")
        return {
            "num_experts": experts, "experts_per_token": k,
            "moe_intermediate_size": _positive(inter, "expert width"), "intermediate_size": 0,
        }
    if family in ("qwen2_moe", "qwen3_moe"):
        experts = _positive(_int(cfg, "num_experts", "num_local_experts"), "experts")
        step = _positive(_int(cfg, "decoder_sparse_step", default=1), "decoder_sparse_step")
        only_mlp = _get(cfg, "mlp_only_layers", default=None) or ()
        if not isinstance(only_mlp, Iterable):
            raise _Unknown("mlp_only_layers")
        dense = {int(i) for i in only_mlp}
        moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        shared = _opt_int(cfg, "shared_expert_intermediate_size") or 0
        if len(moe) < layers:
            _positive(inter, "intermediate size of the dense layers")
        return {
            "num_experts": experts, "experts_per_token": k,
            "moe_intermediate_size": _positive(_int(cfg, "moe_intermediate_size"), "expert width"),
            "shared_expert_intermediate_size": shared,
            "shared_expert_gate": family == "qwen2_moe" and shared > 0,
            "moe_layers": moe,
        }
    # deepseek_v2 / deepseek_v3
    experts = _positive(_int(cfg, "n_routed_experts"), "routed experts")
    width = _positive(_int(cfg, "moe_intermediate_size"), "expert width")
    first_dense = _int(cfg, "first_k_dense_replace", default=0)
    freq = _positive(_int(cfg, "moe_layer_freq", default=1), "moe_layer_freq")
    moe = tuple(i for i in range(layers) if i >= first_dense and i % freq == 0)
    if len(moe) < layers:
        _positive(inter, "intermediate size of the dense layers")
    return {
        "num_experts": experts, "experts_per_token": k, "moe_intermediate_size": width,
        "shared_expert_intermediate_size": (_opt_int(cfg, "n_shared_experts") or 0) * width,
        "moe_layers": moe,
    }


_SLIDING_ALL = frozenset({"mistral", "mixtral", "phi3", "starcoder2"})
_QWEN = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})


def _windows(cfg: object, family: str, layers: int) -> tuple[int | None, ...] | None:
    """Sliding window per layer, from ``layer_types`` where the config has it."""
    types = _get(cfg, "layer_types", default=None)
    window = _opt_int(cfg, "sliding_window")
    if types is not None:
        if not isinstance(types, Sequence) or isinstance(types, str) or len(types) != layers:
            raise _Unknown("layer_types")
        out: list[int | None] = []
        for t in types:
            if t == "full_attention":
                out.append(None)
            elif t == "sliding_attention":
                out.append(_positive(window or 0, "sliding_window"))
            else:  # chunked, linear or other attention: not modelled here
                raise _Unknown(f"layer type {t!r}")
        return tuple(out) if any(w is not None for w in out) else None
    if family in _SLIDING_ALL:
        return (window,) * layers if window else None
    if family in _QWEN:
        if not _get(cfg, "use_sliding_window", default=False) or not window:
            return None
        first = _int(cfg, "max_window_layers", default=layers)
        return tuple(window if i >= first else None for i in range(layers))
    if family == "gemma2":
        return tuple(_positive(window or 0, "sliding_window") if i % 2 == 0 else None
                     for i in range(layers))
    if family == "gemma3_text":
        pattern = _positive(_int(cfg, "sliding_window_pattern", "_sliding_window_pattern",
                                 default=6), "sliding_window_pattern")
        return tuple(None if (i + 1) % pattern == 0 else _positive(window or 0, "sliding_window")
                     for i in range(layers))
    return None


# --------------------------------------------------------------------------------------------
# checks


def _head_dim(hidden: int, heads: int) -> int:
    if hidden % heads:
        raise _Unknown(f"hidden size {hidden} is not a multiple of {heads} heads")
    return hidden // heads


def _moe_layer_set(dims: ModelDims) -> frozenset[int]:
    if dims.num_experts <= 0:
        return frozenset()
    if dims.moe_layers is None:
        return frozenset(range(dims.num_layers))
    return frozenset(dims.moe_layers)


def _check_dims(dims: ModelDims) -> None:
    for name in ("hidden_size", "num_layers", "num_heads", "head_dim", "vocab_size"):
        if getattr(dims, name) <= 0:
            raise ValueError(f"ModelDims.{name} must be positive, got {getattr(dims, name)}")
    if dims.num_experts > 0 and (dims.experts_per_token <= 0 or dims.moe_intermediate_size <= 0):
        raise ValueError("an MoE ModelDims needs experts_per_token and moe_intermediate_size")
    if dims.layer_windows is not None and len(dims.layer_windows) != dims.num_layers:
        raise ValueError(
            f"ModelDims.layer_windows has {len(dims.layer_windows)} entries for "
            f"{dims.num_layers} layers"
        )
    dense_layers = dims.num_layers - len(_moe_layer_set(dims))
    if dense_layers > 0 and dims.intermediate_size <= 0:
        raise ValueError("ModelDims.intermediate_size must be positive for dense MLP layers")


def _check_attention(attention: str) -> None:
    if attention not in ATTENTION_CONVENTIONS:
        raise ValueError(
            f"attention must be one of {ATTENTION_CONVENTIONS}, got {attention!r}"
        )


def _check_lens(seq_lens: Iterable[int]) -> list[int]:
    lens = [int(s) for s in seq_lens]
    for s in lens:
        if s < 0 or not math.isfinite(s):
            raise ValueError(f"sequence lengths must be >= 0 tokens, got {s}")
    return lens
