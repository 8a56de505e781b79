"""bf16 at ZeRO-0 trains through `MasterWeightAdamW`: the same update as DeepSpeed's bf16 wrapper, resumable."""
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from conftest import recorded_step_gradients, run_on_two_ranks
from fp32_gradient_sums import check_against_reference, step_inputs, trained_engine
from test_training_core import _batch, _settings, _train

import training.core.engine as engine_module
from training.core.engine import create_train_engine
from training.core.lora import apply_lora
from training.core.master_weights import MasterWeightAdamW
from training.core.model_loading import load_causal_lm, load_tokenizer
from training.reliability.checkpointing import CheckpointManager

BF16_ULP = 2.0 ** -7  # relative spacing of bf16 numbers


def _engine(path, tokenizer, deepspeed_wrapper=False, monkeypatch=None, **settings):
    settings = _settings(0, dtype="bf16", **settings)
    if deepspeed_wrapper:
        monkeypatch.setattr(engine_module, "uses_master_weights", lambda *args: False)
    model = load_causal_lm(path, tokenizer, dtype=torch.bfloat16, disable_dropout_layers=True)
    engine = create_train_engine(model, settings)
    monkeypatch and monkeypatch.undo()
    return engine


def _weights(engine):
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def test_bf16_zero0_on_cpu_trains_through_master_weights_with_deepspeed_in_fp32_mode(distributed, tiny_model_dir):
    path = tiny_model_dir("llama")
    engine = _engine(path, load_tokenizer(path))
    assert isinstance(engine.optimizer, MasterWeightAdamW)
    assert not engine.bfloat16_enabled() and engine.gradient_clipping() == 0
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    assert all(m.dtype == torch.float32 for group in engine.optimizer.param_groups for m in group["params"])
    for stage, dtype in ((0, "fp32"), (0, "fp16"), (2, "bf16")):
        assert not _settings(stage, dtype=dtype).master_weights


def _undo_state_initialising_step(engine):
    """DeepSpeed's wrapper creates Adam's state with a zero-gradient step, so its counts start at 1 (its first
    update is ~0.73 lr at betas (0.9, 0.95)); torch's AdamW, and `MasterWeightAdamW`, start at 0."""
    for state in engine.optimizer.optimizer.state.values():
        assert state["step"] == 1 and not state["exp_avg"].any()
        state["step"].zero_()


@pytest.mark.parametrize("clipping", [1e-3, 100.0], ids=["clipped", "unclipped"])
def test_master_weight_adamw_makes_deepspeeds_bf16_update(distributed, tiny_model_dir, monkeypatch, clipping):
    """Same batches, same start, DeepSpeed's bf16 wrapper with its step count aligned: unclipped, the weights are
    equal bit for bit; clipped, the clip factor rounds differently (the fused kernel divides by it), so the
    weights agree to within a bf16 step or two."""
    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(path)
    ours = _engine(path, tokenizer, gradient_clipping=clipping)
    theirs = _engine(path, tokenizer, deepspeed_wrapper=True, monkeypatch=monkeypatch, gradient_clipping=clipping)
    assert not isinstance(theirs.optimizer, MasterWeightAdamW)
    _undo_state_initialising_step(theirs)
    start = _weights(ours)
    ids, mask = _batch(tokenizer)
    for _ in range(4):
        losses, norms = [], []
        for engine in (ours, theirs):
            loss = engine(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            norms.append(engine.get_global_grad_norm())
        assert losses[0] == pytest.approx(losses[1], rel=1e-4)
        assert norms[0] == pytest.approx(norms[1], rel=1e-3)
    assert (norms[0] > clipping) == (clipping < 1)
    for name, weight in _weights(theirs).items():
        assert (weight.float() - start[name].float()).abs().max() > 0, name
        if clipping < 1:
            torch.testing.assert_close(_weights(ours)[name].float(), weight.float(), rtol=2 * BF16_ULP, atol=1e-3,
                                       msg=name)
        else:
            assert torch.equal(_weights(ours)[name], weight), name


def test_a_non_finite_gradient_skips_the_step(distributed, tiny_model_dir):
    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(path)
    engine = _engine(path, tokenizer)
    _train(engine, tokenizer, steps=1)
    before, lr = _weights(engine), engine.get_lr()
    ids, mask = _batch(tokenizer)
    loss = engine(input_ids=ids, attention_mask=mask, labels=ids).loss
    engine.backward(loss * float("nan"))
    engine.step()
    assert engine.skipped_steps == 1 and engine.optimizer.overflow
    assert all(torch.equal(w, before[n]) for n, w in _weights(engine).items())
    losses = _train(engine, tokenizer, steps=3)
    assert not engine.optimizer.overflow and losses[-1] < losses[0]
    assert engine.get_lr() == lr


def test_a_checkpoint_resumes_bit_identically(distributed, tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(path)
    straight = _engine(path, tokenizer)
    _train(straight, tokenizer, steps=2)
    CheckpointManager(tmp_path).save(2, {"actor": straight})
    _train(straight, tokenizer, steps=3)
    resumed = _engine(path, tokenizer)
    CheckpointManager(tmp_path).load_latest({"actor": resumed})
    _train(resumed, tokenizer, steps=3)
    for name, weight in _weights(straight).items():
        assert torch.equal(_weights(resumed)[name], weight), name


def test_resumes_a_checkpoint_of_deepspeeds_bf16_wrapper(distributed, tiny_model_dir, tmp_path, monkeypatch):
    """A bf16 checkpoint written before this optimizer (DeepSpeed's wrapper state) loads: masters and moments
    carry over, so training goes on as the wrapper would have (within rounding)."""
    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(path)
    theirs = _engine(path, tokenizer, deepspeed_wrapper=True, monkeypatch=monkeypatch)
    _train(theirs, tokenizer, steps=2)
    CheckpointManager(tmp_path).save(2, {"actor": theirs})
    _train(theirs, tokenizer, steps=2)
    ours = _engine(path, tokenizer)
    CheckpointManager(tmp_path).load_latest({"actor": ours})
    assert ours.optimizer.state[ours.optimizer.masters()[0]]["exp_avg"].abs().sum() > 0
    _train(ours, tokenizer, steps=2)
    for name, weight in _weights(theirs).items():
        torch.testing.assert_close(_weights(ours)[name].float(), weight.float(), rtol=2 * BF16_ULP, atol=1e-3,
                                   msg=name)


def test_lora_only_trains_the_adapters_through_master_weights(distributed, tiny_model_dir):
    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(path)
    model = apply_lora(load_causal_lm(path, tokenizer, dtype=torch.bfloat16), lora_dim=4, lora_module_name="layers.",
                       only_optimize_lora=True)
    engine = create_train_engine(model, _settings(0, dtype="bf16", lora_learning_rate=5e-2))
    assert isinstance(engine.optimizer, MasterWeightAdamW)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    assert len(engine.optimizer.masters()) == len(trained)
    before = _weights(engine)
    losses = _train(engine, tokenizer, steps=6)
    assert losses[-1] < losses[0]
    after = _weights(engine)
    for name in before:
        assert torch.equal(before[name], after[name]) == (name not in trained), name


@pytest.mark.parametrize("accumulation", [1, 8])
def test_micro_batch_gradients_are_summed_in_fp32(distributed, accumulation):
    """8 micro-batches whose bf16 gradients a bf16 sum rounds (their sum in bf16 missed the fp32 one by up to 2.7%):
    the norm and the fp32 weights after two steps are those of torch's AdamW on the fp32 sums, bit for bit. One
    micro-batch a step: its bf16 gradient cast to fp32, bit for bit as before."""
    assert check_against_reference(accumulation) == ""


TWO_RANKS_FP32_SUMS = """
from fp32_gradient_sums import check_against_reference
from utils.dist import get_rank, init_distributed
init_distributed()
mismatch = check_against_reference(accumulation=8)
print(f"rank {get_rank()}: " + (f"MISMATCH {mismatch}" if mismatch else "FP32_SUMS_AVERAGED"), flush=True)
"""


@pytest.mark.slow
def test_two_ranks_average_their_fp32_gradient_sums(tmp_path):
    """Over two gloo ranks with inputs of their own, the engine's all-reduce after the 8th micro-batch averages the
    ranks' fp32 sums (it averaged their bf16 sums): each rank's weights are the reference's bit for bit."""
    stdout = run_on_two_ranks(TWO_RANKS_FP32_SUMS, tmp_path)
    assert stdout.count("FP32_SUMS_AVERAGED") == 2, stdout[-3000:]


def test_zero_grad_drops_the_gradients_summed_so_far(distributed):
    """`optimizer.zero_grad()` between two backwards: the step takes the second backward's gradient alone (torch's
    own zero_grad cleared the fp32 buffers but left the summed gradient in the bf16 weights)."""
    engine = trained_engine(accumulation=1)
    dropped, kept = step_inputs(0, rank=0, accumulation=2)
    for inputs in (dropped, kept):
        engine.optimizer.zero_grad()
        engine.backward(engine(inputs.to(torch.bfloat16)).sum())
    engine.step()
    assert engine.get_global_grad_norm() == float(torch.linalg.vector_norm(kept))


def _linear_optimizer(model: torch.nn.Module) -> MasterWeightAdamW:
    return MasterWeightAdamW([{"params": list(model.parameters()), "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95))


def test_a_dropped_optimizer_lets_go_of_its_weights_and_a_new_one_trains_them():
    """The gradient hooks reach their optimizer through a weak reference: once the first optimizer is dropped it
    is freed (its fp32 masters and Adam state with it), a backward leaves the weight its gradient, and a second
    optimizer over the same weights sums that gradient (its hook had failed on the gradient the first one took)."""
    model = torch.nn.Linear(4, 1, bias=False, dtype=torch.bfloat16)
    inputs = torch.tensor([[1.0, 0.5, -1.0, 0.25]], dtype=torch.bfloat16)
    first = weakref.ref(_linear_optimizer(model))
    gc.collect()
    assert first() is None
    model(inputs).sum().backward()
    assert torch.equal(model.weight.grad, inputs)
    model.weight.grad = None
    second = _linear_optimizer(model)
    model(inputs).sum().backward()
    second.step()
    assert second.masters()[0].grad.tolist() == inputs.float().tolist()
    assert model.weight.grad is None


def test_the_recorded_step_gradient_of_a_master_weight_engine_is_its_fp32_sum(distributed, monkeypatch):
    """tests/conftest.py's `recorded_step_gradients` reads a master-weight engine's fp32 sums (its weights hold no
    gradient after a backward): two micro-batches' gradients, summed in fp32."""
    from training.reliability import guards

    stepping = SimpleNamespace(step_engine=guards.step_engine)
    gradients = recorded_step_gradients(monkeypatch, stepping)
    engine = trained_engine(accumulation=2)
    micro_batches = step_inputs(0, rank=0, accumulation=2)
    for inputs in micro_batches:
        engine.backward(engine(inputs.to(torch.bfloat16)).sum())
        stepping.step_engine(engine, "actor")
    assert gradients["actor"].tolist() == sum(inputs.float() / 2 for inputs in micro_batches).flatten().tolist()


def test_the_placement_microbenchmark_times_the_master_weight_step_as_training_runs_it(monkeypatch):
    """The optimizer's time per parameter leaves out the casts of the bf16 gradients into their fp32 sums: in
    training the backward hooks make them, and the cost model charges them to the backward."""
    from training.placement import microbench

    casts = {"untimed": 0, "timed": 0}
    timing = False
    add_gradient = MasterWeightAdamW._add_gradient

    def counted(optimizer, index, param):
        casts["timed" if timing else "untimed"] += 1
        add_gradient(optimizer, index, param)

    def timed_once(repeats, run, prepare=lambda: None):
        nonlocal timing
        prepare()
        timing = True
        run()
        timing = False
        return 1.0

    monkeypatch.setattr(MasterWeightAdamW, "_add_gradient", counted)
    monkeypatch.setattr(microbench, "best_of", timed_once)
    microbench.measure_optimizer_s_per_param(torch.bfloat16, parameters=16 * 8, repeats=1)
    assert casts == {"untimed": 16, "timed": 0}
