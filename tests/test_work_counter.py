"""The formula against FlopCounterMode on small real Hugging Face models, and the measured
fallback (gpulens.work.counter) on the meta device.

The real models run on the CPU with eager attention and eager experts, so torch's stock
``FlopCounterMode`` sees every product (its CPU flash-attention kernel and ``_grouped_mm``
have no flop formula in torch 2.13: ``test_stock_counter_misses_grouped_experts`` shows it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from gpulens.work.counter import CounterError, count_flops, measure_formula  # noqa: E402
from gpulens.work.flops import formula_from_config  # noqa: E402
from gpulens.work.hf import model_flops  # noqa: E402

VOCAB = 512

TINY: dict[str, Callable[[], Any]] = {
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128,
        bos_token_id=0, eos_token_id=0),
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB),
    "mixtral": lambda: transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        vocab_size=VOCAB, n_group=2, topk_group=1),
}

SEQ = 32
BATCH = 2


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """Tiny models: torch's intra-op threads only contend on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _real_model(config: Any) -> Any:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager")


def _train_step_flops(model: Any) -> int:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return int(counter.get_total_flops())


@pytest.mark.parametrize("arch", sorted(TINY))
def test_formula_matches_flop_counter_on_real_models(arch: str) -> None:
    config = TINY[arch]()
    f = formula_from_config(config)
    assert f is not None and f.method == "formula"
    counted = _train_step_flops(_real_model(config))
    ours = f.training_flops([SEQ] * BATCH, attention="full")
    assert abs(ours - counted) / counted < 0.05, (arch, ours, counted)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_meta_device_counter_matches_real_count(arch: str) -> None:
    """The measured fallback, run on the meta device, gives the real model's count (Mixtral's
    experts run as ``_grouped_mm`` there, which gpulens counts from the shapes)."""
    config = TINY[arch]()
    measured = _measure_hf(config)
    assert measured.method == "flop_counter"
    counted = _train_step_flops(_real_model(config))
    assert measured.training_flops([SEQ] * BATCH) == pytest.approx(counted, rel=1e-6)


def _measure_hf(config: Any) -> Any:
    def build() -> Any:
        return transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=torch.bfloat16)

    def step(model: Any, s: int) -> None:
        ids = torch.zeros((1, s), dtype=torch.long, device="meta")
        model(input_ids=ids, labels=ids).loss.backward()

    return measure_formula(build, step, family=config.model_type)


def test_stock_counter_misses_grouped_experts() -> None:
    """Why gpulens adds a formula for ``_grouped_mm``: without it the experts are invisible."""
    config = TINY["mixtral"]()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=torch.bfloat16)
    ids = torch.zeros((1, SEQ), dtype=torch.long, device="meta")
    stock = FlopCounterMode(display=False)
    with stock:
        model(input_ids=ids, labels=ids).loss.backward()
    f = formula_from_config(config)
    assert f is not None
    assert stock.get_total_flops() < 0.5 * f.training_flops([SEQ])
    assert count_flops(lambda: model(input_ids=ids, labels=ids).loss.backward()) == (
        pytest.approx(f.training_flops([SEQ]), rel=1e-9))


def test_unknown_architecture_falls_back_to_the_counter() -> None:
    config = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB)
    assert formula_from_config(config) is None
    measured = model_flops(config)
    assert measured is not None and measured.method == "flop_counter"
    assert measured.family == "bloom"
    counted = _train_step_flops(_real_model(config))
    assert measured.training_flops([SEQ] * BATCH) == pytest.approx(counted, rel=1e-6)
    # From a model instance too; a known architecture never runs the counter.
    assert model_flops(_real_model(config)) == measured
    llama = model_flops(_real_model(TINY["llama"]()))
    assert llama is not None and llama.method == "formula"
    assert model_flops(config, measure=False) is None


class _Cubic(torch.nn.Module):
    """Work that grows as s³: not a transformer's a·s + b·s²."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: Any) -> Any:
        return (x @ x @ x).sum() * self.w


class _Uncounted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8, 8))
        self.b = torch.nn.Parameter(torch.zeros(8))

    def forward(self, x: Any) -> Any:
        return torch.ops.aten._addmm_activation(self.b, x, self.w).sum()


def test_counter_refuses_what_it_cannot_count() -> None:
    def cubic_step(model: Any, s: int) -> None:
        model(torch.ones(s, s, device="meta")).backward()

    with pytest.raises(CounterError, match="linear \\+ quadratic"):
        measure_formula(_Cubic, cubic_step, family="cubic")

    def uncounted_step(model: Any, s: int) -> None:
        model(torch.ones(s, 8, device="meta")).backward()

    with pytest.raises(CounterError, match="_addmm_activation"):
        measure_formula(_Uncounted, uncounted_step, family="uncounted")

    def failing_build() -> Any:
        raise RuntimeError("no such layer")

    with pytest.raises(CounterError, match="meta device"):
        measure_formula(failing_build, cubic_step, family="broken")
