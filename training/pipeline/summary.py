"""Plain-text tables: the settings a deployment picked, and the end-of-run summary."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .deployment import DeploymentPlan

_LOCATION_KEYS = ("dir", "path")
_NOT_METRICS = frozenset({"wall_time_s", "epochs_completed", "step"})


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns; a cell with newlines spans several lines of its row."""
    split_rows = [[str(cell).split("\n") for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in split_rows:
        widths = [max(width, *(len(part) for part in cell)) for width, cell in zip(widths, row)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    lines = [line(headers), "  ".join("-" * width for width in widths)]
    for row in split_rows:
        height = max(len(cell) for cell in row)
        lines += [line([cell[i] if i < len(cell) else "" for cell in row]) for i in range(height)]
    return "\n".join(lines)


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def runs_as_planned(planned: Any, value: Any) -> bool:
    """Whether a step's flag value is the planned one (a plain argparse step keeps its values as strings)."""
    return value == planned or str(value) == str(planned)


def _setting_cell(planned: Any, runs_with: Mapping[str, Any], name: str) -> str:
    """The value a step runs with; where the user's flags changed the plan's, the planned one beside it."""
    value = runs_with.get(name, planned)
    if runs_as_planned(planned, value):
        return format_value(planned)
    return f"{format_value(value)} (planned {format_value(planned)})"


def settings_table(plan: DeploymentPlan, steps: Sequence[int],
                   runs_with: Mapping[int, Mapping[str, Any]] | None = None) -> str:
    """The plan's settings per step, each as the step runs it (`runs_with`: its command line's flag values, the
    user's after the plan's)."""
    runs_with = runs_with or {}
    names: list[str] = []
    for step in steps:
        names += [name for name in plan.steps[step].flags if name not in names]
    rows = [
        [name, *(_setting_cell(plan.steps[step].flags[name], runs_with.get(step, {}), name)
                 if name in plan.steps[step].flags else "-" for step in steps)]
        for name in names
    ]
    title = f"deployment: {plan.deployment.value} ({plan.world_size} process{'es' if plan.world_size > 1 else ''})"
    notes = "".join(f"\nnote: {note}" for note in plan.notes)
    return f"{title}{notes}\n" + render_table(["setting", *(f"step {step}" for step in steps)], rows)


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def key_metrics(summary: Mapping[str, Any]) -> list[str]:
    """`name value` for each numeric entry, with `x_before`/`x_after` pairs shown as `x before -> after`."""
    lines = []
    for key, value in summary.items():
        if key in _NOT_METRICS or not (_is_number(value) or value is None) or key.endswith("_before"):
            continue
        if key.endswith("_after"):
            name = key[: -len("_after")]
            before = summary.get(f"{name}_before")
            shown = f"{format_value(before)} -> {format_value(value)}" if before is not None else format_value(value)
            lines.append(f"{name} {shown}")
        elif value is not None:
            lines.append(f"{key} {format_value(value)}")
    return lines


@dataclass
class StepResult:
    step: int
    title: str
    seconds: float
    summary: Mapping[str, Any] = field(default_factory=dict)
    skipped: bool = False  # finished by an earlier run: `summary` is that run's

    @property
    def time(self) -> str:
        return "skipped" if self.skipped else format_duration(self.seconds)

    def locations(self) -> list[str]:
        return [v for k, v in self.summary.items() if isinstance(v, str) and any(h in k for h in _LOCATION_KEYS)]


def summary_table(results: Sequence[StepResult], total_seconds: float) -> str:
    rows = [
        [f"{r.step} {r.title}", r.time, "\n".join(key_metrics(r.summary)) or "-",
         "\n".join(r.locations()) or "-"]
        for r in results
    ]
    rows.append(["total", format_duration(total_seconds), "", ""])
    return render_table(["step", "time", "key metrics", "saved to"], rows)
