"""gpulens.work.flops against the formulas users trust, transcribed here independently.

* Megatron-LM, ``megatron/training/training.py::num_floating_point_operations`` (the
  ``transformer_flops`` branch, as published in NVIDIA/Megatron-LM main, 2025-2026): every GEMM
  x3 (fwd, wgrad, dgrad) x2 (FMA); attention ``q_proj_size x seq_length / 2 x 2`` (causal half);
  logits ``3 x 2 x hidden x padded_vocab``; MoE routed experts ``x topk`` plus shared experts;
  MLA projections with the ``q_lora_rank``/``kv_lora_rank`` paths. The router is not counted.
* torchtitan, ``torchtitan/models/utils.py::get_dense_model_nparams_and_flops`` and
  ``get_moe_nparams_and_flops``: ``6 x (non-embedding params, MoE experts x topk/num_experts)
  + 12 x layers x heads x head_dim x seq_len`` (no causal discount).
* verl, ``verl/utils/flops_counter.py::_estimate_qwen2_flops``: ``6 x (layer params + 2 x
  vocab x hidden) x tokens + 12 x Σ seqlen² x head_dim x heads x layers``.

gpulens must agree within 1 % with Megatron under ``attention="causal"`` and with torchtitan
under ``attention="full"`` (the two conventions differ by far more than 1 % here, so each
comparison can fail), and differ from verl by exactly the embedding "matmul" verl counts.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from gpulens.work.flops import (
    KNOWN_MODEL_TYPES,
    ModelDims,
    attention_pairs,
    dims_from_config,
    flops_per_token,
    formula,
    formula_from_config,
    step_flops,
)

# --- the configs (as in the models' published config.json files) ---------------------------

LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
             "vocab_size": 32000}
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
             "vocab_size": 128256}
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
             "vocab_size": 152064, "use_sliding_window": False, "sliding_window": 131072}
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
                "sliding_window": None}
QWEN2_MOE_A27B = {"model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24,
                  "num_attention_heads": 16, "num_key_value_heads": 16,
                  "intermediate_size": 5632, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "num_experts": 60,
                  "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "vocab_size": 151936}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128,
               "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
               "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "vocab_size": 129280}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# --- Megatron-LM, transcribed -----------------------------------------------------------------


def megatron_args(cfg: dict[str, Any], seq_length: int) -> SimpleNamespace:
    """Megatron's arguments for a Hugging Face config (as Megatron-Bridge converts them)."""
    n_experts = cfg.get("num_local_experts", cfg.get("num_experts", cfg.get("n_routed_experts")))
    mla = "kv_lora_rank" in cfg
    args = SimpleNamespace(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        group_query_attention=not mla and cfg["num_key_value_heads"] != cfg[
            "num_attention_heads"],
        num_query_groups=cfg["num_key_value_heads"],
        kv_channels=cfg["hidden_size"] // cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"], swiglu=True,
        padded_vocab_size=cfg["vocab_size"],  # already a multiple of 128 for these models
        seq_length=seq_length, num_experts=n_experts, moe_router_topk=cfg.get(
            "num_experts_per_tok"), moe_ffn_hidden_size=cfg.get("moe_intermediate_size"),
        moe_shared_expert_intermediate_size=None, moe_layer_freq=1, mtp_num_layers=None,
        multi_latent_attention=mla, attention_output_gate=False,
    )
    if cfg["model_type"] == "mixtral":
        args.moe_ffn_hidden_size = cfg["intermediate_size"]
    if cfg["model_type"] == "qwen2_moe":
        args.moe_shared_expert_intermediate_size = cfg["shared_expert_intermediate_size"]
    if cfg["model_type"] == "deepseek_v3":
        first = cfg["first_k_dense_replace"]
        args.moe_layer_freq = [0] * first + [1] * (cfg["num_hidden_layers"] - first)
        args.moe_shared_expert_intermediate_size = (
            cfg["n_shared_experts"] * cfg["moe_intermediate_size"])
        args.q_lora_rank = cfg["q_lora_rank"]
        args.kv_lora_rank = cfg["kv_lora_rank"]
        args.qk_head_dim = cfg["qk_nope_head_dim"]
        args.qk_pos_emb_head_dim = cfg["qk_rope_head_dim"]
        args.v_head_dim = cfg["v_head_dim"]
    return args


def megatron_flops(args: SimpleNamespace, batch_size: int) -> float:
    """Megatron's transformer_flops (training FLOPs of one global batch)."""
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_experts is None:
        n_dense, n_moe, topk = args.num_layers, 0, 0
    else:
        freq = args.moe_layer_freq
        pattern = ([1 if i % freq == 0 else 0 for i in range(args.num_layers)]
                   if isinstance(freq, int) else freq)
        n_moe = sum(pattern)
        n_dense = args.num_layers - n_moe
        topk = args.moe_router_topk
    moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    shared_ffn = args.moe_shared_expert_intermediate_size or 0
    fb, fma = 3, 2
    ffn_mult = 3 if args.swiglu else 2
    if args.multi_latent_attention:
        if args.q_lora_rank is None:
            q_term = args.hidden_size * args.num_attention_heads * (
                args.qk_head_dim + args.qk_pos_emb_head_dim)
        else:
            q_term = args.q_lora_rank * (
                args.hidden_size
                + args.num_attention_heads * (args.qk_head_dim + args.qk_pos_emb_head_dim) + 1)
        attn = fb * fma * (
            q_term
            + args.kv_lora_rank * (args.hidden_size + args.num_attention_heads * (
                args.qk_head_dim + args.v_head_dim) + 1)
            + args.hidden_size * args.qk_pos_emb_head_dim
            + args.num_attention_heads * args.v_head_dim * args.hidden_size
            + args.seq_length * args.num_attention_heads * (
                args.qk_head_dim + args.qk_pos_emb_head_dim) / 2
            + args.seq_length * args.num_attention_heads * args.v_head_dim / 2
        )
    else:
        q = args.kv_channels * args.num_attention_heads
        kv = args.kv_channels * args.num_query_groups
        attn = fb * fma * (
            args.hidden_size * (q + kv + kv) + q * args.seq_length / 2 * 2 + q * args.hidden_size
        )
    return batch_size * args.seq_length * (
        fb * fma * args.hidden_size * (
            args.ffn_hidden_size * ffn_mult * n_dense
            + moe_ffn * topk * ffn_mult * n_moe
            + shared_ffn * ffn_mult * n_moe
        )
        + attn * args.num_layers
        + fb * fma * args.hidden_size * args.padded_vocab_size
    )


# --- torchtitan, transcribed ----------------------------------------------------------------


def torchtitan_named_params(cfg: dict[str, Any]) -> dict[str, int]:
    """Parameter sizes by name, as torchtitan's Llama 3 / MoE modules name them."""
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, v = h // heads, cfg["vocab_size"]
    p: dict[str, int] = {"tok_embeddings.weight": v * h, "norm.weight": h, "output.weight": h * v}
    for i in range(n_layers):
        pre = f"layers.{i}."
        p[pre + "attention.wq.weight"] = h * heads * hd
        p[pre + "attention.wk.weight"] = h * kv * hd
        p[pre + "attention.wv.weight"] = h * kv * hd
        p[pre + "attention.wo.weight"] = heads * hd * h
        p[pre + "attention_norm.weight"] = h
        p[pre + "ffn_norm.weight"] = h
        experts = cfg.get("num_local_experts", cfg.get("num_experts"))
        if experts:
            ffn = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
            p[pre + "moe.router.gate.weight"] = h * experts
            for w in ("w1", "w2", "w3"):
                p[pre + f"moe.experts.{w}"] = experts * h * ffn
            shared = cfg.get("shared_expert_intermediate_size")
            if shared:
                for w in ("w1", "w2", "w3"):
                    p[pre + f"moe.shared_experts.{w}.weight"] = h * shared
        else:
            for w in ("w1", "w2", "w3"):
                p[pre + f"feed_forward.{w}.weight"] = h * cfg["intermediate_size"]
    return p


def torchtitan_flops_per_token(cfg: dict[str, Any], seq_len: int) -> float:
    named = torchtitan_named_params(cfg)
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts:
        emb = router = shared = exp = dense = 0
        for name, n in named.items():
            if "embedding" in name:
                emb += n
                dense += n
            elif "moe.shared_experts" in name:
                shared += n
            elif "moe.router" in name:
                router += n
            elif "moe.experts" in name:
                exp += n
            else:
                dense += n
        active = router + shared + exp * cfg["num_experts_per_tok"] // experts
        non_embedding = dense - emb + active
    else:
        non_embedding = sum(named.values()) - named["tok_embeddings.weight"]
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    q = cfg["hidden_size"] // heads
    return 6 * non_embedding + 12 * layers * heads * q * seq_len


# --- verl, transcribed ---------------------------------------------------------------------


def verl_flops(cfg: dict[str, Any], batch_seqlens: list[int]) -> float:
    h, v, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    mlp_n = h * cfg["intermediate_size"] * 3
    attn_linear_n = h * (heads * hd + kv * hd + kv * hd + heads * hd)
    dense_n = (mlp_n + attn_linear_n) * n_layers + v * h * 2
    attn = 12 * sum(s * s for s in batch_seqlens) * hd * heads * n_layers
    return 6 * dense_n * sum(batch_seqlens) + attn


# --- the checks ----------------------------------------------------------------------------

MEGATRON_CASES = [
    ("llama-2-7b", LLAMA2_7B, 4096),
    ("llama-3-8b", LLAMA3_8B, 8192),
    ("qwen2.5-7b (GQA 28/4)", QWEN25_7B, 4096),
    ("mixtral-8x7b (MoE)", MIXTRAL_8X7B, 4096),
    ("qwen2-moe-a2.7b (MoE + shared)", QWEN2_MOE_A27B, 4096),
    ("deepseek-v3 (MLA + MoE)", DEEPSEEK_V3, 4096),
]


@pytest.mark.parametrize(("label", "cfg", "seq"), MEGATRON_CASES,
                         ids=[c[0] for c in MEGATRON_CASES])
def test_agrees_with_megatron_causal(label: str, cfg: dict[str, Any], seq: int) -> None:
    f = formula_from_config(cfg)
    assert f is not None and f.method == "formula"
    batch = 4
    ours = f.training_flops([seq] * batch, attention="causal")
    theirs = megatron_flops(megatron_args(cfg, seq), batch)
    assert _rel(ours, theirs) < 0.01, (label, ours, theirs)
    # The other convention is far off: the comparison above can fail.
    assert _rel(f.training_flops([seq] * batch, attention="full"), theirs) > 0.01


TITAN_CASES = [
    ("llama-2-7b", LLAMA2_7B, 4096),
    ("llama-3-8b", LLAMA3_8B, 8192),
    ("qwen2.5-7b (GQA 28/4)", QWEN25_7B, 4096),
    ("mixtral-8x7b (MoE)", MIXTRAL_8X7B, 4096),
    ("qwen2-moe-a2.7b (MoE + shared)", QWEN2_MOE_A27B, 4096),
]


@pytest.mark.parametrize(("label", "cfg", "seq"), TITAN_CASES, ids=[c[0] for c in TITAN_CASES])
def test_agrees_with_torchtitan_full(label: str, cfg: dict[str, Any], seq: int) -> None:
    f = formula_from_config(cfg)
    assert f is not None
    ours = f.flops_per_token(seq, attention="full")
    theirs = torchtitan_flops_per_token(cfg, seq)
    assert _rel(ours, theirs) < 0.01, (label, ours, theirs)
    assert _rel(f.flops_per_token(seq, attention="causal"), theirs) > 0.01


def test_llama3_8b_figure_by_hand() -> None:
    """6 x 7.5e9 matmul params + 12·L·H·d·s: 51.47 GFLOP per token at 4096 tokens."""
    dims = dims_from_config(LLAMA3_8B)
    assert dims is not None
    per_token = flops_per_token(dims, 4096)
    layer = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336
    by_hand = 6 * (32 * layer + 4096 * 128256) + 12 * 32 * 32 * 128 * 4096
    assert per_token == pytest.approx(by_hand, rel=1e-12)
    assert per_token / 1e9 == pytest.approx(51.47, abs=0.01)


def test_differs_from_verl_by_the_embedding_it_counts() -> None:
    """verl counts the input embedding as a matmul (6·V·h per token); gpulens does not. On a
    packed batch of unequal sequences both use Σ seqlen²."""
    lens = [4096, 1024, 3000, 7]
    f = formula_from_config(LLAMA3_8B)
    assert f is not None
    ours = f.training_flops(lens, attention="full")
    theirs = verl_flops(LLAMA3_8B, lens)
    embedding = 6 * LLAMA3_8B["vocab_size"] * LLAMA3_8B["hidden_size"] * sum(lens)
    assert ours + embedding == pytest.approx(theirs, rel=1e-12)
    assert _rel(ours, theirs) > 0.05  # 6 % of Llama-3-8B's work is that lookup


def test_packed_batch_counts_sum_of_squares_not_square_of_sum() -> None:
    f = formula_from_config(LLAMA2_7B)
    assert f is not None
    lens = [2048, 1024, 1024]
    packed = f.training_flops(lens)
    assert packed == pytest.approx(sum(f.training_flops([s]) for s in lens), rel=1e-12)
    assert packed < f.training_flops([sum(lens)])  # one 4096-token sequence scores more pairs
    assert step_flops(dims_from_config(LLAMA2_7B), lens) == pytest.approx(packed)  # type: ignore[arg-type]


def test_attention_pair_counts() -> None:
    assert attention_pairs(10, None, "full") == 100
    assert attention_pairs(10, None, "causal") == 55
    assert attention_pairs(10, 4, "full") == 40
    # causal with a window of 4: 1 + 2 + 3 + 4 + 4·6
    assert attention_pairs(10, 4, "causal") == 1 + 2 + 3 + 4 + 4 * 6
    assert attention_pairs(3, 4, "causal") == 6


def test_sliding_window_layers() -> None:
    mistral = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
               "intermediate_size": 14336, "vocab_size": 32000, "sliding_window": 4096}
    f = formula_from_config(mistral)
    assert f is not None
    assert [w for w, _ in f.attention_forward_per_pair] == [4096]
    no_window = formula_from_config({**mistral, "sliding_window": None})
    assert no_window is not None
    s = 16384
    attn_w = f.training_flops([s]) - 3 * f.dense_forward_per_token * s
    attn_full = no_window.training_flops([s]) - 3 * no_window.dense_forward_per_token * s
    assert attn_w == pytest.approx(attn_full * 4096 / s)
    # Gemma-2-style alternation from layer_types: half the layers windowed.
    gemma2 = {"model_type": "gemma2", "hidden_size": 2304, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
              "intermediate_size": 9216, "vocab_size": 256000, "sliding_window": 4096,
              "layer_types": ["sliding_attention", "full_attention"] * 2}
    g = formula_from_config(gemma2)
    assert g is not None
    assert dict(g.attention_forward_per_pair) == {None: 2 * 2 * 8 * 512.0, 4096: 2 * 2 * 8 * 512.0}


def test_logits_counted_once_tied_or_not() -> None:
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
            "vocab_size": 50257, "tie_word_embeddings": True}
    tied = formula_from_config(gpt2)
    untied = formula_from_config({**gpt2, "tie_word_embeddings": False})
    assert tied is not None and untied is not None
    assert tied.dense_forward_per_token == untied.dense_forward_per_token
    layer = 768 * 3 * 768 + 768 * 768 + 2 * 768 * 3072
    assert tied.dense_forward_per_token == 2 * (12 * layer + 768 * 50257)


def test_opt_projection_and_plain_mlp() -> None:
    opt350 = {"model_type": "opt", "hidden_size": 1024, "num_hidden_layers": 24,
              "num_attention_heads": 16, "ffn_dim": 4096, "word_embed_proj_dim": 512,
              "vocab_size": 50272}
    f = formula_from_config(opt350)
    assert f is not None
    layer = 4 * 1024 * 1024 + 2 * 1024 * 4096
    assert f.dense_forward_per_token == 2 * (24 * layer + 512 * 50272 + 2 * 512 * 1024)


def test_moe_layer_selection() -> None:
    # Qwen2-MoE: dense MLP on layers listed in mlp_only_layers, experts elsewhere.
    cfg = {**QWEN2_MOE_A27B, "num_hidden_layers": 4, "mlp_only_layers": [0, 2]}
    dims = dims_from_config(cfg)
    assert dims is not None and dims.moe_layers == (1, 3) and dims.shared_expert_gate
    # DeepSeek: first_k_dense_replace dense layers, MLA without a q LoRA (V2-Lite).
    lite = {**DEEPSEEK_V3, "model_type": "deepseek_v2", "q_lora_rank": None,
            "num_hidden_layers": 5, "first_k_dense_replace": 1}
    d2 = dims_from_config(lite)
    assert d2 is not None and d2.mla is not None and d2.mla.q_lora_rank is None
    assert d2.moe_layers == (1, 2, 3, 4)


@pytest.mark.parametrize("cfg", [
    {"model_type": "bert", "hidden_size": 768},  # not a known family
    {**LLAMA2_7B, "model_type": "llama4_text"},
    {**LLAMA2_7B, "intermediate_size": None},  # a field the count needs
    {**LLAMA2_7B, "num_hidden_layers": 2, "sliding_window": 8,
     "layer_types": ["full_attention", "chunked_attention"]},  # an attention it cannot model
    {**MIXTRAL_8X7B, "num_experts_per_tok": None},
    {"hidden_size": 4096},  # no model_type
])
def test_unknown_architecture_gives_none(cfg: dict[str, Any]) -> None:
    assert dims_from_config(cfg) is None
    assert formula_from_config(cfg) is None


def test_reads_transformers_config_objects() -> None:
    transformers = pytest.importorskip("transformers")
    for name in ("LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config", "GemmaConfig",
                 "Gemma2Config", "Gemma3TextConfig", "GPT2Config", "GPTNeoXConfig", "OPTConfig",
                 "GPTJConfig", "Phi3Config", "Starcoder2Config", "MixtralConfig",
                 "Qwen2MoeConfig", "Qwen3MoeConfig", "DeepseekV3Config", "OlmoConfig",
                 "OlmoeConfig", "FalconConfig", "GPTBigCodeConfig", "PhiConfig"):
        config = getattr(transformers, name)()
        assert config.model_type in KNOWN_MODEL_TYPES
        f = formula_from_config(config)
        assert f is not None, name
        assert f.family == config.model_type
        assert math.isfinite(f.flops_per_token(2048)) and f.flops_per_token(2048) > 0


def test_bad_inputs_are_user_errors() -> None:
    f = formula_from_config(LLAMA2_7B)
    assert f is not None
    with pytest.raises(ValueError, match="attention"):
        f.training_flops([8], attention="sparse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sequence lengths"):
        f.training_flops([8, -1])
    with pytest.raises(ValueError, match="seq_len"):
        f.flops_per_token(0)
    with pytest.raises(ValueError, match="intermediate_size"):
        formula(ModelDims(hidden_size=8, num_layers=1, num_heads=2, head_dim=4, vocab_size=10))
