"""Every committed benchmark result says where, with what and how it was measured: a figure without its device,
library versions and command cannot be checked or reproduced."""
import contextlib
import importlib
import json
import shlex
from pathlib import Path

import pytest

from utils.errors import UserError

RESULTS = sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*.json"))


def _commands(report: dict) -> list:
    """The command that wrote the file, or each command of a GPU session's calls."""
    if "command" in report:
        return [report["command"]]
    return [call.get("command") for call in report.get("calls", [])] or [None]


def test_there_are_results_to_check():
    assert len(RESULTS) >= 10


@pytest.mark.parametrize("path", RESULTS, ids=[path.name for path in RESULTS])
def test_a_result_names_its_device_versions_and_command(path):
    report = json.loads(path.read_text())
    assert report.get("device"), "no device"
    versions = report.get("versions", {})
    assert all(versions.get(name) for name in ("torch", "transformers", "deepspeed")), f"versions missing: {versions}"
    assert all(isinstance(command, str) and command.strip() for command in _commands(report)), "no command"


def _bench_invocations(report: dict) -> list[tuple[str, list[str]]]:
    """Each bench/<name>.py a result's command ran, with its arguments (a command may chain several with &&)."""
    invocations = []
    for part in (report.get("command") or "").split("&&"):
        words = shlex.split(part)
        script = next((word for word in words if word.startswith("bench/") and word.endswith(".py")), None)
        if script is not None:
            invocations.append((Path(script).stem, words[words.index(script) + 1:]))
    return invocations


BENCH = Path(__file__).resolve().parents[1] / "bench"
PARSED = [(path, name, argv) for path in RESULTS for name, argv in _bench_invocations(json.loads(path.read_text()))
          if "\ndef parse_args(" in (BENCH / f"{name}.py").read_text()]


@pytest.mark.parametrize("path, name, argv", PARSED, ids=[f"{path.name}:{name}" for path, name, _ in PARSED])
def test_a_results_command_still_parses_with_todays_flags(path, name, argv, monkeypatch):
    """A result is reproduced by its command: a flag renamed without its old spelling kept as an alias would leave
    the committed command refused by argparse (SystemExit). A UserError is this machine's (a folder the command named
    on its own, TRL not installed) and passes."""
    monkeypatch.syspath_prepend(str(BENCH))  # as the scripts run: some import their neighbours (`from common ...`)
    parse_args = importlib.import_module(name).parse_args
    with contextlib.suppress(UserError):
        parse_args(argv)


PIPELINE_RUNS = [(path, argv) for path, name, argv in PARSED if name == "pipeline"]


def _check_train_flags(pipeline_argv: list[str]) -> None:
    """bench/pipeline.py's `--` part as train.py takes it, short of planning: its own flags and their values parsed
    (argparse's SystemExit on a bad value); the rest routed to the run's steps (a `UserError` naming a flag no step
    accepts); then each step's command, train.py's model and run-folder flags with the flags routed to it and its
    --stepN-args, parsed by that step's own parser as train.py parses it (a `UserError` naming the step whose flag or
    value it refuses). The plan's flags are left out (this machine's planner would give others), and no file is read,
    so a path only the measuring machine has (its --data_path) passes."""
    from bench.pipeline import parse_args
    from training.pipeline.cli import parse_config
    from training.pipeline.deployment import DeploymentPlan, DeploymentType
    from training.pipeline.plans import StepPlan
    from training.pipeline.runner import _parsed_step_commands, route_user_flags, step_argv
    from training.pipeline.steps import STEPS

    def entry(step):
        return STEPS[step].entry()

    _, train_argv = parse_args(pipeline_argv)
    config = parse_config(train_argv)
    routed = route_user_flags(config, entry)
    unplanned = DeploymentPlan(DeploymentType.CPU, 1, {step: StepPlan() for step in config.steps})
    models = {step: [(source, f"{source.model.value}-model") for source in STEPS[step].inputs] for step in config.steps}
    argvs = {step: step_argv(config, step, unplanned, routed, models) for step in config.steps}
    user_flags = {step: [*routed.get(step, []), *config.step_args[step]] for step in config.steps}
    _parsed_step_commands(config, user_flags, argvs, entry)


@pytest.mark.parametrize("path, argv", PIPELINE_RUNS, ids=[path.name for path, _ in PIPELINE_RUNS])
def test_a_pipeline_results_train_py_flags_still_parse(path, argv):
    """bench/pipeline.py's parse_args hands the flags after `--` to train.py unparsed, so the test above passed a
    committed pipeline command whose train.py flag had been renamed."""
    _check_train_flags(argv)


def test_a_renamed_train_py_flag_in_a_committed_pipeline_command_is_caught():
    """A committed command with --deployment-type spelled as a train.py that renamed it would no longer read."""
    argv = next(argv for _, argv in PIPELINE_RUNS if "--deployment-type" in argv)
    renamed = ["--deployment-kind" if word == "--deployment-type" else word for word in argv]
    with pytest.raises(UserError, match="--deployment-kind is not a flag of train.py nor of step"):
        _check_train_flags(renamed)


def test_a_renamed_step_flag_or_value_in_a_committed_pipeline_command_is_caught():
    """The flags routed to the steps were checked by name alone and --stepN-args not at all, so a committed command
    whose --optimizer value or --step3-args flag a step had renamed still passed."""
    argv = next(argv for _, argv in PIPELINE_RUNS if "torch_adamw" in argv)
    _check_train_flags([*argv, "--step3-args", "--actor_learning_rate 1e-6"])
    with pytest.raises(UserError, match=r"step 3's flags do not parse \(.*unrecognized arguments: --actor_lr 1e-6"):
        _check_train_flags([*argv, "--step3-args", "--actor_lr 1e-6"])
    renamed = ["torch_adam" if word == "torch_adamw" else word for word in argv]
    with pytest.raises(UserError, match=r"step 1's flags do not parse \(.*--optimizer: invalid choice: 'torch_adam'"):
        _check_train_flags(renamed)



def _report_from(code: Path, output: Path, monkeypatch) -> dict:
    """The report a bench writes with its code in the folder `code`."""
    import time
    from argparse import Namespace

    from bench import common

    monkeypatch.setattr(common, "REPO_ROOT", code)
    return common.write_report("check", Namespace(output=str(output)), [], time.time())


def test_a_new_report_names_the_commit_of_the_code_it_measured(tmp_path, monkeypatch):
    """A report named the device, versions and command but not the code: a figure could not be traced to the
    commit that produced it, nor told apart from one measured on a tree with uncommitted changes: a changed file or
    a new one (which the commit does not hold either), not one git ignores nor a result in bench/results. Outside a
    git checkout both are None."""
    import subprocess

    code = tmp_path / "code"
    code.mkdir()
    (code / "bench.py").write_text("print(1)\n")
    (code / ".gitignore").write_text("runs/\n")
    for command in (["init", "-q"], ["add", "bench.py", ".gitignore"],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "bench"]):
        subprocess.run(["git", *command], cwd=code, check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=code, capture_output=True, text=True,
                          check=True).stdout.strip()
    clean = _report_from(code, tmp_path / "clean.json", monkeypatch)
    assert clean["git_commit"] == head and clean["git_uncommitted_changes"] is False
    assert json.loads((tmp_path / "clean.json").read_text())["git_commit"] == head
    results = code / "bench" / "results"
    results.mkdir(parents=True)
    (results / "earlier.json").write_text("{}\n")  # a result a benchmark wrote is no change of the code measured
    assert _report_from(code, results / "next.json", monkeypatch)["git_uncommitted_changes"] is False
    (code / "runs").mkdir()
    (code / "runs" / "log.txt").write_text("a run's output, which git ignores\n")
    assert _report_from(code, tmp_path / "ignored.json", monkeypatch)["git_uncommitted_changes"] is False
    (code / "helper.py").write_text("print(3)\n")  # a new module a benchmark may import: not in the commit either
    assert _report_from(code, tmp_path / "new.json", monkeypatch)["git_uncommitted_changes"] is True
    (code / "helper.py").unlink()
    (code / "bench.py").write_text("print(2)\n")
    assert _report_from(code, tmp_path / "changed.json", monkeypatch)["git_uncommitted_changes"] is True
    outside = _report_from(tmp_path, tmp_path / "outside.json", monkeypatch)
    assert outside["git_commit"] is None and outside["git_uncommitted_changes"] is None
