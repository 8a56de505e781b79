"""DPO's objective for the supervised loop: answer log-probabilities of policy and frozen reference,
the preference loss, and the held-out implicit-reward evaluation."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from transformers import PreTrainedTokenizerBase

from step2_reward.dpo.settings import DPOArguments, DPOSettings
from step2_reward.objective import split_chosen_rejected
from training.algorithms import PairLoss
from training.core.engine import create_reference_engine
from training.core.sequences import answer_logprobs
from training.reliability.layouts import warn_tuned_on_other_layout
from utils.dist import is_main_process, sum_over_ranks


def answer_logprob_sums(module: torch.nn.Module, batch: Mapping[str, torch.Tensor], *,
                        tokenizer_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a `PairwiseCollator` batch ([2B] rows): the sum of its answer tokens' log-probs (fp32, over the
    tokenizer's ids: `token_logprobs`, no default) and the number of those tokens; prompt tokens and padding
    excluded."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    # the log-probs of tokens 1.. (all but the first, which nothing predicts); the mask keeps each row's answer
    logprobs = answer_logprobs(module, input_ids, attention_mask, prompt_length=1, tokenizer_size=tokenizer_size)
    answer_starts = batch["prompt_lengths"].repeat(2)  # a pair's chosen and rejected rows share its prompt
    positions = torch.arange(1, input_ids.shape[1], device=input_ids.device)
    mask = (positions.unsqueeze(0) >= answer_starts.unsqueeze(1)) & attention_mask[:, 1:].bool()
    return torch.where(mask, logprobs, 0.0).sum(-1), mask.sum(-1)


class DPOObjective:
    """The loss and evaluation of `PairwiseCollator` batches for a policy (the trained engine) against
    the reference, which exists while `reference_model` is entered."""

    def __init__(self, settings: DPOArguments):
        self.settings = settings
        self.preference_loss = settings.preference_loss()
        self.reference: torch.nn.Module | None = None
        # the tokenizer's ids, the only ones the tuned policy is ever sampled from (set with the reference)
        self.tokenizer_size: int | None = None

    @contextmanager
    def reference_model(self, args: DPOSettings, tokenizer: PreTrainedTokenizerBase) -> Iterator[None]:
        """The frozen reference: a copy of the model the policy starts from, in eval mode. Where the run that tuned
        that model recorded another conversation layout than this step's --prompt_format, a warning says so first:
        policy and reference would be compared on pairs laid out as neither was tuned."""
        if is_main_process():  # the same on every rank
            warn_tuned_on_other_layout(tokenizer, args.data.prompt_format, args.model.model_name_or_path, "DPO")
        engine = create_reference_engine(
            args.model.model_name_or_path, tokenizer, args.run.dtype_name, args.training.zero_stage,
            offload=self.settings.offload_reference_model, trust_remote_code=args.run.trust_remote_code,
        )
        self.reference, self.tokenizer_size = engine, len(tokenizer)
        try:
            yield
        finally:
            self.reference = None
            engine.destroy()

    def _sequence_logprobs(self, module: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        sums, counts = answer_logprob_sums(module, batch, tokenizer_size=self.tokenizer_size)
        return sums / counts if self.preference_loss.per_token_mean else sums

    def pair_loss(self, policy: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> PairLoss:
        if self.reference is None:
            raise RuntimeError("DPOObjective used outside its reference_model context")
        policy_logprobs = self._sequence_logprobs(policy, batch)
        with torch.no_grad():
            reference_logprobs = self._sequence_logprobs(self.reference, batch)
        return self.preference_loss(*split_chosen_rejected(policy_logprobs), *split_chosen_rejected(reference_logprobs),
                                    self.settings)

    def loss(self, policy: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.pair_loss(policy, batch).loss

    @torch.no_grad()
    def evaluate(self, policy: torch.nn.Module, batches: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, float]:
        """Held-out accuracy (chosen reward strictly above rejected: a tie counts as wrong), mean implicit
        rewards, their margin and the loss, summed over ranks (every rank must call it)."""
        correct = chosen_sum = rejected_sum = loss_sum = pairs = 0.0
        for batch in batches:
            result = self.pair_loss(policy, batch)
            count = result.chosen_rewards.numel()
            correct += (result.chosen_rewards > result.rejected_rewards).sum().item()
            chosen_sum += result.chosen_rewards.double().sum().item()
            rejected_sum += result.rejected_rewards.double().sum().item()
            loss_sum += result.loss.double().item() * count
            pairs += count
        correct, chosen_sum, rejected_sum, loss_sum, pairs = sum_over_ranks(
            [correct, chosen_sum, rejected_sum, loss_sum, pairs])
        total = max(pairs, 1.0)
        chosen, rejected = chosen_sum / total, rejected_sum / total
        return {"accuracy": correct / total, "chosen_reward": chosen, "rejected_reward": rejected,
                "margin": chosen - rejected, "loss": loss_sum / total, "num_pairs": int(pairs)}
