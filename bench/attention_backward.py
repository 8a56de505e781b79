"""Whether a left-padded half-precision batch trains with finite gradients through the attention kernels torch
picks, and through those a training process keeps.

    python bench/attention_backward.py --model MODEL_DIR --output attention_backward.json

For each sequence length (by default 128 to 576: every other one 64 past a multiple of 128) a batch of random
tokens, its rows left-padded by different amounts as a PPO batch's prompts are (a padded query sees no key), runs
forward and backward through the model, the loss masking the padding out: first with every kernel torch may pick,
then with cuDNN's left out (`exclude_cudnn_attention`, as `create_train_engine` leaves a training process). Each
row: the loss and how many parameter tensors got a non-finite gradient. On an H100/H200 it shows whether the
installed torch has cuDNN's backward bug (pytorch issue 196678: NaN query gradients at lengths 64 past a multiple of
128) and that the kernels a training process keeps avoid it. On a CPU both passes run the same kernels.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import device_name, print_table, write_report  # noqa: E402
from training.core.attention_kernels import exclude_cudnn_attention  # noqa: E402
from training.core.model_loading import load_causal_lm, load_tokenizer, resolve_dtype  # noqa: E402

DEFAULT_LENGTHS = (128, 192, 256, 320, 448, 576)
PASSES = ("every kernel", "cuDNN left out")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a causal LM folder (random weights of a real shape will do)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    parser.add_argument("--batch", type=int, default=4, help="rows, the first unpadded, the last padded to half")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True)
    return parser.parse_args(argv)


def left_padded_batch(vocab_size: int, length: int, rows: int, generator: torch.Generator,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids [rows, length] and an attention mask whose row r starts r / (rows - 1) of half the length in
    (row 0 unpadded)."""
    ids = torch.randint(3, vocab_size, (rows, length), generator=generator)
    starts = torch.linspace(0, length // 2, rows).long()
    mask = (torch.arange(length)[None] >= starts[:, None]).long()
    return ids.to(device), mask.to(device)


def train_pass(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """One forward and backward with the padding masked out of the loss: the loss and the number of parameter
    tensors whose gradient is not finite."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False).loss
    loss.backward()
    non_finite = sum(1 for param in model.parameters() if param.grad is not None and not param.grad.isfinite().all())
    return loss.item(), non_finite


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model, tokenizer, dtype=resolve_dtype(args.dtype)).to(device)
    model.train()
    rows = []
    for kernels in PASSES:
        if kernels == "cuDNN left out":
            exclude_cudnn_attention(device.type)
        generator = torch.Generator().manual_seed(args.seed)
        for length in args.lengths:
            ids, mask = left_padded_batch(model.config.vocab_size, length, args.batch, generator, device)
            loss, non_finite = train_pass(model, ids, mask)
            cudnn = device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
            rows.append({"kernels": kernels, "cudnn_attention": cudnn,
                         "length": length, "length_mod_128": length % 128, "loss": loss,
                         "non_finite_gradients": non_finite})
    print_table(rows, ("kernels", "length", "loss", "non_finite_gradients"))
    return write_report("attention_backward", args, rows, started, device=device_name(device), model=args.model,
                        dtype=args.dtype, batch_size=args.batch,
                        parameter_tensors=sum(1 for param in model.parameters() if param.requires_grad))


if __name__ == "__main__":
    main()
