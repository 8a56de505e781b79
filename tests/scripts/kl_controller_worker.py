"""The worker of the 2-rank adaptive-KL and whitening test (`torchrun --nproc_per_node 2 kl_controller_worker.py`).

Each rank runs `PPOTrainer.generate_experience` on scripted rollouts of its own size and KL (no
model: only the rollout is replaced, the KL update and the advantages' whitening around it are the
trainer's), then checks on every rank that the coefficient equals the one computed from the pooled
batches, that both ranks hold the same value, and that loading rank 0's trainer state (what a
resumed run does) restores it. The rollouts' advantages (GAE's, unwhitened) are their KLs, of a
different scale on each rank: each rank's come out whitened with the mean and variance of both
ranks' together. Rank 0 prints `KL_OK` and `WHITEN_OK` when all ranks passed.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from step3_rlhf.ppo_trainer import Experience, PPOConfig, PPOTrainer
from training.algorithms import AdaptiveKLController
from utils.dist import broadcast_from_main, get_rank, init_distributed

CONFIG = PPOConfig(kl_ctl=0.1, target_kl=5.0, kl_horizon=20.0)
ROLLOUT_KLS = {  # rank: the per-answer KLs of each of its rollouts (different batch sizes on purpose)
    0: [[4.0, 4.5, 5.0], [3.0]],
    1: [[6.8], [7.5, 9.0]],
}


def scripted_experience(kls: list[float]) -> Experience:
    """An experience of one-token answers whose per-answer KL, and advantage, are `kls`."""
    rows = torch.zeros(len(kls), 1)
    return Experience(sequences=rows.long(), attention_mask=rows.long(), prompt_length=0,
                      action_mask=torch.ones_like(rows, dtype=torch.long), old_logprobs=rows, ref_logprobs=rows,
                      old_values=rows, rewards=rows, advantages=torch.tensor(kls)[:, None], returns=rows,
                      scores=rows[:, 0], kl=torch.tensor(kls), ended_with_eos=rows[:, 0].bool())


class StandInTokenizer(SimpleNamespace):
    """What the trainer reads of a tokenizer: its EOS and pad ids, and its size (the ids a sampler may choose)."""

    def __len__(self) -> int:
        return 1


class ScriptedRollouts(PPOTrainer):
    """A trainer whose rollouts are scripted; `generate_experience` itself runs unchanged."""

    def __init__(self, rollouts: list[list[float]]):
        engine = SimpleNamespace(tokenizer=StandInTokenizer(eos_token_id=0, pad_token_id=0), actor_ema=None,
                                 critic=SimpleNamespace(), has_critic=True,  # a stand-in critic: the default estimator (GAE) needs one
                                 reward=SimpleNamespace())  # and something to score answers
        super().__init__(engine, generator=None, config=CONFIG)
        self.rollouts = iter(rollouts)

    def _rollout(self, prompt_batch, *args, **kwargs) -> Experience:
        return scripted_experience(next(self.rollouts))


def pooled_coefficient() -> float:
    """The coefficient after updating once per rollout round from every rank's answers together."""
    expected = AdaptiveKLController(CONFIG.kl_ctl, CONFIG.target_kl, CONFIG.kl_horizon)
    for rounds in zip(*ROLLOUT_KLS.values()):
        pooled = [kl for rollout in rounds for kl in rollout]
        expected.update(sum(pooled) / len(pooled), len(pooled))
    return expected.value


def main() -> None:
    init_distributed()
    rank = get_rank()
    trainer = ScriptedRollouts(ROLLOUT_KLS[rank])
    for rounds in zip(*ROLLOUT_KLS.values()):
        advantages = trainer.generate_experience({}).advantages.flatten()
        pooled = torch.tensor([kl for rollout in rounds for kl in rollout])
        expected = (torch.tensor(rounds[rank]) - pooled.mean()) / pooled.var(unbiased=False).add(1e-8).sqrt()
        torch.testing.assert_close(advantages, expected, msg=f"rank {rank}")
    value = trainer.kl_controller.value
    assert math.isclose(value, pooled_coefficient(), rel_tol=1e-6), (rank, value, pooled_coefficient())  # fp32 KLs
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
    torch.distributed.all_gather(values, torch.tensor([value], dtype=torch.float64))
    assert values[0].item() == values[1].item(), [v.item() for v in values]

    resumed = ScriptedRollouts([])
    resumed.load_state_dict(broadcast_from_main(trainer.state_dict()))
    assert resumed.kl_controller.value == value, (rank, resumed.kl_controller.value, value)
    torch.distributed.barrier()
    if rank == 0:
        print("KL_OK", value, flush=True)
        print("WHITEN_OK", flush=True)


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()
