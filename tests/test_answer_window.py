"""Work step 3 no longer does: rows re-laid flush right (no column only padding fills), the LM head only where
an answer token is predicted, and log-probs without a full-vocab log-softmax; each checked against the plain
computation in fp32 and bf16 (at positions past 500)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT
from tiny_models import ARCHITECTURES, make_tiny_model, make_tiny_model_dir, make_tokenizer
from transformers import AutoModelForCausalLM

from training.core import sequences as sequences_module
from training.core.answer_window import AnswerWindow, RowGroups, flush_right
from training.algorithms import kl_from_logits
from training.core.sequences import answer_logits, answer_logprobs, token_entropies, token_logprobs
from training.core.reward_model import RewardModel
from utils.dist import free_port

PROMPT_MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1, 1]])
ANSWER_MASK = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])


def rows(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded prompts (P = 7) + right-padded answers (N = 6): the longest real row is 9 + 0 ... 11 tokens."""
    sequences = torch.randint(3, vocab, (4, 13), generator=torch.Generator().manual_seed(seed))
    return sequences, torch.cat([PROMPT_MASK, ANSWER_MASK], 1), PROMPT_MASK.shape[1]


def test_rows_flush_right_are_as_wide_as_the_longest_real_row_and_keep_every_token_in_order():
    sequences, mask, _ = rows(100)
    source, aligned_mask = flush_right(mask)
    aligned = sequences.gather(1, source)
    lengths = mask.sum(-1)
    assert aligned.shape == (4, int(lengths.max())) == (4, 10)  # 13 columns before: 7 + 6
    assert aligned_mask[:, -1].all(), "every row ends in the last column"
    for row in range(4):
        assert aligned[row][aligned_mask[row].bool()].tolist() == sequences[row][mask[row].bool()].tolist()
    assert aligned_mask.sum(-1).tolist() == lengths.tolist()


def test_window_maps_answer_columns_back_to_the_answer_layout():
    sequences, mask, prompt_length = rows(100)
    window = AnswerWindow.of(sequences, mask, prompt_length)
    assert window.width == 6 and window.answer_columns == 6
    assert window.answer_mask().sum(-1).tolist() == ANSWER_MASK.sum(-1).tolist()
    # the window's answer tokens, mapped back, are the rollout's answers (zero after each answer)
    assert torch.equal(window.to_answers(window.answer_tokens()), sequences[:, prompt_length:] * ANSWER_MASK)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt", "qwen2"])
def test_window_logprobs_and_values_equal_the_rollout_layouts_and_the_head_runs_on_answer_positions_only(arch):
    tokenizer = make_tokenizer()
    model, _ = make_tiny_model(arch, tokenizer)
    model.eval()
    critic = RewardModel.from_causal_lm(make_tiny_model(arch, tokenizer, seed=1)[0], tokenizer).eval()
    sequences, mask, prompt_length = rows(len(tokenizer))
    head_inputs = []
    model.get_output_embeddings().register_forward_pre_hook(
        lambda _, args: head_inputs.append((args[0].shape[1], args[0].is_contiguous())))
    window = AnswerWindow.of(sequences, mask, prompt_length)
    with torch.no_grad():
        got = window.to_answers(token_logprobs(window.logits(model), window.answer_tokens(), tokenizer_size=None))
        expected = token_logprobs(answer_logits(model, sequences, mask, prompt_length), sequences[:, prompt_length:],
                                  tokenizer_size=None)
        values = window.to_answers(window.values(critic))
        expected_values = critic(input_ids=sequences, attention_mask=mask)["values"][:, prompt_length - 1:-1]
    answer = ANSWER_MASK.bool()
    torch.testing.assert_close(got[answer], expected[answer], rtol=0, atol=1e-5)
    torch.testing.assert_close(values[answer], expected_values[answer], rtol=0, atol=1e-5)
    assert (got[~answer] == 0).all() and (values[~answer] == 0).all()
    # the head sees the W positions predicting answer tokens, not all, and contiguous: a strided view of a
    # frozen model's hidden states made PyTorch multiply it against a copy of the head per row
    assert head_inputs == [(window.width, True), (sequences.shape[1], True)]


def test_rows_of_very_different_lengths_are_grouped_and_their_results_merged_back_in_row_order():
    """Three short rows between three long ones: two groups of three pad far less than one window, and every
    per-token and per-row result comes back where the row was."""
    tokenizer = make_tokenizer()
    model, _ = make_tiny_model("llama", tokenizer)
    critic = RewardModel.from_causal_lm(make_tiny_model("llama", tokenizer, seed=1)[0], tokenizer)
    model.eval(), critic.eval()
    sequences, mask, answer = _grouped_rows(len(tokenizer))
    groups = RowGroups.of(sequences, mask, 60, group_cost_tokens=8)
    assert sorted(sorted(group.tolist()) for group in groups.rows) == [[0, 2, 5], [1, 3, 4]]
    one_window = AnswerWindow.of(sequences, mask, 60)
    assert sum(window.sequences.numel() for window in groups.windows) < 0.6 * one_window.sequences.numel()
    with torch.no_grad():
        logprobs, logits = groups.answer_logprobs(model, 0.8, None)
        plain_logits = answer_logits(model, sequences, mask, 60)
        expected = token_logprobs(plain_logits, sequences[:, 60:], 0.8, tokenizer_size=None)
        torch.testing.assert_close(logprobs[answer], expected[answer], rtol=0, atol=1e-5)
        entropies = groups.answer_entropies(logits, 0.8, None)
        torch.testing.assert_close(entropies[answer], token_entropies(plain_logits, 0.8, tokenizer_size=None)[answer],
                                   rtol=0, atol=1e-5)
        plain = critic(input_ids=sequences, attention_mask=mask)
        torch.testing.assert_close(groups.answer_values(critic)[answer], plain["values"][:, 59:-1][answer],
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(groups.end_scores(critic), plain["end_scores"], rtol=0, atol=1e-5)


def _grouped_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three short rows between three long ones (two groups at a small group cost); prompt width 60."""
    long_row = [True, False, True, False, False, True]
    prompt_mask = torch.tensor([[0] * (0 if long else 56) + [1] * (60 if long else 4) for long in long_row])
    answer_mask = torch.tensor([[1] * (40 if long else 3) + [0] * (0 if long else 37) for long in long_row])
    mask = torch.cat([prompt_mask, answer_mask], 1)
    return torch.randint(3, vocab, mask.shape, generator=torch.Generator().manual_seed(0)), mask, answer_mask.bool()


def _embedding_backwards(output: torch.Tensor) -> int:
    """How many embedding-lookup backward nodes the graph of `output` has."""
    seen, stack, count = set(), [output.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__.startswith("EmbeddingBackward")
        stack.extend(next_node for next_node, _ in node.next_functions)
    return count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_training_forward_over_several_groups_looks_up_the_embeddings_once(role, dtype):
    """A backward through several groups' forwards built the embedding table's dense gradient ([vocab, hidden])
    once per group and then summed them; the groups now share one lookup over the batch: the same outputs, bit
    for bit, the same gradients (up to the order of the sums), one embedding backward."""
    tokenizer = make_tokenizer()
    model = make_tiny_model("llama", tokenizer)[0]
    if role == "critic":
        model = RewardModel.from_causal_lm(model, tokenizer)
    model = model.to(dtype).eval()
    sequences, mask, answer = _grouped_rows(len(tokenizer))
    groups = RowGroups.of(sequences, mask, 60, group_cost_tokens=8)
    assert len(groups.rows) == 2

    def forward(shared: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        embeds = groups.shared_embeddings(model) if shared else [None] * len(groups.windows)
        if role == "actor":
            per_group = [window.to_answers(token_logprobs(window.logits(model, e), window.answer_tokens(),
                                                          tokenizer_size=None))
                         for window, e in zip(groups.windows, embeds)]
        else:
            per_group = [window.to_answers(window.values(model, e)) for window, e in zip(groups.windows, embeds)]
        out = groups.merge(per_group)
        backwards = _embedding_backwards(out)
        out[answer].float().sum().backward()
        return out.detach(), backwards, {name: p.grad.clone() for name, p in model.named_parameters()}

    out, backwards, grads = forward(shared=True)
    per_group_out, per_group_backwards, per_group_grads = forward(shared=False)
    assert (backwards, per_group_backwards) == (1, 2)
    assert torch.equal(out, per_group_out)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for name, grad in grads.items():
        torch.testing.assert_close(grad.float(), per_group_grads[name].float(), rtol=tolerance, atol=tolerance,
                                   msg=name)
    assert grads[next(n for n in grads if "embed" in n)].abs().sum() > 0
    with torch.no_grad():
        assert groups.shared_embeddings(model) == [None, None]  # scoring: nothing to save, token ids as before
    # the real entry points take the shared path
    model.zero_grad()
    result = groups.answer_logprobs(model, 1.0, None)[0] if role == "actor" else groups.answer_values(model)
    assert _embedding_backwards(result) == 1 and torch.equal(result.detach(), out)


def test_zero3_ranks_agree_on_the_group_count_so_their_weight_gathers_meet(tmp_path):
    """ZeRO-3 over two ranks: rank 0's rows alone split into two length groups, rank 1's into one. Each group is
    a forward whose weight gathers are collectives, so with a count per rank the actor's second forward on rank 0
    met the reference's first on rank 1 (DeepSpeed: "disagreement on list length"); the ranks now agree on one
    group each, and the log-probs equal the unpartitioned models'."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(REPO_ROOT / "tests" / "scripts" / "zero3_row_groups_worker.py"),
           make_tiny_model_dir(tmp_path / "actor"), make_tiny_model_dir(tmp_path / "reference", seed=1)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("ROW_GROUPS_OK") == 2


def test_a_fixed_group_count_cuts_the_rows_as_cheaply_as_that_count_allows():
    from training.core.answer_window import _cheapest_cuts

    widths = [5, 5, 6, 40, 41, 100]
    assert _cheapest_cuts(widths, 8) == [0, 3, 5, 6]
    assert _cheapest_cuts(widths, 8, groups=1) == [0, 6]
    assert _cheapest_cuts(widths, 8, groups=2) == [0, 5, 6]  # 5*41 + 100 beats 3*6 + 3*100
    assert _cheapest_cuts(widths, 8, groups=9) == [0, 1, 2, 3, 4, 5, 6]


def test_rows_alike_stay_one_group():
    sequences, mask, prompt_length = rows(100)
    groups = RowGroups.of(sequences, mask, prompt_length)
    assert len(groups.windows) == 1 and sorted(groups.rows[0].tolist()) == [0, 1, 2, 3]


def test_grouped_log_probs_and_entropies_are_never_taken_without_the_tokenizers_size():
    """A caller that left the tokenizer's size out would get, on a model with rows beyond its tokenizer, a
    distribution over every row, not the one generation draws from: like the exact KL, they take it with no default
    (None, every row, said outright)."""
    tokenizer = make_tokenizer()
    model = make_tiny_model("llama", tokenizer)[0].eval()
    groups = RowGroups.of(*rows(len(tokenizer)))
    with torch.no_grad():
        with pytest.raises(TypeError, match="tokenizer_size"):
            groups.answer_logprobs(model, 1.0)
        logits = groups.answer_logprobs(model, 1.0, None)[1]
        with pytest.raises(TypeError, match="tokenizer_size"):
            groups.answer_entropies(logits, 1.0)


@pytest.mark.parametrize("left_out", ["token_logprobs", "token_entropies", "kl_from_logits", "answer_logprobs"])
def test_log_probs_entropies_and_kl_are_never_taken_without_the_tokenizers_size(left_out):
    """As the grouped ones above: each of these takes the tokenizer's size with no default."""
    tokenizer = make_tokenizer()
    model = make_tiny_model("llama", tokenizer)[0].eval()
    sequences, mask, prompt_length = rows(len(tokenizer))
    logits, tokens = torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long)
    calls = {"token_logprobs": lambda: token_logprobs(logits, tokens, 1.0),
             "token_entropies": lambda: token_entropies(logits, 1.0),
             "kl_from_logits": lambda: kl_from_logits(logits, logits, torch.ones(1, 2), 1.0),
             "answer_logprobs": lambda: answer_logprobs(model, sequences, mask, prompt_length, 1.0)}
    with torch.no_grad(), pytest.raises(TypeError, match="tokenizer_size"):
        calls[left_out]()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bf16_window_and_group_results_at_positions_past_500_are_as_close_to_fp32_as_the_rollout_layouts(arch,
                                                                                                          tmp_path):
    """bf16 kernels of another shape round differently: the error against the fp32 result of the window's log-probs,
    and of the log-probs and a critic's values computed over several `RowGroups`, must be of the plain layout's
    order, at positions past 500 where rotary phases are large (learned ones for GPT-2 and OPT). The models load in
    each dtype as step 3 loads them (RoPE's frequencies stay fp32 in a bf16 model)."""
    path = make_tiny_model_dir(tmp_path, arch, max_positions=1024, initializer_range=0.3)

    def load(dtype: torch.dtype) -> tuple[torch.nn.Module, RewardModel]:
        """The causal LM and a critic on its backbone, its head drawn (in fp32) from seed 1."""
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        critic = RewardModel.from_causal_lm(model).eval()
        head = torch.randn(critic.v_head.weight.shape, generator=torch.Generator().manual_seed(1))
        critic.v_head.weight.data.copy_(head)
        return model, critic

    generator = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(3, 520, dtype=torch.long)
    prompt_mask[1, :40] = 0
    prompt_mask[2, :300] = 0
    answer_mask = torch.ones(3, 32, dtype=torch.long)
    answer_mask[0, 20:] = 0
    answer_mask[2, 5:] = 0
    mask = torch.cat([prompt_mask, answer_mask], 1)
    sequences = torch.randint(3, len(make_tokenizer()), mask.shape, generator=generator)
    window = AnswerWindow.of(sequences, mask, 520)
    assert window.sequences.shape[1] == 540  # the longest real row: 520 + 20; the rollout layout is 552 wide
    groups = RowGroups.of(sequences, mask, 520, group_cost_tokens=1)
    assert len(groups.windows) == 3
    answer = answer_mask.bool()

    def plain_results(model: torch.nn.Module, critic: RewardModel) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = token_logprobs(answer_logits(model, sequences, mask, 520), sequences[:, 520:], tokenizer_size=None)
        return logprobs[answer], critic(sequences, mask)["values"][:, 519:-1].float()[answer]

    with torch.no_grad():
        exact_logprobs, exact_values = plain_results(*load(torch.float32))
        model, critic = load(torch.bfloat16)
        plain_logprobs, plain_values = plain_results(model, critic)
        windowed = window.to_answers(token_logprobs(window.logits(model), window.answer_tokens(),
                                                    tokenizer_size=None))[answer]
        grouped = groups.answer_logprobs(model, 1.0, None)[0][answer]
        grouped_values = groups.answer_values(critic)[answer]
    for name, result, plain, exact in (("window log-probs", windowed, plain_logprobs, exact_logprobs),
                                       ("grouped log-probs", grouped, plain_logprobs, exact_logprobs),
                                       ("grouped values", grouped_values, plain_values, exact_values)):
        error, plain_error = (result - exact).abs().mean(), (plain - exact).abs().mean()
        assert error <= 1.5 * plain_error + 1e-3, (name, error, plain_error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_and_their_gradient_equal_log_softmax_without_an_fp32_copy_of_the_logits(monkeypatch,
                                                                                                 dtype):
    monkeypatch.setattr(sequences_module, "_CHUNK_ELEMENTS", 5 * 300)  # 5 rows per chunk: 14 chunks
    logits = (torch.randn(2, 35, 300, generator=torch.Generator().manual_seed(0)) * 4).to(dtype).requires_grad_()
    tokens = torch.randint(0, 300, (2, 35), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, 35, generator=torch.Generator().manual_seed(2))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
        got = token_logprobs(logits, tokens, temperature=0.7, tokenizer_size=None)
    (got * weights).sum().backward()
    got_grad, logits.grad = logits.grad.clone(), None
    expected = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
    (expected * weights).sum().backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_grad.float(), logits.grad.float(), rtol=0,
                               atol=1e-5 if dtype == torch.float32 else 2e-3)
    full = logits.numel()
    assert not [entry for entry in saved if entry == (torch.float32, full) and dtype != torch.float32], saved
    assert sum(numel for _, numel in saved if numel >= full) == full, "only the logits themselves are kept"


def test_chunked_entropies_equal_the_full_softmax_entropy(monkeypatch):
    monkeypatch.setattr(sequences_module, "_CHUNK_ELEMENTS", 7 * 50)
    logits = torch.randn(3, 11, 50, generator=torch.Generator().manual_seed(0)) * 3
    probs = torch.softmax(logits / 1.3, -1)
    expected = -(probs * torch.log_softmax(logits / 1.3, -1)).sum(-1)
    torch.testing.assert_close(token_entropies(logits, 1.3, tokenizer_size=None), expected, rtol=0, atol=1e-5)
