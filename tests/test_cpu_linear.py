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
    """The cross-rank sum of a row-parallel shard is part of the layer: packing must not drop it."""
    calls = []

    def reduce(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        return 2 * x

    model = torch.nn.Sequential(cpu_linear.ReducedLinear(8, 4, reduce, bias=True)).requires_grad_(False)
    x = torch.randn(3, 8)
    expected = 2 * (x @ model[0].weight.T + model[0].bias)
    if pack:
        assert pack_linear_layers(model) == (1 if ONEDNN else 0)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert calls == [torch.Size([3, 4])]
