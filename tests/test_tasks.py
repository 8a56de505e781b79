"""The generated `task:` source and row metadata through the data layer (samples, cache, prompt batches)."""
import json
import re

import pytest
import torch
from supervised_data import build_phase_datasets
from tiny_models import make_tokenizer

from training.rewards import format_reward, math_reward
from utils.data import PromptCollator, TokenizedDataset, phase_splits
from utils.data.sources import load_source, parse_source_spec, source_fingerprint, source_identity
from utils.data.tasks import FINAL_ANSWER_TEMPLATE, SLIP_SIZES, generate_arithmetic, parse_task_spec
from utils.errors import UserError

LEVEL_QUESTIONS = {
    1: r"Compute (\d) \+ (\d)\.",
    2: r"Compute (\d\d) ([+-]) (\d\d)\.",
    3: r"Compute (\d\d) [+-] (\d\d) [+-] (\d\d)\.",
    4: r"Compute (\d\d) \* ([2-9]) [+-] (\d\d)\.",
    5: r"Compute (\d\d) \* ([2-9]) [+-] (\d\d) \* ([2-9])\.",
}
STEP = re.compile(r"(-?\d+) ([-+*]) (-?\d+) = (-?\d+)")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(chat_template=True, with_pad=True)


def expression(question):
    return re.fullmatch(r"Compute (.*)\.", question).group(1)


def final(solution):
    return int(re.search(r"The answer is (-?\d+)\.$", solution).group(1))


def test_generation_is_deterministic_and_seeded_by_its_own_option():
    first = generate_arithmetic(3, 50, 0)
    assert generate_arithmetic(3, 50, 0) == first
    assert [p.question for p in generate_arithmetic(3, 50, 1)] != [p.question for p in first]
    assert load_source(parse_source_spec("task:arithmetic?difficulty=3&size=50")).records == first


@pytest.mark.parametrize("difficulty", sorted(LEVEL_QUESTIONS))
def test_levels_answers_and_slips(difficulty):
    problems = generate_arithmetic(difficulty, 300, 5)
    questions = [p.question for p in problems]
    assert len(set(questions)) == len(questions) == (100 if difficulty == 1 else 300)
    for problem in problems:
        assert re.fullmatch(LEVEL_QUESTIONS[difficulty], problem.question), problem.question
        answer = eval(expression(problem.question))  # the question is plain integer arithmetic
        assert problem.metadata == {"answer": str(answer), "task": "arithmetic", "difficulty": difficulty}
        assert problem.solution.endswith(FINAL_ANSWER_TEMPLATE.format(answer))
        for left, op, right, result in STEP.findall(problem.solution):
            assert eval(f"{left} {op} {right}") == int(result)
        wrong = final(problem.wrong_solution)
        assert abs(wrong - answer) in SLIP_SIZES
        assert problem.wrong_solution.endswith(FINAL_ANSWER_TEMPLATE.format(wrong))
        assert len(STEP.findall(problem.wrong_solution)) == len(STEP.findall(problem.solution))
        assert math_reward("", problem.solution, problem.metadata) == 1.0
        assert math_reward("", problem.wrong_solution, problem.metadata) == 0.0
        assert format_reward("", problem.solution, {}) == format_reward("", problem.wrong_solution, {}) == 1.0
    if difficulty == 2:
        assert all(int(a) >= int(b) for a, op, b in (re.fullmatch(LEVEL_QUESTIONS[2], q).groups() for q in questions)
                   if op == "-")
    if difficulty in (3, 5):
        assert any(int(p.metadata["answer"]) < 0 for p in problems)


def test_example_problem_reads_as_documented():
    problem = generate_arithmetic(3, 1, 0)[0]
    a, op1, b, op2, c = re.fullmatch(r"Compute (\d+) ([+-]) (\d+) ([+-]) (\d+)\.", problem.question).groups()
    first = eval(f"{a} {op1} {b}")
    answer = eval(f"{first} {op2} {c}")
    assert problem.solution == f"{a} {op1} {b} = {first}, {first} {op2} {c} = {answer}. The answer is {answer}."


def test_size_caps_at_the_levels_distinct_problems():
    assert len(generate_arithmetic(1, 2000, 0)) == 100
    assert len(generate_arithmetic(2, 10**6, 0)) == 90 * 90 + 90 * 91 // 2


def test_wrong_answers_use_every_slip_and_both_slip_places():
    problems = generate_arithmetic(3, 400, 0)
    intermediate_slips = 0
    for problem in problems:
        right_steps, wrong_steps = STEP.findall(problem.solution), STEP.findall(problem.wrong_solution)
        intermediate_slips += right_steps[0] != wrong_steps[0]
    assert 0 < intermediate_slips < len(problems)
    gaps = {abs(final(p.wrong_solution) - int(p.metadata["answer"])) for p in problems}
    assert gaps == set(SLIP_SIZES)


def test_task_specs_are_canonical_and_fingerprinted_by_their_options():
    default = parse_source_spec("task:arithmetic")
    assert str(default) == "task:arithmetic?difficulty=2&seed=0&size=2000"
    assert parse_source_spec("task:arithmetic?seed=0&difficulty=2") == default
    assert source_identity("task:arithmetic?size=2000") == source_identity("task:arithmetic")
    assert source_fingerprint(default) == {"source": "task:arithmetic?difficulty=2&seed=0&size=2000"}
    assert source_fingerprint(parse_source_spec("task:arithmetic?seed=1")) != source_fingerprint(default)
    assert parse_task_spec("task:arithmetic?difficulty=4&size=10") == ("arithmetic", {"difficulty": 4, "size": 10, "seed": 0})


@pytest.mark.parametrize(("spec", "message"), [
    ("task:algebra", "unknown task 'algebra'.*task:arithmetic"),
    ("task:", "unknown task ''"),
    ("task:arithmetic?level=3", "bad option 'level=3'.*difficulty, size, seed"),
    ("task:arithmetic?difficulty", "bad option 'difficulty'"),
    ("task:arithmetic?size=5&size=6", "bad option 'size=6'.*at most once"),
    ("task:arithmetic?difficulty=hard", "difficulty of task:arithmetic must be an integer, not 'hard'"),
])
def test_bad_task_specs_are_user_errors(spec, message):
    with pytest.raises(UserError, match=message):
        parse_source_spec(spec)


@pytest.mark.parametrize(("spec", "message"), [
    ("task:arithmetic?difficulty=6", "difficulty must be one of 1, 2, 3, 4, 5, not 6"),
    ("task:arithmetic?size=0", "size must be at least 1"),
])
def test_bad_task_options_are_user_errors_when_loaded(spec, message):
    with pytest.raises(UserError, match=message):
        load_source(parse_source_spec(spec))


def test_step_shards_and_held_out_rows_are_disjoint_and_cover_the_task():
    spec = "task:arithmetic?size=300&difficulty=3"
    seen = []
    for phase in (1, 2, 3):
        (split,) = phase_splits(phase, [spec], "2,4,4", seed=11, eval_fraction=0.1)
        assert split.source.format == "task" and not split.skipped
        seen += [[s.turns[0]["content"] for s in part] for part in (split.train, split.eval)]
        assert all(s.metadata["answer"] for s in split.train + split.eval)
    questions = [q for part in seen for q in part]
    assert len(questions) == len(set(questions)) == 300
    assert [len(part) for part in seen] == [54, 6, 108, 12, 108, 12]


def find_in_prompt(tok, ids, pattern):
    return re.search(pattern, tok.decode(ids)).group(0)


def test_metadata_reaches_prompt_batches_through_the_cache(tmp_path, tok):
    args = {"phase": 3, "data_paths": ["task:arithmetic?size=200"], "data_split": "1,1,2", "tokenizer": tok,
            "max_seq_len": 128, "seed": 3, "data_output_path": str(tmp_path)}
    train, evaluation = build_phase_datasets(**args)
    (cache,) = tmp_path.glob("step3_prompts_*.pt")
    state = torch.load(cache, weights_only=True)
    assert len(state["train"]["metadata"]) == len(train) == 90 and len(evaluation) == 10
    again, _ = build_phase_datasets(**args, max_train_samples=7)
    assert again.metadata == train.metadata[:7]
    batch = PromptCollator(tok.pad_token_id)([train[i] for i in range(7)])
    assert [row["task"] for row in batch["metadata"]] == ["arithmetic"] * 7
    for row, ids, mask in zip(batch["metadata"], batch["input_ids"], batch["attention_mask"]):
        question = find_in_prompt(tok, ids[mask.bool()], r"Compute [^.]*\.")
        assert str(eval(expression(question))) == row["answer"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_local_rows_metadata_column_reaches_the_batch(tmp_path, tok):
    rows = [{"prompt": f"question {i}", "metadata": {"answer": str(i), "tags": ["a", 1, None, 2.5, True]}} for i in range(6)]
    rows[2] = {"prompt": "question 2"}
    rows[4] = {"prompt": "question 4", "metadata": "not a dict"}
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    (split,) = phase_splits(3, [path], "0,0,1", seed=0, eval_fraction=0.0)
    assert dict(split.skipped) == {"wrong_type:metadata": 1}
    train, _ = build_phase_datasets(3, [path], "0,0,1", tok, 128, 0, str(tmp_path / "cache"), eval_fraction=0.0)
    by_question = {find_in_prompt(tok, item["input_ids"], r"question \d"): item["metadata"] for item in train}
    assert by_question == {f"question {i}": ({} if i == 2 else rows[i]["metadata"]) for i in (0, 1, 2, 3, 5)}
    batch = PromptCollator(tok.pad_token_id)([train[0], train[1]])
    assert len(batch["metadata"]) == 2


def test_ordinary_sources_keep_batches_and_cache_as_before(tmp_path, tok):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"question {i}"} for i in range(5)])
    train, _ = build_phase_datasets(3, [path], "0,0,1", tok, 128, 0, str(tmp_path), eval_fraction=0.0)
    (cache,) = tmp_path.glob("step3_prompts_*.pt")
    assert set(torch.load(cache, weights_only=True)["train"]) == {"columns", "stats"}
    assert train.metadata is None and "metadata" not in train[0]
    assert set(PromptCollator(tok.pad_token_id)([train[0], train[1]])) == {"input_ids", "attention_mask"}


def test_only_prompt_items_keep_metadata(tmp_path, tok):
    spec = "task:arithmetic?size=40&difficulty=1"
    sft, _ = build_phase_datasets(1, [spec], "1,1,1", tok, 128, 0, str(tmp_path))
    pairs, _ = build_phase_datasets(2, [spec], "1,1,1", tok, 128, 0, str(tmp_path))
    assert sft.metadata is None and pairs.metadata is None and "metadata" not in pairs[0]


def test_tokenized_dataset_metadata_slices_and_round_trips(tmp_path):
    data = TokenizedDataset.from_lists({"input_ids": [[1, 2], [3], [4, 5, 6]]}, {"items": 3},
                                       metadata=[{"answer": "1"}, {}, {"answer": "3", "x": [1.5, None]}])
    assert data[2]["metadata"] == {"answer": "3", "x": [1.5, None]} and data[-2]["metadata"] == {}
    assert data.head(2).metadata == [{"answer": "1"}, {}]
    torch.save(data.state(), tmp_path / "d.pt")
    loaded = TokenizedDataset.from_state(torch.load(tmp_path / "d.pt", weights_only=True))
    assert loaded.metadata == data.metadata and loaded[2]["input_ids"].tolist() == [4, 5, 6]
    with pytest.raises(ValueError, match="same number of items"):
        TokenizedDataset.from_lists({"input_ids": [[1]]}, metadata=[{}, {}])


def test_prompt_collator_fills_rows_without_metadata():
    items = [{"input_ids": torch.tensor([1, 2]), "attention_mask": torch.ones(2, dtype=torch.long), "metadata": {"a": 1}},
             {"input_ids": torch.tensor([3]), "attention_mask": torch.ones(1, dtype=torch.long)}]
    batch = PromptCollator(0)(items)
    assert batch["metadata"] == [{"a": 1}, {}]
    assert batch["input_ids"].tolist() == [[1, 2], [0, 3]]
