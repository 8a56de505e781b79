"""Actor EMA: exact update arithmetic, swapping weights in and out, resume state (each rank its share), ZeRO-3
partitions."""
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import pytest
import torch
from shared_launch import launched_once
from transformers import AutoModelForCausalLM

from step3_rlhf.ema import ModelEMA, save_ema_model
from training.core.ds_config import get_train_ds_config
from training.core.model_loading import load_causal_lm, load_tokenizer
from training.core.save import gathered_state_dict
from utils.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent


def _ema_weights(ema, model) -> dict:
    """The EMA's full weights as the model holds them inside `applied_to`, on every rank (collective under
    ZeRO-3); exact for an fp32 model."""
    module = getattr(model, "module", model)
    with ema.applied_to(model), deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}


def _linear_with_frozen_bias():
    layer = torch.nn.Linear(2, 2)
    layer.bias.requires_grad_(False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    return layer


def test_update_is_exact_and_skips_frozen_parameters():
    layer = _linear_with_frozen_bias()
    ema = ModelEMA(layer, beta=0.75)
    with torch.no_grad():
        layer.weight.fill_(3.0)
    ema.update(layer)  # 0.75 * 1 + 0.25 * 3 = 1.5 (dyadic: exact in fp32)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.5, -1.0], [2.0, 0.0]]))
    ema.update(layer)  # 0.75 * 1.5 + 0.25 * w
    assert set(ema.local_state_dict()) == {"weight"} and ema.state_dict()["num_updates"] == 2
    assert torch.equal(_ema_weights(ema, layer)["weight"], torch.tensor([[1.25, 0.875], [1.625, 1.125]]))


def test_the_ema_of_a_bf16_model_keeps_moves_smaller_than_a_bf16_step():
    """Each update moves the EMA by (1 - beta) x (weight - EMA), far below bf16's spacing (2^-7 at 1.0) at the usual
    beta: an EMA held in the model's bf16 would round every move away and stay at the starting weights."""
    layer = _linear_with_frozen_bias().to(torch.bfloat16)
    ema = ModelEMA(layer, beta=0.75)
    with torch.no_grad():
        layer.weight.fill_(1.0078125)  # 1 + 2^-7, the next bf16 after 1.0
    ema.update(layer)  # 0.75 * 1 + 0.25 * 1.0078125 = 1.001953125 (bf16 would round it to 1.0)
    ema.update(layer)  # 0.75 * 1.001953125 + 0.25 * 1.0078125 = 1.00341796875 (again 1.0 in bf16)
    shadow = ema.local_state_dict()["weight"]
    assert shadow.dtype == torch.float32
    assert torch.equal(shadow, torch.full((4,), 1.00341796875))


def test_applied_to_swaps_in_and_restores_exactly_and_state_resumes():
    layer = _linear_with_frozen_bias()
    ema = ModelEMA(layer, beta=0.5)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(2, 2))
    ema.update(layer)
    own = layer.weight.detach().clone()
    expected = (0.5 * torch.ones(2, 2) + 0.5 * own)
    with ema.applied_to(layer):
        assert torch.equal(layer.weight, expected)
    assert torch.equal(layer.weight, own)

    resumed = ModelEMA(layer, beta=0.9)
    resumed.load_state_dict(ema.state_dict(), ema.local_state_dict())
    assert resumed.beta == 0.5 and resumed.num_updates == 1
    assert torch.equal(_ema_weights(resumed, layer)["weight"], expected)


def test_a_resume_into_another_layout_or_without_its_share_is_refused_clearly():
    ema = ModelEMA(torch.nn.Linear(2, 2), beta=0.5)
    state, shares = ema.state_dict(), ema.local_state_dict()
    assert not any(isinstance(value, torch.Tensor) for value in state.values()), "weights belong in the shares"
    with pytest.raises(UserError, match=r"weight has the shape \(2, 2\) in the checkpoint and \(3, 2\) in this run"):
        ModelEMA(torch.nn.Linear(2, 3)).load_state_dict(state, shares)
    split = {**state, "layout": {**state["layout"], "ranks": 2}}
    with pytest.raises(UserError, match=r"as slices over 2 ranks, this run as slices over 1 rank;"):
        ModelEMA(torch.nn.Linear(2, 2)).load_state_dict(split, shares)
    with pytest.raises(UserError, match="share of the actor EMA's bias is missing"):
        ModelEMA(torch.nn.Linear(2, 2)).load_state_dict(state, {"weight": shares["weight"]})


def test_an_optimizer_step_deepspeed_skipped_leaves_the_ema_alone(distributed, tiny_model_dir):
    """A step with non-finite gradients (finite loss) is skipped, and DeepSpeed still counts it in global_steps: the
    EMA moved toward the unchanged weights and counted an update that did not happen."""
    from step3_rlhf.ppo_trainer import PPOTrainer
    from step3_rlhf.rlhf_engine import RLHFEngine
    from training.core.engine import OptimizationSettings, create_train_engine

    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(path)
    settings = OptimizationSettings(learning_rate=1e-1, num_training_steps=10, micro_batch_size=1,
                                    lr_scheduler_type="constant_with_warmup")
    actor = create_train_engine(load_causal_lm(path, tokenizer, disable_dropout_layers=True), settings)
    ema = ModelEMA(actor, beta=0.5)
    trainer = PPOTrainer.__new__(PPOTrainer)  # only the engine is needed to step the actor
    trainer.engine = RLHFEngine(actor, None, None, None, tokenizer, ema)
    ids = torch.tensor([[5, 6, 7, 8]])

    def loss(nan_gradient: bool) -> torch.Tensor:
        value = actor(input_ids=ids, labels=ids).loss
        if nan_gradient:  # a NaN that only the backward sees, as at positions a loss masks out
            value = torch.where(torch.tensor(False), torch.sqrt(value * 0 - 1), value)
        return value

    trainer._step_actor(loss(False))
    shadow = ema.local_state_dict()
    trainer._step_actor(loss(True))
    assert actor.skipped_steps == 1 and ema.num_updates == 1
    assert all(torch.equal(shadow[name], tensor) for name, tensor in ema.local_state_dict().items())


def test_rejects_bad_beta():
    with pytest.raises(ValueError):
        ModelEMA(torch.nn.Linear(1, 1), beta=1.0)


def _full_params(engine):
    """Full trainable weights on rank 0 (an empty dict on other ranks); collective under ZeRO-3."""
    state = gathered_state_dict(engine.module)
    return {name: state[name].float() for name, p in engine.module.named_parameters() if p.requires_grad and state}


@pytest.mark.parametrize("persistence_threshold", [0, 10_000], ids=["partitioned", "persistent"])
def test_zero3_ema_tracks_partitions_and_saves_ema_weights(persistence_threshold, distributed, tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(path)
    config = get_train_ds_config(stage=3, train_micro_batch_size_per_gpu=2)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = persistence_threshold
    model = load_causal_lm(path, tokenizer, ds_config=config)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config)
    assert all(hasattr(p, "ds_tensor") for p in engine.module.parameters())
    ema = ModelEMA(engine, beta=0.5)
    expected = _full_params(engine)
    batch = tokenizer(["Human: hi Assistant: hello there", "Human: bye Assistant: see you"], return_tensors="pt",
                      padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    for _ in range(2):
        engine.backward(engine(**batch, labels=labels).loss)
        engine.step()
        ema.update(engine)
        current = _full_params(engine)
        expected = {name: 0.5 * expected[name] + 0.5 * current[name] for name in expected}
    shadow = _ema_weights(ema, engine)
    assert set(shadow) == set(expected)
    for name in expected:
        assert torch.equal(shadow[name], expected[name]), name
    assert not torch.equal(expected["model.embed_tokens.weight"], current["model.embed_tokens.weight"])

    out_dir = tmp_path / "actor_ema"
    save_ema_model(ema, engine, tokenizer, out_dir)
    saved = AutoModelForCausalLM.from_pretrained(out_dir).state_dict()
    for name in expected:
        assert torch.equal(saved[name], expected[name]), name
    after = _full_params(engine)
    for name in current:
        assert torch.equal(after[name], current[name]), f"{name} was not restored after saving the EMA"
    with torch.no_grad():
        own_loss = engine(**batch, labels=labels).loss
        reference = AutoModelForCausalLM.from_pretrained(path)
        reference.load_state_dict({k: v for k, v in current.items()}, strict=False)
        reference_loss = reference(**batch, labels=labels).loss
    torch.testing.assert_close(own_loss, reference_loss, atol=1e-5, rtol=1e-5)

    resumed = ModelEMA(engine, beta=0.9)
    resumed.load_state_dict(ema.state_dict(), ema.local_state_dict())
    for name, value in _ema_weights(resumed, engine).items():
        assert torch.equal(value, expected[name]), name


def _partitions_case() -> None:
    """Odd-sized parameters, so ZeRO-3 partitions are padded."""
    from utils.dist import get_rank

    rank = get_rank()
    for threshold in (0, 10_000):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
        config = get_train_ds_config(stage=3, train_micro_batch_size_per_gpu=2)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                          config=config)
        assert all(p.ds_tensor.numel() == (p.ds_numel + 1) // 2 for p in engine.module.parameters())
        ema = ModelEMA(engine, beta=0.5)
        expected = _full_params(engine)
        torch.manual_seed(1 + rank)
        for _ in range(3):
            inputs = torch.randn(2, 3)
            engine.backward((engine(inputs) - 1.0).pow(2).mean())
            engine.step()
            ema.update(engine)
            current = _full_params(engine)
            if rank == 0:
                expected = {name: 0.5 * expected[name] + 0.5 * current[name] for name in expected}
        probe = torch.ones(2, 3)
        with ema.applied_to(engine):
            inside = _full_params(engine)
            with torch.no_grad():
                ema_output = engine(probe)
        after = _full_params(engine)
        if rank == 0:
            for name in expected:
                assert torch.equal(inside[name], expected[name]), (threshold, "applied_to", name)
                assert torch.equal(after[name], current[name]), (threshold, "restore", name)
            reference = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
            reference.load_state_dict(expected)
            torch.testing.assert_close(ema_output, reference(probe))
        resumed = ModelEMA(engine, beta=0.9)
        resumed.load_state_dict(ema.state_dict(), ema.local_state_dict())
        resumed_weights = _ema_weights(resumed, engine)
        if rank == 0:
            for name in expected:
                assert torch.equal(resumed_weights[name], expected[name]), (threshold, "resume", name)


class _TiedOddModel(torch.nn.Module):
    """A 7-token, 5-wide language model whose head is its embedding (tied), every size odd."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 5)
        self.mid = torch.nn.Linear(5, 5)
        self.head = torch.nn.Linear(5, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def _tied_case() -> None:
    """ZeRO-2 slices and ZeRO-3 padded partitions of a tied, odd-sized model; the EMA one rank computes from the
    gathered weights (beta 0: the actor's; beta 0.5: the exact average), inside `applied_to` (the tied head too) and
    after a resume."""
    from utils.dist import get_rank

    rank = get_rank()
    probe = torch.tensor([[0, 3, 6, 1]])
    for stage in (2, 3):
        for beta in (0.0, 0.5):
            torch.manual_seed(0)
            config = get_train_ds_config(stage=stage, train_micro_batch_size_per_gpu=2)
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
            with deepspeed.zero.Init(config_dict_or_path=config, enabled=stage == 3):
                model = _TiedOddModel()
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                              config=config)
            ema = ModelEMA(engine, beta=beta)
            expected = _full_params(engine)
            torch.manual_seed(1 + rank)
            for _ in range(3):
                engine.backward(engine(torch.randint(0, 7, (2, 4))).logsumexp(-1).mean())
                engine.step()
                ema.update(engine)
                current = _full_params(engine)
                expected = {name: beta * expected[name] + (1 - beta) * current[name] for name in expected}
            with ema.applied_to(engine), torch.no_grad():
                ema_output = engine(probe)
            resumed = ModelEMA(engine, beta=0.9)
            resumed.load_state_dict(ema.state_dict(), ema.local_state_dict())
            for what, weights in (("applied_to", _ema_weights(ema, engine)), ("resume", _ema_weights(resumed, engine))):
                assert set(weights) == {"embed.weight", "mid.weight", "mid.bias"}, (stage, what, set(weights))
                if rank == 0:
                    for name in expected:
                        assert torch.equal(weights[name], expected[name]), (stage, beta, what, name)
            if rank == 0:
                if beta == 0.0:
                    assert all(torch.equal(expected[name], current[name]) for name in current)
                reference = _TiedOddModel()
                reference.load_state_dict({**expected, "head.weight": expected["embed.weight"]})
                torch.testing.assert_close(ema_output, reference(probe))


def _tensors_in(value) -> list:
    """Every tensor inside `value`, a checkpoint's plain data."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [tensor for item in items for tensor in _tensors_in(item)]


def _resume_case(stage: str, folder: Path) -> None:
    """A ZeRO-`stage` actor EMA (odd-sized parameters) saved in a resume checkpoint through `PPOTrainer` -- the
    client state without a tensor, each rank about half the elements in its rank state -- and resumed exactly on
    both ranks; then resumed from a checkpoint of the earlier layout (rank 0's full tensors in the client state, no
    rank state). A share missing on one rank is refused on both."""
    from step3_rlhf.ppo_trainer import PPOTrainer
    from training.algorithms.kl import FixedKLController
    from training.reliability.checkpointing import CLIENT_STATE_FILE, RANK_STATE_DIR, CheckpointManager, safe_load
    from utils.dist import all_gather_objects, get_rank

    rank = get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    config = get_train_ds_config(stage=int(stage), train_micro_batch_size_per_gpu=2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config=config)
    ema = ModelEMA(engine, beta=0.5)
    torch.manual_seed(1 + rank)
    for _ in range(3):
        engine.backward((engine(torch.randn(2, 7)) - 1.0).pow(2).mean())
        engine.step()
        ema.update(engine)
    expected = _ema_weights(ema, engine)
    total = sum(tensor.numel() for tensor in expected.values())

    def trainer_of(actor_ema: ModelEMA) -> PPOTrainer:
        trainer = PPOTrainer.__new__(PPOTrainer)  # only the EMA and the KL controller take part in its state
        trainer.engine, trainer.kl_controller = SimpleNamespace(actor_ema=actor_ema), FixedKLController(0.1)
        return trainer

    def check_resumed(checkpoints: CheckpointManager, what: str) -> None:
        resumed = ModelEMA(engine, beta=0.9)
        assert not all(torch.equal(value, expected[name]) for name, value in _ema_weights(resumed, engine).items())
        state = checkpoints.restore({}, resume=True)
        trainer_of(resumed).load_state_dict(state["trainer"], state.get("rank_state"))
        assert (resumed.beta, resumed.num_updates) == (0.5, 3), what
        for name, value in _ema_weights(resumed, engine).items():
            assert torch.equal(value, expected[name]), (stage, what, name)

    trainer = trainer_of(ema)
    shares = CheckpointManager(folder / "shares")
    saved = shares.save(3, {}, {"trainer": trainer.state_dict()}, trainer.rank_state())
    assert _tensors_in(safe_load(saved / CLIENT_STATE_FILE)) == [], "the client state holds EMA tensors"
    own = safe_load(saved / RANK_STATE_DIR / f"rank{rank}.pt")["actor_ema"]
    held = all_gather_objects(sum(tensor.numel() for tensor in own.values()))
    padding = len(expected) if stage == "3" else 0  # a ZeRO-3 partition is padded to the longest
    assert all(abs(count - total / 2) <= len(expected) for count in held) and total <= sum(held) <= total + padding, \
        (stage, held, total)
    check_resumed(shares, "shares")
    # a damaged share on one rank: every rank refuses (under ZeRO-2 rank 0 waited in the all-gather; under ZeRO-3 it
    # went on alone, to wait in training's first collective)
    with pytest.raises(UserError, match=r"the checkpoint is damaged: rank 1's share"):
        ModelEMA(engine, beta=0.9).load_state_dict(ema.state_dict(), ema.local_state_dict() if rank == 0 else {})

    earlier = CheckpointManager(folder / "earlier_layout")
    full = {"beta": 0.5, "num_updates": 3, "shadow": expected if rank == 0 else {}}
    earlier.save(3, {}, {"trainer": {"kl_controller": FixedKLController(0.1).state_dict(), "actor_ema": full}})
    check_resumed(earlier, "earlier layout")


# the two-rank cases, run one after the other in one launch: each launch spends most of its time starting its ranks
TWO_RANK_CASES = {
    "partitions": lambda folder: _partitions_case(),
    "resume-stage2": lambda folder: _resume_case("2", folder / "stage2"),
    "resume-stage3": lambda folder: _resume_case("3", folder / "stage3"),
    "tied": lambda folder: _tied_case(),
}


def _two_rank_cases_worker(folder: str) -> None:
    """Run under `torch.distributed.run --nproc_per_node 2`: every case of `TWO_RANK_CASES` in turn, each rank
    printing `case_passed(name, rank)` after it. A case failing on a rank ends that rank at once, its traceback
    naming the case (its peer may be waiting in a collective that it will never join); the launch's later cases
    then do not run."""
    from utils.dist import get_rank, init_distributed, leave_spawned_rank

    init_distributed()
    for name, case in TWO_RANK_CASES.items():
        try:
            case(Path(folder))
        except BaseException:  # noqa: BLE001 -- pytest.raises' own failure is no Exception
            print(f"two-rank case {name!r} failed on rank {get_rank()}:\n{traceback.format_exc()}", file=sys.stderr,
                  flush=True)
            os._exit(1)
        print(case_passed(name, get_rank()), flush=True)
    leave_spawned_rank()  # the interpreter's teardown of ZeRO-3 engines' native state has aborted a rank in CI


def case_passed(name: str, rank: int | str) -> str:
    return f"EMA_CASE_PASSED {name} on rank {rank}"


def _launch_two_rank_cases(folder: Path) -> subprocess.CompletedProcess:
    """`_two_rank_cases_worker` on 2 local ranks, writing under `folder`."""
    from utils.dist import free_port

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), __file__, str(folder)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def two_rank_cases(request) -> subprocess.CompletedProcess:
    """The one launch of `_two_rank_cases_worker` in this test run, whose output each two-rank test reads."""
    return launched_once(request, "ema_two_rank_cases", _launch_two_rank_cases)


def assert_two_rank_case_passed(launch: subprocess.CompletedProcess, name: str) -> None:
    """Case `name` passed on both ranks, and the launch exited 0 where every case passed (a rank's teardown). The
    markers are found anywhere in the output: the two ranks share one stdout, where one rank's marker can come
    before the other's newline ("... on rank 0EMA_CASE_PASSED ... on rank 1")."""
    passed = set(re.findall(case_passed(r"(\S+)", r"(\d+)"), launch.stdout))
    output = f"{launch.stdout[-3000:]}{launch.stderr[-3000:]}"
    assert all((name, str(rank)) in passed for rank in (0, 1)), \
        (f"two-rank case {name!r} did not pass on both ranks (launch exit status {launch.returncode}; a case that "
         f"failed before it ends the launch):\n{output}")
    every_case_passed = all((case, str(rank)) in passed for case in TWO_RANK_CASES for rank in (0, 1))
    assert not every_case_passed or launch.returncode == 0, \
        f"every two-rank case passed, yet the launch exited with status {launch.returncode}:\n{output}"


@pytest.mark.slow
def test_zero3_ema_over_two_ranks_with_padded_partitions(two_rank_cases):
    assert_two_rank_case_passed(two_rank_cases, "partitions")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["2", "3"])
def test_each_of_two_ranks_saves_its_half_of_the_ema_and_a_resume_restores_it_exactly(two_rank_cases, stage):
    """ZeRO-2: each rank a balanced slice of the copy both hold; ZeRO-3: each rank its partition. Also from a
    checkpoint of the earlier layout (full tensors in the client state), which older runs wrote."""
    assert_two_rank_case_passed(two_rank_cases, f"resume-stage{stage}")


@pytest.mark.slow
def test_the_ema_of_tied_odd_sized_weights_over_two_ranks_is_the_one_rank_ema_and_resumes_exactly(two_rank_cases):
    assert_two_rank_case_passed(two_rank_cases, "tied")


if __name__ == "__main__":
    _two_rank_cases_worker(sys.argv[1])
