"""bench/attention_backward.py on CPU: both passes run, and a NaN gradient behind a finite loss is counted."""
from __future__ import annotations

import json

import torch

from bench.attention_backward import left_padded_batch, main, train_pass


def test_the_report_has_both_kernel_passes_at_every_length_with_finite_gradients_on_cpu(tiny_model_dir, tmp_path):
    output = tmp_path / "attention.json"
    report = main(["--model", tiny_model_dir("llama"), "--lengths", "64", "192", "--output", str(output)])
    assert json.loads(output.read_text()) == report
    assert {"device", "versions", "command", "model", "dtype", "batch_size"} <= report.keys()
    rows = report["results"]
    assert [(row["kernels"], row["length"]) for row in rows] == [
        ("every kernel", 64), ("every kernel", 192), ("cuDNN left out", 64), ("cuDNN left out", 192)]
    assert all(row["non_finite_gradients"] == 0 and not row["cudnn_attention"] for row in rows)
    assert [row["loss"] for row in rows[:2]] == [row["loss"] for row in rows[2:]], "a CPU runs one set of kernels"


def test_rows_are_left_padded_from_none_to_half():
    ids, mask = left_padded_batch(100, 192, 4, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert ids.shape == mask.shape == (4, 192) and ids.min() >= 3
    assert mask.sum(-1).tolist() == [192, 160, 128, 96] and (mask[:, -1] == 1).all()


def test_a_nan_gradient_behind_a_finite_loss_is_counted():
    from tiny_models import make_tiny_model

    model, _ = make_tiny_model("llama")
    ids, mask = left_padded_batch(model.config.vocab_size, 64, 2, torch.Generator().manual_seed(0),
                                  torch.device("cpu"))
    assert train_pass(model, ids, mask)[1] == 0

    def masked_nan(module, inputs, output):  # 0 in the forward, NaN in the backward, as cuDNN's padded rows were
        return output + torch.where(torch.zeros_like(output, dtype=torch.bool), torch.sqrt(-1 - output.abs()), 0)

    model.model.layers[1].mlp.register_forward_hook(masked_nan)
    loss, non_finite = train_pass(model, ids, mask)
    assert torch.isfinite(torch.tensor(loss)) and non_finite > 0
