"""Test-wide settings: CPU DeepSpeed, no hub access, one distributed world per test process."""
import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
sys.path.insert(0, str(TESTS_DIR))
sys.path.insert(0, str(REPO_ROOT))

import pytest  # noqa: E402

# pytest-xdist workers of a run that names no -n: CI's 2 cores. No more on a bigger machine: each worker's two-rank
# and subprocess tests start up to 3 processes of 1-2 GB each, sized for CI's 24 GiB; `-n N` asks for N.
DEFAULT_XDIST_WORKERS = 2


def default_xdist_workers() -> int:
    """`DEFAULT_XDIST_WORKERS`, or 0 (a serial run) where this process may use fewer CPUs than that."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return DEFAULT_XDIST_WORKERS if cpus >= DEFAULT_XDIST_WORKERS else 0


def needs_the_terminal(config: pytest.Config) -> bool:
    """Whether the run asks for the terminal, which xdist's workers do not have: `--pdb` and `--trace` stop in a
    debugger, `-s` (`--capture=no`) shows what the tests print; on a worker each would be ignored without a word."""
    return config.option.usepdb or config.option.trace or config.option.capture == "no"


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config):
    """A run whose command line names no -n (nor --tx) gets `default_xdist_workers()` workers, tests handed out by
    xdist's --dist load. Set here, not as pytest.ini's addopts, so that `-p no:xdist` (no -n option then) runs
    serially too, as `-n 0` does. A wrapper, to come before xdist's own hook, which turns -n into workers; not in a
    worker, which must start none of its own, nor where the run `needs_the_terminal`. No --dist loadgroup: under
    pytest 9.2 xdist 3.8's `xdist_group` marks are ignored without a word (pytest-xdist issue #1386). Nor loadfile or
    loadscope, which would hold a whole module to one worker (test_crash_resume's and test_step3_rlhf's take ~23 and
    ~17 min of a worker under load); the training runs a module's tests share are made once a run instead
    (`tests/shared_launch.py`), whichever workers its tests go to."""
    xdist_default = (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
                     and not needs_the_terminal(config))
    if xdist_default and config.option.numprocesses is None and not config.option.tx:
        config.option.numprocesses = default_xdist_workers()
    return (yield)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty stand-in hub cache (HF_HUB_OFFLINE set above); `put(name, config)` places a model in it as if
    downloaded: its config.json alone, and each of `files` (a file name and its text, or bytes) given."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    def put(name: str, config: dict, files: dict[str, str | bytes] | None = None) -> None:
        commit = "0" * 40
        repo = cache / f"models--{name.replace('/', '--')}"
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
        for file, text in {"config.json": json.dumps(config), **(files or {})}.items():
            path = repo / "snapshots" / commit / file
            if isinstance(text, bytes):
                path.write_bytes(text)
            else:
                path.write_text(text)

    return SimpleNamespace(path=cache, put=put)


def recorded_step_gradients(monkeypatch, module) -> dict:
    """Patch `module`'s `step_engine` to record, at each optimizer step, the gradient its engine holds, flattened,
    under the engine's name: at ZeRO-0 `param.grad`, or the fp32 sums of an optimizer that holds them
    (`get_grads_for_reduction`: bf16's `MasterWeightAdamW`); none under ZeRO-3. Returns the record."""
    import torch

    from training.reliability.guards import step_engine

    gradients = {}

    def recording(engine, name):
        if hasattr(engine.optimizer, "get_grads_for_reduction"):
            held = [grad.flatten() for grad in engine.optimizer.get_grads_for_reduction()[0]]
        else:
            held = [p.grad.flatten() for p in engine.module.parameters() if p.grad is not None]
        if engine.is_gradient_accumulation_boundary() and held:
            gradients[name] = torch.cat(held)
        return step_engine(engine, name)

    monkeypatch.setattr(module, "step_engine", recording)
    return gradients


def run_on_two_ranks(source: str, folder: Path, *args: str) -> str:
    """Write `source` to a script in `folder` and run it under `torch.distributed.run` on 2 local ranks, the tests
    and the repository importable, with `args`; asserts it exited 0 (with the end of its stderr) and returns its
    stdout."""
    import subprocess

    from utils.dist import free_port

    script = folder / "two_ranks.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": f"{TESTS_DIR}{os.pathsep}{REPO_ROOT}"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(free_port()), str(script), *args], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(autouse=True)
def lookups_forgotten():
    """Each test starts with no remembered hub lookup (`model_loading._remote_lookup_failure`, once a process for the
    same hub settings) nor this machine's names (`hostfile._this_machine_names`), nor a host looked up
    (`hostfile._lookup`, `hostfile.is_this_machine`): a test's unreachable hub, stand-in host name or resolver would
    otherwise answer another test's."""
    yield
    loading = sys.modules.get("training.core.model_loading")
    if loading is not None:
        loading._remote_lookup_failure.cache_clear()
    hostfile = sys.modules.get("training.pipeline.hostfile")
    if hostfile is not None:
        hostfile._this_machine_names.cache_clear()
        hostfile._lookup.cache_clear()
        hostfile.is_this_machine.cache_clear()


REMOTE_SHELL_TOOLS = ("pdsh", "ssh")  # what train.py needs on PATH to plan a run on other nodes


@pytest.fixture(scope="session")
def remote_shell_stand_ins(tmp_path_factory) -> Path:
    """A folder of stand-ins for the remote shell tools this machine lacks, each failing if run."""
    folder = tmp_path_factory.mktemp("remote_shell_stand_ins")
    for tool in REMOTE_SHELL_TOOLS:
        if shutil.which(tool) is None:
            (folder / tool).write_text(f"#!/bin/sh\necho 'a test ran the stand-in {tool}' >&2\nexit 127\n")
            (folder / tool).chmod(0o755)
    return folder


@pytest.fixture(autouse=True)
def remote_shell_tools_on_path(remote_shell_stand_ins):
    """pdsh and ssh on PATH, stand-ins last, where this machine has none: train.py refuses to plan a run on other
    nodes without them, and most multi_node tests plan one that they never launch. A real tool comes first. Set
    apart from the test's own `monkeypatch`, whose undo() would take it away mid-test."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{os.environ.get('PATH', '')}{os.pathsep}{remote_shell_stand_ins}")
        yield


@pytest.fixture(scope="session")
def distributed():
    """A single-process DeepSpeed world (gloo on 127.0.0.1), shared by every test in the process."""
    from utils.dist import init_distributed

    init_distributed()
    return True


@pytest.fixture
def cudnn_attention_restored():
    """cuDNN's attention kernel allowed inside the test, and torch's choice of kernels put back as the test found
    it after (`exclude_cudnn_attention` changes it for the whole process)."""
    import torch

    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(enabled)


@pytest.fixture
def tiny_model_dir(tmp_path):
    """Factory: `tiny_model_dir(arch)` writes a tiny HF model folder and returns its path."""
    from tiny_models import make_tiny_model_dir

    def make(arch: str = "llama", **kwargs) -> str:
        return make_tiny_model_dir(tmp_path / f"tiny-{arch}", arch, **kwargs)

    return make


@pytest.fixture
def fsynced_paths(monkeypatch) -> list[str]:
    """The paths the test's code fsyncs (`os.fsync`, which still runs), in order."""
    import os

    synced, fsync = [], os.fsync

    def recorded(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    return synced
