"""`MasterWeightAdamW`'s gradient sums against an fp32 reference made by hand, on each rank of the world
(tests/test_master_weights.py: one rank, and two): a bf16 weight vector w trained on loss w.x
for 8 micro-batches a step, whose gradient (x / 8, the engine dividing by the accumulation steps) sums lossily
in bf16: a large first micro-batch, then small ones that a bf16 sum rounds away. Each rank's inputs are its own
(scaled by rank + 1), so an average over the ranks shows in the result too."""
import torch

from training.core.engine import OptimizationSettings, create_train_engine
from utils.dist import get_rank, get_world_size

LEARNING_RATE = 1e-2
BETAS = (0.9, 0.95)
STEPS = 2
WIDTH = 4


def step_inputs(step: int, rank: int, accumulation: int) -> list[torch.Tensor]:
    """The micro-batches' inputs x (each 1 x WIDTH, in bf16 exactly) of one optimizer step on `rank`: at step 0 a
    first input 256 times the others, so that each later gradient is half a bf16 step of the running sum in most
    entries (the bf16 sum stays where it is, the fp32 sum moves); at step 1 equal inputs, so that the second
    Adam update depends on the ratio of the two steps' gradients."""
    scale = rank + 1
    small = torch.tensor([[1.0, 0.5, -1.0, 0.25]]) * scale
    if step == 0:
        return [small * 256] + [small] * (accumulation - 1)
    return [torch.full((1, WIDTH), 8.0 * scale)] * accumulation


def trained_engine(accumulation: int):
    """A bf16 linear layer (no bias) in a ZeRO-0 engine that trains it through `MasterWeightAdamW`, unclipped."""
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, 1, bias=False, dtype=torch.bfloat16)
    settings = OptimizationSettings(learning_rate=LEARNING_RATE, num_training_steps=STEPS, dtype="bf16",
                                    gradient_accumulation_steps=accumulation, gradient_clipping=0.0,
                                    lr_scheduler_type="constant_with_warmup")
    return create_train_engine(model, settings)


def train(engine, accumulation: int) -> list[float]:
    """STEPS optimizer steps on this rank's inputs; the engine's gradient norm of each."""
    norms = []
    for step in range(STEPS):
        for inputs in step_inputs(step, get_rank(), accumulation):
            engine.backward(engine(inputs.to(torch.bfloat16).to(engine.device)).sum())
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return norms


def reference_gradient(step: int, ranks: int, accumulation: int) -> torch.Tensor:
    """The step's gradient summed over the micro-batches in fp32 and averaged over the ranks (exact here)."""
    sums = [sum(inputs.float() / accumulation for inputs in step_inputs(step, rank, accumulation)) for rank in
            range(ranks)]
    return sum(sums) / ranks


def reference_masters(start: torch.Tensor, ranks: int, accumulation: int) -> tuple[torch.Tensor, list[float]]:
    """torch's fused AdamW from the fp32 `start` on the reference gradients: the fp32 weights and each step's
    gradient norm that `MasterWeightAdamW` should reach."""
    weight = start.detach().float().clone().requires_grad_(True)
    optimizer = torch.optim.AdamW([weight], lr=LEARNING_RATE, betas=BETAS, weight_decay=0.0, fused=True)
    norms = []
    for step in range(STEPS):
        weight.grad = reference_gradient(step, ranks, accumulation).to(weight.device)
        norms.append(float(torch.linalg.vector_norm(weight.grad)))
        optimizer.step()
    return weight.detach(), norms


def check_against_reference(accumulation: int) -> str:
    """Train, then compare with the reference: '' where the fp32 weights and norms are the reference's bit for
    bit, else what differs."""
    engine = trained_engine(accumulation)
    start = engine.module.weight.detach().clone()
    norms = train(engine, accumulation)
    masters, reference_norms = reference_masters(start, get_world_size(), accumulation)
    trained = engine.optimizer.masters()[0]
    if torch.equal(trained, masters) and norms == reference_norms:
        return ""
    return f"masters {trained.tolist()} vs reference {masters.tolist()}; norms {norms} vs {reference_norms}"
