"""oneDNN-prepacked linear weights: same products as torch.matmul, and a model with them packed gives the same logits."""
import pytest
import torch
from tiny_models import make_tiny_model
from transformers.pytorch_utils import Conv1D

import training.generation.cpu_linear as cpu_linear
from training.generation.cpu_linear import (
    LinearWeight,
    PackedLinear,
    onednn_packing_available,
    pack_linear_layers,
)
from training.generation.lora_terms import LoRATerm

ONEDNN = torch.backends.mkldnn.is_available()


@pytest.mark.skipif(not ONEDNN, reason="this PyTorch build has no oneDNN")
def test_an_x86_build_packs_float32_weights():
    assert onednn_packing_available(torch.float32)
    assert LinearWeight(torch.randn(6, 4)).packed


@pytest.mark.parametrize("shape", [(8, 32), (1, 32), (3, 1, 32), (2, 5, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_weight_equals_the_matmul_for_any_row_count(shape, with_bias):
    torch.manual_seed(0)
    weight, x = torch.randn(48, 32), torch.randn(shape)
    bias = torch.randn(48) if with_bias else None
    expected = x @ weight.t() + (bias if with_bias else 0)
    out = LinearWeight(weight, bias)(x)
    assert out.shape == (*shape[:-1], 48)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(8, 96), (3, 1, 96), (2, 5, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("linear", ["torch", "deepspeed_zero3"])
def test_a_plain_weight_with_a_bias_gives_what_the_training_forwards_linear_gives_to_the_bit(monkeypatch, shape, dtype,
                                                                                         linear):
    """torch's `F.linear` adds the bias inside the product (rounded once); DeepSpeed ZeRO-3's replacement of it,
    process-wide once a ZeRO-3 model is built, adds a 3-D input's bias after a matmul (rounded twice). A bf16
    projection with a bias (Qwen2's q/k/v) gives the bits of whichever the process's training forward calls."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    bound = {"torch": torch._C._nn.linear, "deepspeed_zero3": zero3_linear_wrap}[linear]
    monkeypatch.setattr(torch.nn.functional, "linear", bound)
    torch.manual_seed(0)
    weight, bias, x = torch.randn(80, 96, dtype=dtype), torch.randn(80, dtype=dtype), torch.randn(shape, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(LinearWeight(weight, bias, pack=False)(x), torch.nn.functional.linear(x, weight, bias))


def test_a_conv1d_bias_stays_inside_the_product_whatever_f_linear_is(monkeypatch):
    """GPT-2's `Conv1D` adds its bias inside an addmm of its own, never through `F.linear`: its packed stand-in keeps
    that rounding under DeepSpeed ZeRO-3's replacement of `F.linear` too."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    torch.manual_seed(0)
    conv = Conv1D(80, 96).to(torch.bfloat16).requires_grad_(False)
    torch.nn.init.normal_(conv.bias)
    x = torch.randn(2, 5, 96, dtype=torch.bfloat16)
    model = torch.nn.Sequential(conv)
    packed = pack_linear_layers(model)
    stand_in = model[0].linear if packed else LinearWeight(conv.weight.t(), conv.bias, pack=False,
                                                           functional_bias=False)
    assert not stand_in.functional_bias
    if not stand_in.packed:  # a packed product has oneDNN's bits, not the addmm's
        assert torch.equal(stand_in(x), conv(x))


def test_weights_that_need_gradients_or_packing_turned_off_stay_plain():
    weight = torch.randn(6, 4)
    assert not LinearWeight(weight, pack=False).packed
    assert LinearWeight(weight, pack=False).weight is weight
    assert not LinearWeight(weight.clone().requires_grad_()).packed


def test_without_onednn_the_plain_matmul_runs(monkeypatch):
    monkeypatch.setattr(cpu_linear, "onednn_packing_available", lambda dtype: False)
    weight, x = torch.randn(6, 4), torch.randn(3, 4)
    linear = LinearWeight(weight, torch.ones(6))
    assert not linear.packed
    torch.testing.assert_close(linear(x), x @ weight.t() + 1)


@pytest.mark.skipif(not ONEDNN, reason="this PyTorch build has no oneDNN")
@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_packing_a_models_linear_layers_keeps_its_logits(arch):
    model, tokenizer = make_tiny_model(arch)
    model.eval().requires_grad_(False)
    ids = torch.randint(3, len(tokenizer), (2, 7))
    linear_layers = [m for m in model.modules() if type(m) in (torch.nn.Linear, Conv1D)]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        replaced = pack_linear_layers(model)
        out = model(input_ids=ids).logits
    assert replaced == len(linear_layers) > 0
    assert not any(type(m) in (torch.nn.Linear, Conv1D) for m in model.modules())
    assert all(m.linear.packed for m in model.modules() if isinstance(m, PackedLinear))
    assert isinstance(model.get_input_embeddings().weight, torch.nn.Parameter)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pack", [True, False])
def test_a_reduced_linear_keeps_its_reduce_when_packed(pack):
    """The cross-rank sum of a row-parallel shard is part of the layer: packing must not drop it. Its bias, whole on
    every rank, is added once, after the sum."""
    calls = []

    def reduce(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        return 2 * x

    model = torch.nn.Sequential(cpu_linear.ReducedLinear(8, 4, reduce, bias=True)).requires_grad_(False)
    x = torch.randn(3, 8)
    expected = 2 * (x @ model[0].weight.T) + model[0].bias
    if pack:
        assert pack_linear_layers(model) == (1 if ONEDNN else 0)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert calls == [torch.Size([3, 4])]


def test_a_half_precision_row_parallel_shard_is_never_packed():
    """Its sum takes fp32 partials, which oneDNN's half-precision product does not give."""
    model = torch.nn.Sequential(cpu_linear.ReducedLinear(8, 4, lambda x: x, dtype=torch.bfloat16),
                                torch.nn.Linear(8, 4, dtype=torch.bfloat16)).requires_grad_(False)
    packed = pack_linear_layers(model)
    assert isinstance(model[0], cpu_linear.ReducedLinear)
    assert packed == int(onednn_packing_available(torch.bfloat16))
    assert not LinearWeight(model[0].weight, reduce=lambda x: x).packed


def row_parallel_outputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         lora: LoRATerm | None) -> list[torch.Tensor]:
    """Each of two ranks' `reduced_linear` output for its row-parallel shard of a layer (x, W and a LoRA term's A
    split by input columns), the cross-rank sum played in this process: the ranks' partials recorded in a first pass,
    their sum handed to each in a second."""
    inputs, weights = x.chunk(2, dim=-1), weight.chunk(2, dim=-1)
    terms = [None, None] if lora is None else [LoRATerm(a.contiguous(), lora.B) for a in lora.A.chunk(2, dim=-1)]
    partials: list[torch.Tensor] = []
    for rank in range(2):
        cpu_linear.reduced_linear(inputs[rank], weights[rank].contiguous(), bias,
                                  lambda partial: partials.append(partial.clone()) or partial, terms[rank])
    total = partials[0] + partials[1]
    return [cpu_linear.reduced_linear(inputs[rank], weights[rank].contiguous(), bias, lambda partial: total.clone(),
                                      terms[rank]) for rank in range(2)]


@pytest.mark.parametrize("shape", [(8, 256), (3, 1, 256), (2, 5, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("linear", ["torch", "deepspeed_zero3"])
@pytest.mark.parametrize("with_bias,with_lora", [(False, False), (True, False), (True, True)])
def test_row_parallel_shards_give_the_whole_layers_output(monkeypatch, shape, dtype, linear, with_bias, with_lora):
    """Two ranks' shards of a projection, summed across ranks, give what the whole layer gives (its bias added as the
    process's `F.linear` adds it, its LoRA term as peft adds it): in bf16 the bits of all but a rare element (an fp32
    sum in another order can cross a rounding boundary; none here). Rounding each rank's bf16 partial and the sum
    again gave other bits in 45% of the outputs."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    monkeypatch.setattr(torch.nn.functional, "linear",
                        {"torch": torch._C._nn.linear, "deepspeed_zero3": zero3_linear_wrap}[linear])
    torch.manual_seed(0)
    weight, x = torch.randn(96, 256, dtype=dtype), torch.randn(shape, dtype=dtype)
    bias = torch.randn(96, dtype=dtype) if with_bias else None
    lora = LoRATerm(0.1 * torch.randn(4, 256, dtype=dtype), torch.randn(96, 4, dtype=dtype)) if with_lora else None
    with torch.no_grad():
        whole = LinearWeight(weight, bias, pack=False, lora=lora)(x)
        first, second = row_parallel_outputs(x, weight, bias, lora)
    assert torch.equal(first, second) and first.shape == whole.shape == (*shape[:-1], 96)
    if dtype == torch.float32:
        torch.testing.assert_close(first, whole, rtol=1e-5, atol=1e-4)
    else:
        assert (first != whole).float().mean() < 1e-2


def test_every_kind_of_projection_adds_its_lora_term_once():
    """`add_lora_terms` on a plain `nn.Linear` (a hook), a `PackedLinear`, a row-parallel shard and a packed one (the
    term inside, before the sum): each gives its layer's output plus (x A^T)(sB)^T."""
    from training.generation.lora_terms import add_lora_terms

    def double(partial: torch.Tensor) -> torch.Tensor:  # the sum over two ranks of equal partials
        return 2 * partial

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16),
                                cpu_linear.ReducedLinear(16, 16, double),
                                cpu_linear.ReducedLinear(16, 16, double)).requires_grad_(False)
    x = torch.randn(3, 16)
    expected = {name: layer(x) for name, layer in model.named_children()}
    for index in (1, 3):
        layer = model[index]
        model[index] = PackedLinear(LinearWeight(layer.weight, layer.bias, reduce=getattr(layer, "reduce", None)))
    terms = {name: LoRATerm(torch.randn(2, 16), torch.randn(16, 2)) for name in expected}
    add_lora_terms(model, terms)
    for name, layer in model.named_children():
        summed_over = 2 if name in ("2", "3") else 1  # a shard's x A^T is summed with its partial product
        torch.testing.assert_close(layer(x), expected[name] + summed_over * terms[name](x), rtol=1e-5, atol=1e-4)
