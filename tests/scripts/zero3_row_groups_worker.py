"""Worker for the 2-process ZeRO-3 grouping test: each rank scores rows of its own lengths with a ZeRO-3 actor and
a ZeRO-3 reference (as step 3 does), where rank 0's rows alone would split into two length groups and rank 1's
stay one, and checks the log-probs against the unpartitioned models'."""
import sys

import torch

from training.core.answer_window import RowGroups
from training.core.engine import OptimizationSettings, create_reference_engine, create_train_engine
from training.core.model_loading import load_causal_lm, load_tokenizer
from utils.dist import get_rank, init_distributed


def rank_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0: two long rows and two short ones (two groups alone); rank 1: four rows alike (one group)."""
    long_row = [True, False, True, False] if get_rank() == 0 else [True] * 4
    prompt_mask = torch.tensor([[0] * (0 if long else 56) + [1] * (60 if long else 4) for long in long_row])
    answer_mask = torch.tensor([[1] * (40 if long else 3) + [0] * (0 if long else 37) for long in long_row])
    mask = torch.cat([prompt_mask, answer_mask], 1)
    return torch.randint(3, vocab, mask.shape, generator=torch.Generator().manual_seed(get_rank())), mask


def main(actor_path: str, reference_path: str) -> None:
    init_distributed()
    tokenizer = load_tokenizer(actor_path)
    settings = OptimizationSettings(learning_rate=1e-3, num_training_steps=1, zero_stage=3, micro_batch_size=4)
    actor = create_train_engine(load_causal_lm(actor_path, tokenizer, ds_config=settings.ds_config()), settings)
    reference = create_reference_engine(reference_path, tokenizer, "fp32", trained_zero_stage=3)
    sequences, mask = rank_rows(len(tokenizer))
    alone = RowGroups.of(sequences, mask, 60, group_cost_tokens=8)
    assert len(alone.windows) == (2 if get_rank() == 0 else 1), len(alone.windows)
    groups = RowGroups.of(sequences, mask, 60, (actor, reference), group_cost_tokens=8)
    assert len(groups.windows) == 1
    with torch.no_grad():
        scored = {name: groups.answer_logprobs(engine, 1.0, None)[0] for name, engine in
                  (("actor", actor), ("reference", reference))}
    answer = mask[:, 60:].bool()
    for name, path in (("actor", actor_path), ("reference", reference_path)):
        plain = load_causal_lm(path, tokenizer).eval()
        with torch.no_grad():
            expected = alone.answer_logprobs(plain, 1.0, None)[0]
        torch.testing.assert_close(scored[name][answer], expected[answer], rtol=0, atol=1e-5)
    print(f"ROW_GROUPS_OK rank {get_rank()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    torch.distributed.destroy_process_group()
