"""Worker for the 2-process ZeRO tests: train a few steps on each rank's half of a batch, then save; at ZeRO-0 (a
full copy of the weights per rank) also check that the ranks' weights agree, i.e. that gradients were averaged."""
import sys

import torch

from training.core.engine import OptimizationSettings, create_train_engine
from training.core.model_loading import load_causal_lm, load_tokenizer
from training.core.save import save_hf_model
from utils.dist import get_rank, get_world_size, init_distributed


def main(model_path: str, output_dir: str, stage: int) -> None:
    init_distributed()
    assert get_world_size() == 2
    tokenizer = load_tokenizer(model_path)
    settings = OptimizationSettings(learning_rate=5e-3, num_training_steps=8, zero_stage=stage, micro_batch_size=2,
                                    lr_scheduler_type="constant_with_warmup")
    model = load_causal_lm(model_path, tokenizer, ds_config=settings.ds_config())
    assert stage != 3 or all(hasattr(p, "ds_id") for p in model.parameters()), "weights were not partitioned"
    engine = create_train_engine(model, settings)
    texts = [f"Human: question {i} Assistant: answer {i} is good." for i in range(4)]
    enc = tokenizer(texts[get_rank() * 2:(get_rank() + 1) * 2], return_tensors="pt", padding=True)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    losses = []
    for _ in range(8):
        loss = engine(**enc, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if stage == 0:
        checksums = torch.stack([p.detach().double().sum() for p in engine.module.parameters()])
        gathered = [torch.empty_like(checksums) for _ in range(get_world_size())]
        torch.distributed.all_gather(gathered, checksums)
        if get_rank() == 0 and torch.equal(gathered[0], gathered[1]):
            print("RANKS_AGREE")
    save_hf_model(engine, tokenizer, output_dir)
    if get_rank() == 0 and losses[-1] < losses[0]:
        print("LOSS_FELL", losses[0], losses[-1])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    torch.distributed.destroy_process_group()
