"""Step 3 under a placement other than `colocate`: each model call runs on the ranks that hold the model.

One PPO step, for every rank's prompt batch (a *chunk*; see `training.placement.spec`):
1. generation: the generating role (the actor, or the shadow actor on the rollout ranks) answers its chunks one
   after another, each from the chunk's own random stream, so the answers are the co-located run's;
2. scoring: for every chunk, the actor's, reference's, critic's and reward model's forward passes run on the
   rank that holds that model for the chunk -- ranks of different models at the same time (interleaving);
3. every rank assembles the experiences (rewards, KL, advantages: no model call) and the KL coefficient moves;
4. training: the actor's ranks train the actor on their chunks and the critic's the critic (at the same time
   when they are disjoint), micro-batch by micro-batch in the co-located order, accumulating gradients over the
   chunks they serve, so every optimizer step averages the same micro-batches as the co-located run's;
5. with a shadow actor, the first actor rank broadcasts the trained weights (the LoRA adapters only, with
   LoRA) to the rollout ranks before the next generation: the schedule is synchronous, the answers of step
   s+1 come from the actor after step s (no staleness).
Results move between phases with one all-gather of per-chunk results. With stage fusion
(`--enable_stage_fusion`), steps 1 and 2 overlap: the generating rank sends each micro-batch of finished rows to
the ranks that score it as soon as it is complete, and they score it while generation goes on (a rank that also
generates, between its own decode steps); the scores are all-gathered once generation has ended.
"""
from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as torch_dist

from step3_rlhf.ema import save_ema_model
from step3_rlhf.ppo_trainer import Experience, PPOTrainer, Rollout, experience_stats, weighted_stats
from step3_rlhf.run_loop import (
    ACTOR_SUBDIR,
    CRITIC_SUBDIR,
    EMA_SUBDIR,
    PPORun,
    held_out_stats,
    held_out_totals,
    rollout_means,
    trained_learning_rates,
)
from step3_rlhf.stage_fusion import StageFusion, place_rows
from training.core.save import save_hf_model
from training.loops.call_times import CallTimer, NoTimer
from training.placement.exchange import (
    ChunkRandomStreams,
    Inbox,
    Outbox,
    broadcast_trainable_weights,
    gather_chunks,
    moved,
)
from training.placement.spec import Placement
from utils.dist import all_gather_objects, barrier, current_device, get_world_size


def scoring_owners(placement: Placement, has_critic: bool, has_reward_model: bool) -> dict[str, str]:
    """Scoring call -> the role whose ranks run it; a reward function alone runs where the actor is."""
    owners = {"actor": "actor", "reference": "reference", "reward": "reward" if has_reward_model else "actor"}
    if has_critic:
        owners["critic"] = "critic"
    return owners


def _mean_stats(per_chunk: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
    """The mean over chunks of per-chunk means (the co-located run's mean over ranks)."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for stats in per_chunk.values():
        for key, value in stats.items():
            totals[key] += value
            counts[key] += 1
    return {key: totals[key] / counts[key] for key in totals}


class PlacedPPO:
    """Rollouts, scoring and updates of a `PPOTrainer` spread over a placement's ranks (module docstring)."""

    def __init__(self, trainer: PPOTrainer, placement: Placement, rank: int, has_reward_model: bool,
                 timer: CallTimer | NoTimer | None = None):
        self.trainer = trainer
        self.placement = placement
        self.rank = rank
        self.engine = trainer.engine
        self.owners = scoring_owners(placement, self.engine.has_critic, has_reward_model)
        generating = placement.generation_role
        self.streams = ChunkRandomStreams(placement.chunks(generating, rank))
        self.shadow = placement.has("rollout")
        self.last_timing: dict[str, float] = {}
        self.timer = timer or NoTimer()
        # stage fusion's point-to-point messages go over a gloo group of their own (collective to create)
        self.fusion_group = torch_dist.new_group(backend="gloo") if trainer.stage_fusion_micro_batch_size else None
        if self.shadow:
            self.sync_weights()

    # rollouts -----------------------------------------------------------------------------------

    def calls_of(self, rank: int, chunk: int) -> list[str]:
        """The scoring calls `rank` runs on `chunk`."""
        return [call for call, role in self.owners.items() if self.placement.owner(role, chunk) == rank]

    def experiences(self, prompt_batch: Mapping[str, Any], do_sample: bool,
                    with_exact_kl: bool = False) -> dict[int, Experience]:
        """Every chunk's experience from every rank's prompt batch (collective), on every rank. Stage fusion
        scores sampled rollouts only; a held-out evaluation (`with_exact_kl`) waits for the whole batch."""
        trainer = self.trainer
        started = time.perf_counter()
        prompts = dict(enumerate(all_gather_objects(moved(dict(prompt_batch), "cpu"))))
        device = current_device()
        if self.fusion_group is not None and not with_exact_kl:
            rollouts, parts = self._fused_rollouts(prompts, do_sample)
        else:
            rollouts = {}
            for chunk in self.placement.chunks(self.placement.generation_role, self.rank):
                with self.streams.use(chunk):
                    rollouts[chunk] = trainer.generate_rollout(prompts[chunk], do_sample)
            with self.timer.time("exchange/all-gather rollouts"):
                rollouts = moved(gather_chunks(rollouts), device)
            parts = {}
        generated = time.perf_counter()
        for chunk, rollout in rollouts.items():
            calls = self.calls_of(self.rank, chunk)
            if not calls:
                continue
            if chunk not in parts:  # not scored during generation: the whole batch now
                parts[chunk] = trainer.score_rollout(rollout, calls, with_exact_kl)
            elif "reward" in calls and rollout.greedy is not None:  # ReMax's baseline waits for the whole batch
                parts[chunk]["baseline"] = trainer.baseline_scores(rollout)
        with self.timer.time("exchange/all-gather scores"):
            parts = moved(gather_chunks(parts), device)
        experiences = {}
        for chunk, rollout in rollouts.items():
            chunk_parts = parts[chunk]
            if with_exact_kl and "exact_kl" not in chunk_parts:  # the actor and the reference on different ranks
                chunk_parts["exact_kl"] = trainer.exact_kl(chunk_parts.pop("actor_logits"),
                                                           chunk_parts.pop("reference_logits"), rollout)
            experiences[chunk] = trainer.assemble_experience(rollout, chunk_parts)
        self.last_timing = {"generation_s": generated - started, "scoring_s": time.perf_counter() - generated,
                            "generated_tokens": float(sum(r.action_mask.sum().item() for r in rollouts.values()))}
        return experiences

    def _fused_rollouts(self, prompts: Mapping[int, Mapping[str, Any]],
                        do_sample: bool) -> tuple[dict[int, Rollout], dict[int, dict[str, Any]]]:
        """Generation with stage fusion: every chunk's rollout (on every rank) and the scores this rank computed
        for the chunks it scores, laid into each chunk's rows."""
        trainer, placement, rank = self.trainer, self.placement, self.rank
        generated_by = {chunk: placement.owner(placement.generation_role, chunk) for chunk in range(placement.world_size)}
        senders = {generated_by[chunk] for chunk in generated_by
                   if generated_by[chunk] != rank and self.calls_of(rank, chunk)}
        inbox = Inbox(self.fusion_group, senders) if senders else None
        outbox = Outbox(self.fusion_group)
        pieces: dict[int, list[tuple[torch.Tensor, dict[str, Any]]]] = defaultdict(list)

        def score_arrived(messages) -> None:
            for chunk, rows, output, calls in messages:
                rollout = trainer.rows_rollout(prompts[chunk], do_sample, rows, moved(output, current_device()))
                pieces[chunk].append((rows, trainer.score_rollout(rollout, calls)))

        rollouts, receivers = {}, set()
        for chunk in placement.chunks(placement.generation_role, rank):
            owners = {placement.owner(role, chunk) for role in self.owners.values()} - {rank}
            remote = {owner: self.calls_of(owner, chunk) for owner in sorted(owners)}
            receivers.update(remote)
            local = self.calls_of(rank, chunk)

            def score(rows: torch.Tensor, output, chunk=chunk, remote=remote, local=local) -> dict[str, Any]:
                for owner, calls in remote.items():
                    outbox.post(owner, (chunk, rows, output, calls))
                if inbox is not None:
                    score_arrived(inbox.ready())
                return trainer.score_rollout(trainer.rows_rollout(prompts[chunk], do_sample, rows, output), local) \
                    if local else {}

            fusion = StageFusion(trainer.stage_fusion_micro_batch_size, score, trainer.pad_token_id)
            with self.streams.use(chunk):
                rollouts[chunk] = trainer.generate_rollout(prompts[chunk], do_sample, on_finished=fusion)
            fusion.flush()
            if local:
                pieces[chunk].extend(fusion.pieces)
        for receiver in sorted(receivers):
            outbox.close(receiver)
        if inbox is not None:
            score_arrived(inbox.remaining())
        outbox.wait()
        device = current_device()
        with self.timer.time("exchange/all-gather rollouts"):
            rollouts = moved(gather_chunks(rollouts), device)
        return rollouts, {chunk: place_rows(chunk_pieces, *rollouts[chunk].action_mask.shape)
                          for chunk, chunk_pieces in pieces.items()}

    def generate_experience(self, prompt_batch: Mapping[str, Any]) -> dict[int, Experience]:
        """Sampled experiences of every chunk, then the KL coefficient's update from all of them (as the co-located
        run's update from every rank's answers)."""
        experiences = self.experiences(prompt_batch, do_sample=True)
        self.trainer.whiten_advantages(list(experiences.values()), over_ranks=False)  # every chunk is on every rank
        total = sum(experience.kl.sum().item() for experience in experiences.values())
        count = sum(experience.kl.numel() for experience in experiences.values())
        self.trainer.kl_controller.update(total / max(count, 1), int(count))
        return experiences

    # updates ------------------------------------------------------------------------------------

    def pretraining_batches(self, draw: Callable[[], Mapping[str, torch.Tensor]] | None, batches: list[dict],
                            ppo_epochs: int, micro_batch_size: int) -> dict[int, list] | None:
        """Every chunk's pretraining batches of the step (PPO-ptx), one per actor micro-batch in the co-located
        order (collective): each rank draws its own from its stream, as it would co-located, and the actor's
        ranks take those of the chunks they serve. None without the mixture."""
        if draw is None:
            return None
        chunk = next(iter(batches[0]))
        count = ppo_epochs * sum(len(batch[chunk].split(micro_batch_size)) for batch in batches)
        drawn = [moved(dict(draw()), "cpu") for _ in range(count)]
        return dict(enumerate(all_gather_objects(drawn)))

    def train(self, batches: list[dict[int, Experience]], ppo_epochs: int, micro_batch_size: int,
              pretraining: dict[int, list] | None = None) -> dict[str, float]:
        """`ppo_epochs` passes over the step's experiences: the actor's ranks update the actor and the critic's the
        critic, each on the chunks it serves, micro-batch j of every chunk before micro-batch j+1 (the order that
        keeps each optimizer step's micro-batches those of the co-located run), the actor with each micro-batch's
        pretraining batch (`pretraining_batches`). Returns the mean statistics."""
        placement, trainer = self.placement, self.trainer
        jobs = [("actor", trainer.train_actor)]
        if self.engine.has_critic:
            jobs.append(("critic", trainer.train_critic))
        local: dict[int, dict[str, float]] = {}
        for role, update in jobs:
            chunks = placement.chunks(role, self.rank)
            if not chunks:
                continue
            sums: dict[int, dict[str, float]] = {chunk: defaultdict(float) for chunk in chunks}
            counts = dict.fromkeys(chunks, 0)
            order = [(chunk, part) for _ in range(ppo_epochs) for batch in batches
                     for chunk, part in _interleaved({chunk: batch[chunk].split(micro_batch_size) for chunk in chunks})]
            weights = trainer.loss_weights([part for _, part in order], role)
            for (chunk, part), weight in zip(order, weights):
                mixture = () if role != "actor" or pretraining is None else (pretraining[chunk][counts[chunk]],)
                for key, value in weighted_stats(update(part, *mixture, weight=weight), weight, weight).items():
                    sums[chunk][key] += value
                counts[chunk] += 1
            for chunk in chunks:
                local.setdefault(chunk, {}).update({key: value / counts[chunk] for key, value in sums[chunk].items()})
        if self.shadow:
            with self.timer.time("exchange/weight broadcast"):
                self.sync_weights()
        with self.timer.time("exchange/all-gather training statistics"):
            return _mean_stats(gather_chunks(local))

    def sync_weights(self) -> None:
        """The first actor rank's trained weights to the shadow actors (collective over the sync group)."""
        groups = self.engine.groups
        if self.rank not in groups.sync_ranks:
            return
        module = self.engine.actor.module if self.engine.actor is not None else self.engine.shadow_actor
        names = [name for name, parameter in module.named_parameters() if parameter.requires_grad]
        broadcast_trainable_weights(module, names, groups.sync_ranks[0], groups.sync_group)


def _interleaved(parts: Mapping[int, list[Experience]]) -> list[tuple[int, Experience]]:
    """Micro-batch j of every chunk (in chunk order) before micro-batch j+1 of any."""
    longest = max(len(chunk_parts) for chunk_parts in parts.values())
    return [(chunk, chunk_parts[index]) for index in range(longest) for chunk, chunk_parts in parts.items()
            if index < len(chunk_parts)]


def _from_holders(local: dict[str, float]) -> dict[str, float]:
    """Every rank's figures of the models it holds, merged (collective): ranks that hold the same model agree on
    its figures (its learning rate, its skipped steps)."""
    merged: dict[str, float] = {}
    for values in all_gather_objects(local):
        merged.update(values)
    return merged


def chunk_stats(experiences: Mapping[int, Experience]) -> dict[str, float]:
    """`experience_stats` of all the chunks, each weighing by what its means run over (`rollout_means`): a plain mean
    over chunks weighed each answer token of a chunk with shorter answers more in a token mean."""
    chunks = list(experiences.values())
    return rollout_means([experience_stats(experience) for experience in chunks],
                         [len(experience.scores) for experience in chunks],
                         [int(experience.action_mask.sum().item()) for experience in chunks])



class PlacedPPORun(PPORun):
    """`PPORun` with every PPO step, evaluation and save going through a `PlacedPPO`. A resume checkpoint holds
    each rank's engines (`CheckpointManager` saves an engine on its own ranks), each generating rank's
    per-chunk random streams and each actor rank's share of the EMA; after a resume the shadow actor receives the
    restored actor's weights."""

    def __init__(self, *args, placed: PlacedPPO, **kwargs):
        super().__init__(*args, **kwargs)
        self.placed = placed

    def rollout_batch(self, prompt_batch: dict) -> tuple[dict[int, Experience], dict[str, float], dict[str, float]]:
        experiences = self.placed.generate_experience(prompt_batch)
        return experiences, self.placed.last_timing, chunk_stats(experiences)

    def scores(self, batches: list[dict[int, Experience]]) -> torch.Tensor:
        return torch.cat([experience.scores for batch in batches for experience in batch.values()])

    def run_generated_tokens(self, tokens: float) -> float:
        """Already the run's: every rank holds every chunk's rollout."""
        return tokens

    def answer_tokens(self, batches: list[dict[int, Experience]]) -> int:
        return sum(int(experience.action_mask.sum().item()) for batch in batches for experience in batch.values())

    def step_scores(self, batches: list[dict[int, Experience]]) -> torch.Tensor:
        """Already every rank's: every rank holds every chunk's experience."""
        return self.scores(batches)

    def train_on(self, batches: list[dict[int, Experience]]) -> dict[str, float]:
        loop = self.args.loop
        draw = self.unsupervised.next if self.unsupervised is not None else None
        pretraining = self.placed.pretraining_batches(draw, batches, loop.ppo_epochs, loop.per_device_training_batch_size)
        stats = self.placed.train(batches, loop.ppo_epochs, loop.per_device_training_batch_size, pretraining)
        return {**stats, **_from_holders(self.trainer.skipped_steps())}

    def learning_rates(self) -> dict[str, float]:
        """The actor's (and critic's) learning rates, from whichever rank holds them (collective)."""
        return _from_holders(trained_learning_rates(self.engines, self.learning_rate_groups))

    def rollout_over_ranks(self, rollout: dict[str, float], answers: int, tokens: int) -> dict[str, float]:
        """Already the run's: every rank holds every chunk's rollout."""
        return rollout

    def over_ranks(self, stats: dict[str, float]) -> dict[str, float]:
        """Already the run's: every rank holds every chunk's statistics."""
        return stats

    def evaluate(self) -> dict:
        if self.eval_prompts is None:
            return {}
        per_rank = -(-len(self.eval_prompts.dataset) // get_world_size())

        def batch_stats(batch: dict) -> dict[str, float]:
            experiences = self.placed.experiences(batch, do_sample=False, with_exact_kl=True)
            return _mean_stats({chunk: held_out_stats(experience) for chunk, experience in experiences.items()})

        return self.record_evaluation(held_out_totals(self.eval_prompts, min(self.args.loop.eval_samples, per_rank),
                                                      batch_stats))

    @property
    def placement_description(self) -> str:
        return f"{self.args.placement.placement}: {self.placed.placement.describe()}"

    def rank_state(self) -> dict:
        """This rank's chunk streams, and its share of the EMA where it holds the actor."""
        return {"chunk_streams": self.placed.streams.state_dict(), **self.trainer.rank_state()}

    def restore(self) -> dict | None:
        state = super().restore()
        if state is not None:
            with self.checkpoints.reading_loaded_state():
                self.placed.streams.load_state_dict(state["rank_state"]["chunk_streams"])
            if self.placed.shadow:
                self.placed.sync_weights()
        return state

    def save_models(self) -> dict[str, str | None]:
        """Each trained model (and the actor's EMA) is written by the first rank of its group; the group's other
        ranks take part, since a ZeRO-3 model (which a placement allows only on every rank) gathers its weights
        collectively."""
        run_dir = Path(self.args.run.output_dir)
        placement, rank, engine = self.placed.placement, self.placed.rank, self.engine
        saved = {"actor_dir": str(run_dir / ACTOR_SUBDIR), "critic_dir": None,
                 "ema_dir": str(run_dir / EMA_SUBDIR) if self.args.ema.enable_ema else None}
        if rank in placement.ranks["actor"]:
            writer = rank == placement.ranks["actor"][0]
            save_hf_model(engine.actor, engine.tokenizer, run_dir / ACTOR_SUBDIR, writer=writer, synchronize=False)
            if engine.actor_ema is not None:
                save_ema_model(engine.actor_ema, engine.actor, engine.tokenizer, run_dir / EMA_SUBDIR, writer=writer,
                               synchronize=False)
        if placement.has("critic"):
            saved["critic_dir"] = str(run_dir / CRITIC_SUBDIR)
            if rank in placement.ranks["critic"]:
                save_hf_model(engine.critic, engine.tokenizer, run_dir / CRITIC_SUBDIR,
                              writer=rank == placement.ranks["critic"][0], synchronize=False)
        barrier()
        return saved

