"""train.py's --launcher: multi_node ranks started through Slurm's srun or MPI's mpirun by DeepSpeed's launcher.

No cluster here: stand-ins for srun and mpirun, first on PATH, record the command DeepSpeed's launcher builds from
train.py's and the environment it gives them; the srun stand-in also starts the ranks here, with the variables srun
sets for each task, to check that they find one another.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from training.pipeline.config import PipelineConfig
from training.pipeline.deployment import DeploymentType
from training.pipeline.launch import Launcher
from training.pipeline.runner import _launch_env
from utils.dist import free_port
from utils.errors import UserError

# srun's stand-in: records its arguments and environment, then starts the rank command that follows DeepSpeed's
# --export=ALL,... word once for each of its -n tasks, with those exports and the variables srun sets for a task
FAKE_SRUN = """#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["LAUNCHER_RECORD"], "w") as record:
    json.dump({{"argv": args, "env": dict(os.environ)}}, record)
tasks = int(args[args.index("-n") + 1])
export = next(i for i, word in enumerate(args) if word.startswith("--export="))
exported = dict(pair.split("=", 1) for pair in args[export][len("--export="):].split(",")[1:])
ranks = [subprocess.Popen(args[export + 1:], env={{**os.environ, **exported, "SLURM_PROCID": str(task),
                                                  "SLURM_NTASKS": str(tasks), "SLURM_LOCALID": str(task),
                                                  "SLURM_STEP_NUM_NODES": "1"}})
         for task in range(tasks)]
sys.exit(max(rank.wait() for rank in ranks))
"""
# OpenMPI's mpirun as on other nodes: records its arguments and environment, then starts the rank command (from this
# python on) once for each of its -n tasks with a node's own few variables, those its -x flags export (by name: its
# own value) and the variables mpirun sets for a rank
FAKE_OPENMPI = """#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
tasks = int(args[args.index("-n") + 1])
command = args.index({python!r})
exported = dict(pair.split("=", 1) if "=" in pair else (pair, os.environ[pair])
                for flag, pair in zip(args[:command], args[1:command]) if flag == "-x")
with open(os.environ["LAUNCHER_RECORD"], "w") as record:
    json.dump({{"argv": args, "env": dict(os.environ), "exported": exported}}, record)
node = {{name: os.environ[name] for name in ("PATH", "HOME", "DS_ACCELERATOR")}}
ranks = [subprocess.Popen(args[command:], env={{**node, **exported, "OMPI_COMM_WORLD_RANK": str(task),
                                               "OMPI_COMM_WORLD_SIZE": str(tasks),
                                               "OMPI_COMM_WORLD_LOCAL_RANK": str(task),
                                               "OMPI_COMM_WORLD_LOCAL_SIZE": str(tasks)}})
         for task in range(tasks)]
sys.exit(max(rank.wait() for rank in ranks))
"""
FAKE_RECORDER = """#!{python}
import json, os, sys
with open(os.environ["LAUNCHER_RECORD"], "w") as record:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, record)
"""
# a step's stand-in: joins the world as the steps do, and says where it stands in it
RANK_SCRIPT = """import json, os, sys
import torch
import torch.distributed as torch_dist
from utils.dist import init_distributed
init_distributed()
total = torch.tensor([float(torch_dist.get_rank())])
torch_dist.all_reduce(total)
with open(os.path.join(sys.argv[sys.argv.index("--output_dir") + 1], f"rank{torch_dist.get_rank()}.json"), "w") as f:
    json.dump({"rank": torch_dist.get_rank(), "world": torch_dist.get_world_size(), "total": total.item(),
               "local_rank": os.environ["LOCAL_RANK"], "master": os.environ["MASTER_ADDR"]}, f)
"""


def stand_ins(folder: Path, **programs: str) -> Path:
    """`folder`/bin holding each program named, its source formatted with this python."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    for name, source in programs.items():
        (bin_dir / name).write_text(source.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    return bin_dir


def launched(tmp_path: Path, monkeypatch, launcher: Launcher, bin_dir: Path, argv: list[str]) -> dict:
    """Run train.py's command for `launcher` (DeepSpeed's launcher, the stand-ins first on PATH) in the environment
    train.py gives it; return what the stand-in recorded."""
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LAUNCHER_RECORD", str(tmp_path / "record.json"))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    command = launcher.command_now(script, argv)
    env = _launch_env(PipelineConfig(output_dir=tmp_path / "out"), launcher)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {**json.loads((tmp_path / "record.json").read_text()), "script": str(script)}


def hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_a_slurm_launch_runs_srun_whose_ranks_join_one_world(tmp_path, monkeypatch):
    """Under --launcher slurm DeepSpeed's launcher runs `srun -n RANKS ... --export=ALL,... python -u SCRIPT FLAGS`,
    which sets SLURM_PROCID and the like for each rank, not RANK or WORLD_SIZE: the steps started a world of one each
    (every rank training alone on GPU 0); they now read srun's variables, and train.py gives them rank 0's address."""
    bin_dir = stand_ins(tmp_path, srun=FAKE_SRUN, sinfo="#!/bin/sh\nexit 0\n")
    port = free_port()
    launcher = Launcher(DeploymentType.MULTI_NODE, hostfile=hostfile(tmp_path, "localhost slots=2\n"), nodes=1,
                        on_this_machine=True, hosts=("localhost",), backend="slurm", backend_args="--partition=gpu",
                        master_addr="127.0.0.1", master_port=port, slots=2)
    (tmp_path / "run").mkdir()
    monkeypatch.setenv("SLURMD_NODENAME", "node-0")  # Slurm's name for this machine, the hostfile's `localhost`
    record = launched(tmp_path, monkeypatch, launcher, bin_dir, ["--output_dir", str(tmp_path / "run")])
    argv = record["argv"]
    assert argv[:9] == ["-n", "2", "--nodes", "1", "--ntasks-per-node", "2", "--nodelist", "node-0", "--partition=gpu"]
    assert argv[argv.index(record["script"]) - 2:] == [sys.executable, "-u", record["script"], "--output_dir",
                                                       str(tmp_path / "run")]
    assert record["env"]["MASTER_PORT"] == str(port) and record["env"]["RLHF_LAUNCHER"] == "slurm"
    ranks = [json.loads((tmp_path / "run" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks == [{"rank": rank, "world": 2, "total": 1.0, "local_rank": str(rank), "master": "127.0.0.1"}
                     for rank in (0, 1)]


SRUN_RANK_3_OF_4 = {"RLHF_LAUNCHER": "slurm", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                    "SLURM_STEP_NUM_NODES": "2"}


def test_a_step_started_by_srun_checks_its_flags_on_srun_s_world(tmp_path_factory, monkeypatch):
    """Step 3 checks its flags against the world size (and sets its logging by its rank) before it joins the world:
    srun's variables were read only as it joined, so every rank read rank 0 of 1 and refused a placement that needs
    several ranks."""
    from test_step3_rlhf import make_step3_inputs, step3_argv

    from step3_rlhf.main import check_args, parse_args
    from utils import dist
    from utils.dist import get_local_rank, get_rank, get_world_size, is_main_process

    rank_variables = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    environ = {name: value for name, value in os.environ.items() if name not in rank_variables}
    monkeypatch.setattr(os, "environ", {**environ, **SRUN_RANK_3_OF_4})  # the ranks it maps are undone with it
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # before it joins: not the world of an earlier test
    inputs = make_step3_inputs(tmp_path_factory)
    check_args(parse_args(step3_argv(inputs, tmp_path_factory.mktemp("run"), "--placement", "disaggregate")))
    assert (get_rank(), get_world_size(), get_local_rank(), is_main_process()) == (3, 4, 1, False)
    assert os.environ["LOCAL_WORLD_SIZE"] == "2"


def test_a_slurm_launch_passes_the_users_env_file_lines_checked(tmp_path, monkeypatch):
    """DeepSpeed's launcher reads ./.deepspeed_env itself, unchecked under srun and mpirun: a blank line there ended
    step 1's launch in a ValueError's traceback. train.py passes its lines on in an env file of its own."""
    bin_dir = stand_ins(tmp_path, srun=FAKE_SRUN, sinfo="#!/bin/sh\nexit 0\n")
    (tmp_path / ".deepspeed_env").write_text("HF_FROM_ENV_FILE=yes\n\n")
    monkeypatch.chdir(tmp_path)  # train.py's working folder, where DeepSpeed's launcher reads it
    launcher = Launcher(DeploymentType.MULTI_NODE, hostfile=hostfile(tmp_path, "localhost slots=1\n"), nodes=1,
                        on_this_machine=True, hosts=("localhost",), backend="slurm", master_addr="127.0.0.1",
                        master_port=free_port(), slots=1)
    (tmp_path / "run").mkdir()
    record = launched(tmp_path, monkeypatch, launcher, bin_dir, ["--output_dir", str(tmp_path / "run")])
    assert next(word for word in record["argv"] if word.startswith("--export=")).endswith(",HF_FROM_ENV_FILE=yes")


@pytest.mark.parametrize("backend, variable, value, said", [
    ("slurm", None, "# a comment", "is not a variable's line"),
    ("impi", None, "HF_HOME=/data/my models", "HF_HOME='/data/my models' would not reach the ranks as it is"),
    ("impi", "PYTHONPATH", "/tmp/my dir", "would not reach the ranks as it is"),
    ("slurm", "PYTHONWARNINGS", "ignore,default", "PYTHONWARNINGS='ignore,default' would not reach the ranks"),
])
def test_an_export_srun_or_mpirun_would_not_pass_as_it_is_is_refused_by_a_dry_run(tmp_path, monkeypatch, backend,
                                                                                  variable, value, said):
    """DeepSpeed's launcher wraps an exported value with a space (and the like) in double quotes, which no shell
    removes under srun and mpirun (they arrived in the value), srun's --export cuts a value at a comma, and a comment
    in the user's env file ended the launch in a traceback: a dry run said nothing of them."""
    from training.pipeline.cli import run

    monkeypatch.chdir(tmp_path)
    if variable is None:
        (tmp_path / ".deepspeed_env").write_text(f"{value}\n")
    else:
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("PATH", f"{stand_ins(tmp_path, srun='', sinfo='', mpirun='')}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(UserError, match=re.escape(said)):
        run(["--step", "1", "--output-dir", str(tmp_path / "out"), "--dry-run", "--deployment-type", "multi_node",
             "--launcher", backend, "--hostfile", hostfile(tmp_path, "localhost slots=1\n")])


@pytest.mark.parametrize("backend, hosts, args, said", [
    ("impi", "localhost slots=1\n", "-iface 'ib0", "--launcher-args \"-iface 'ib0\": No closing quotation"),
    ("pdsh", "localhost slots=1\n", "-l other", "the hostfile names this machine alone"),
    ("slurm", "localhost slots=1\n", "-p gpu --nodes=3 -w node-a", "--nodes=3, -w would override the layout"),
])
def test_launcher_args_that_would_fail_or_go_unused_are_refused_by_a_dry_run(tmp_path, monkeypatch, backend, hosts,
                                                                           args, said):
    """DeepSpeed's launcher splits --launcher-args as a shell does (an unclosed quote: a ValueError's traceback as
    step 1 launched), and under pdsh with a hostfile of this machine alone starts the ranks without pdsh; srun's own
    --nodes, --ntasks-per-node or --nodelist would override the hostfile's layout that MASTER_ADDR and
    LOCAL_WORLD_SIZE follow."""
    from training.pipeline.cli import run

    bin_dir = stand_ins(tmp_path, mpirun='', srun='', sinfo='')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(UserError, match=re.escape(said)):
        run(["--step", "1", "--output-dir", str(tmp_path / "out"), "--dry-run", "--deployment-type", "multi_node",
             "--launcher", backend, "--launcher-args", args, "--hostfile", hostfile(tmp_path, hosts)])


def test_the_pdsh_stop_command_runs_pdsh_with_the_launcher_args():
    """The ranks' stop command reaches the nodes as DeepSpeed's pdsh launcher did, with --launcher-args' flags: without
    them a `-l otheruser` launch had its stop request's pkill run as this user, matching no rank."""
    launcher = Launcher(DeploymentType.MULTI_NODE, hostfile="/h", nodes=2, hosts=("w1", "w2"), backend_args="-l other")
    command = launcher.ranks_stop_command(Path("/repo/step1_sft/main.py"), ["--output_dir", "/runs/1"])
    assert command[command.index("-w"):-1] == ["-w", "w1,w2", "-l", "other"]


def test_a_stray_launcher_name_in_train_pys_environment_leaves_its_own_steps_a_world_of_one(tmp_path, monkeypatch):
    """RLHF_LAUNCHER=slurm exported in a batch script (SLURM_NTASKS=4 there) made a cpu run's step, run in train.py's
    process, read srun's variables and wait for 3 ranks that never came: train.py sets it only for what it launches."""
    from training.pipeline.cli import run
    from utils.dist import get_world_size

    batch_script = {"RLHF_LAUNCHER": "slurm", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}
    environ = {name: value for name, value in os.environ.items() if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    monkeypatch.setattr(os, "environ", {**environ, **batch_script})
    run(["--deployment-type", "cpu", "--step", "1", "--output-dir", str(tmp_path / "out"), "--dry-run"])
    assert "RLHF_LAUNCHER" not in os.environ and get_world_size() == 1


def test_a_slurm_launch_gives_srun_the_hostfiles_nodes_and_ranks_a_node(tmp_path, monkeypatch):
    """DeepSpeed's launcher gives srun `-n RANKS` alone: inside a batch job srun took the job's node count
    (SLURM_JOB_NUM_NODES, read before SLURM_NNODES since Slurm 20.11) and any of its nodes, which may not be the
    hostfile's (rank 0 away from MASTER_ADDR, each rank's LOCAL_WORLD_SIZE wrong). train.py gives srun the hostfile's
    layout and node names as flags ahead of --launcher-args."""
    bin_dir = stand_ins(tmp_path, srun=FAKE_RECORDER, sinfo="#!/bin/sh\nexit 0\n")
    for name, value in {"SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4", "SLURM_NTASKS_PER_NODE": "8"}.items():
        monkeypatch.setenv(name, value)  # the batch job's
    launcher = Launcher(DeploymentType.MULTI_NODE, hostfile=hostfile(tmp_path, "node-a slots=2\nnode-b slots=2\n"),
                        nodes=2, hosts=("node-a", "node-b"), backend="slurm", slots=2, backend_args="-p gpu")
    record = launched(tmp_path, monkeypatch, launcher, bin_dir, ["--output_dir", "/runs/x"])
    assert record["argv"][:10] == ["-n", "4", "--nodes", "2", "--ntasks-per-node", "2", "--nodelist", "node-a,node-b",
                                   "-p", "gpu"]


def test_a_slurm_launcher_is_not_built_without_the_hostfiles_slots():
    """srun's --ntasks-per-node is the hostfile's slots: a Launcher built without them gave srun `--ntasks-per-node 0`
    (the field's old default), unsaid."""
    with pytest.raises(ValueError, match="needs the hostfile's slots a node"):
        Launcher(DeploymentType.MULTI_NODE, hostfile="/h", nodes=2, hosts=("node-a", "node-b"), backend="slurm")


def test_an_mpi_launch_runs_mpirun_on_the_hostfiles_nodes_with_rank_0s_address(tmp_path, monkeypatch):
    """Under --launcher impi DeepSpeed's launcher runs mpirun on the hostfile's nodes, giving every rank its RANK,
    WORLD_SIZE and the master's address and port, with no ssh from this machine: rank 0's address is the hostfile's
    first node unless --master-addr names one. mpirun starts each rank itself, so a rank's exit code is mpirun's."""
    bin_dir = stand_ins(tmp_path, mpirun=FAKE_RECORDER)
    launcher = Launcher(DeploymentType.MULTI_NODE, hostfile=hostfile(tmp_path, "node-a slots=2\nnode-b slots=2\n"),
                        nodes=2, hosts=("node-a", "node-b"), backend="impi", backend_args="-iface ib0")
    record = launched(tmp_path, monkeypatch, launcher, bin_dir, ["--output_dir", "/runs/x"])
    words = " ".join(record["argv"])
    assert words.startswith("-ppn 2 -iface ib0")
    assert "-genv MASTER_ADDR node-a -genv MASTER_PORT 29500 -genv WORLD_SIZE 4" in words
    assert "-hosts node-a,node-b" in words
    assert words.endswith(f"{record['script']} --output_dir /runs/x")
    assert f"-n 1 -env RANK 1 -env LOCAL_RANK 1 {sys.executable} -u {record['script']}" in words
    assert "launcher_helper" not in words


def test_an_impi_launch_exiting_3_with_no_stop_request_is_a_failure(tmp_path, monkeypatch):
    """Intel MPI's mpirun (Hydra) ORs its ranks' exit statuses: one rank's 1 and another's 2 gave 3, train.py's
    EXIT_INTERRUPTED, and a failed step was reported stopped. There only a stop request train.py passed on makes a
    stop: a step train.py launches through mpirun, which exits 3, is reported failed; through pdsh a launcher's 3 is
    still the ranks' own stop."""
    from training.pipeline.cli import run
    from training.pipeline.launch import StepStopped, run_subprocess

    mpirun = stand_ins(tmp_path, mpirun="#!/bin/sh\nexit 3\n") / "mpirun"
    monkeypatch.setenv("PATH", f"{mpirun.parent}{os.pathsep}{os.environ['PATH']}")
    nodes = hostfile(tmp_path, "node-a slots=1\nnode-b slots=1\n")
    with pytest.raises(UserError, match=r"^step 1 \(.*\) failed \(exit status 3\)"):
        run(["--step", "1", "--output-dir", str(tmp_path / "out"), "--deployment-type", "multi_node",
             "--launcher", "impi", "--hostfile", nodes])
    pdsh = Launcher(DeploymentType.MULTI_NODE, hostfile=nodes, nodes=2, hosts=("node-a", "node-b"))
    with pytest.raises(StepStopped):
        run_subprocess([str(mpirun)], tmp_path / "step1.log", "step 1", stop_status=pdsh.stop_status)


def test_mpich_is_not_offered_as_its_helper_reports_a_failed_rank_finished(tmp_path, capsys):
    """DeepSpeed's mpich runner starts each rank through its launcher_helper.py, which waits for the rank and exits 0
    whatever its exit code: a failed or stopped step was reported finished, with no resume hint."""
    import deepspeed.launcher

    from training.pipeline.cli import run

    failing = tmp_path / "failing.py"
    failing.write_text("import sys\nsys.exit(3)\n")
    helper = Path(deepspeed.launcher.__file__).parent / "launcher_helper.py"
    helped = subprocess.run([sys.executable, str(helper), "--launcher", "mpich", str(failing)], capture_output=True,
                            env={**os.environ, "PMI_RANK": "0", "MPI_LOCALRANKID": "0"}, timeout=120, check=False)
    assert helped.returncode == 0  # the rank's 3 is lost: offer mpich again where this fails
    with pytest.raises(SystemExit):
        run(["--step", "1", "--output-dir", str(tmp_path / "out"), "--dry-run", "--deployment-type", "multi_node",
             "--launcher", "mpich", "--hostfile", hostfile(tmp_path, "localhost slots=1\n")])
    assert "invalid choice: 'mpich'" in capsys.readouterr().err


def test_an_openmpi_launch_exports_what_its_ranks_need_and_they_join_one_world(tmp_path, monkeypatch):
    """Under --launcher openmpi DeepSpeed's launcher runs `mpirun -n RANKS -hostfile FILE ... python -u SCRIPT FLAGS`:
    its ranks get OMPI_COMM_WORLD_RANK and the like, not RANK or WORLD_SIZE, and on other nodes none of this
    environment but what mpirun exports (-x). train.py exports rank 0's address and port, its launcher's name and the
    variables pdsh's env file would carry (HF_*, TORCH_*, ...) by name, so their values arrive as they are, and the
    ranks read mpirun's variables. --launcher-args naming btl_tcp_if_include replaces DeepSpeed's eth0."""
    bin_dir = stand_ins(tmp_path, mpirun=FAKE_OPENMPI, ompi_info="#!/bin/sh\nexit 0\n")
    port = free_port()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf home, with a comma"))
    launcher = Launcher(DeploymentType.MULTI_NODE, hostfile=hostfile(tmp_path, "localhost slots=2\n"), nodes=1,
                        on_this_machine=True, hosts=("localhost",), backend="openmpi",
                        backend_args="--mca btl_tcp_if_include lo", master_addr="127.0.0.1", master_port=port)
    (tmp_path / "run").mkdir()
    record = launched(tmp_path, monkeypatch, launcher, bin_dir, ["--output_dir", str(tmp_path / "run")])
    words = " ".join(record["argv"])
    assert words.startswith(f"-n 2 -hostfile {launcher.hostfile} --mca btl ^openib --mca btl_tcp_if_include lo")
    assert "eth0" not in words
    for name in ("HF_HOME", "MASTER_ADDR", "MASTER_PORT", "RLHF_LAUNCHER", "TORCH_EXTENSIONS_DIR"):
        assert f"-x {name} " in words
    assert record["env"]["RLHF_LAUNCHER"] == "openmpi" and record["env"]["MASTER_PORT"] == str(port)
    assert record["exported"]["HF_HOME"] == str(tmp_path / "hf home, with a comma")
    ranks = [json.loads((tmp_path / "run" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks == [{"rank": rank, "world": 2, "total": 1.0, "local_rank": str(rank), "master": "127.0.0.1"}
                     for rank in (0, 1)]


def test_a_hostfile_of_unequal_slots_is_taken_under_openmpi(tmp_path, monkeypatch):
    """OpenMPI's mpirun fills each node's slots as the hostfile gives them (-hostfile, no -ppn)."""
    from training.pipeline.cli import run

    monkeypatch.setenv("PATH", f"{stand_ins(tmp_path, mpirun='', ompi_info='')}{os.pathsep}{os.environ['PATH']}")
    command = run(["--step", "1", "--output-dir", str(tmp_path / "out"), "--dry-run", "--deployment-type",
                   "multi_node", "--launcher", "openmpi", "--hostfile",
                   hostfile(tmp_path, "worker-1 slots=2\nworker-2 slots=1\n")])["commands"][1]
    assert command[command.index("--launcher") + 1] == "openmpi"


@pytest.mark.parametrize("backend, missing", [("slurm", "srun and sinfo are"), ("impi", "mpirun is"),
                                              ("openmpi", "mpirun and ompi_info are")])
def test_a_launcher_whose_program_is_not_on_path_is_refused_by_a_dry_run(tmp_path, monkeypatch, backend, missing):
    """DeepSpeed's launcher failed only as step 1 launched ("launcher 'slurm' not installed", mpirun not found), and
    a dry run printed its commands. With the program on PATH (and no pdsh nor ssh) the command goes through it,
    with no ssh check, on a hostfile of this machine alone too."""
    from training.pipeline.cli import run

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    argv = ["--step", "1", "--output-dir", str(tmp_path / "out"), "--dry-run", "--deployment-type", "multi_node",
            "--launcher", backend, "--hostfile", hostfile(tmp_path, "localhost slots=1\n")]
    with pytest.raises(UserError, match=f"^multi_node --launcher {backend}: {missing} not on PATH here.*"
                                        f"or pick another --launcher"):
        run(argv)
    bin_dir = stand_ins(tmp_path, srun="", sinfo="", mpirun="", ompi_info="")
    monkeypatch.setenv("PATH", str(bin_dir))
    command = run(argv)["commands"][1]
    assert {"--launcher", backend, "--force_multi", "--no_ssh_check", "--master_addr"} <= set(command)


def test_launcher_args_of_one_flag_are_shown_in_the_form_argparse_takes():
    """`--launcher-args --allow-run-as-root` ends in argparse's 'expected one argument' (a lone word beginning with a
    dash is read as a flag), the form README showed; README and the flag's help show `--launcher-args=--flag`."""
    from training.pipeline.cli import build_parser, parse_config

    assert "--launcher-args=--allow-run-as-root" in (REPO_ROOT / "README.md").read_text()
    assert "--launcher-args=--allow-run-as-root" in "".join(build_parser().format_help().split())
    assert parse_config(["--launcher-args=--allow-run-as-root"]).launcher_args == "--allow-run-as-root"


def test_master_addrs_help_gives_its_default_under_each_launcher():
    """Under slurm, impi and openmpi rank 0's address defaults to the hostfile's first node (`rank_0_address`), asked
    over no ssh; --master-addr's help gave pdsh's ssh default alone."""
    from training.pipeline.cli import build_parser

    help_text = " ".join(build_parser().format_help().split())
    assert "under slurm, impi and openmpi the hostfile's first node's name" in help_text


@pytest.mark.parametrize("flags", [["--deployment-type", "cpu", "--launcher", "slurm"],
                                   ["--deployment-type", "cpu", "--launcher-args", "-p gpu"]])
def test_a_launcher_off_multi_node_is_refused(tmp_path, flags):
    from training.pipeline.cli import run

    flag = flags[2]
    with pytest.raises(UserError, match=f"^{flag} is for --deployment-type multi_node; this run is cpu"):
        run(["--step", "1", "--output-dir", str(tmp_path / "out"), "--dry-run", *flags])


def test_a_hostfile_of_unequal_slots_is_refused_under_slurm_and_mpi_not_pdsh(tmp_path):
    """DeepSpeed's Slurm and MPI runners start as many ranks on every node, and failed at launch with a traceback."""
    from training.pipeline.cli import run

    argv = ["--step", "1", "--output-dir", str(tmp_path / "out"), "--dry-run", "--deployment-type", "multi_node",
            "--hostfile", hostfile(tmp_path, "worker-1 slots=2\nworker-2 slots=1\n")]
    with pytest.raises(UserError, match="its nodes have 2, 1 slots, and DeepSpeed's slurm launcher starts as many"):
        run([*argv, "--launcher", "slurm"])
    assert run(argv)["commands"][1]


def test_a_cuda_visible_devices_is_not_said_unfollowed_under_slurm(tmp_path, monkeypatch, capsys):
    """Through pdsh DeepSpeed's per-node launcher gives a hostfile's ranks GPUs 0 to slots - 1, and train.py warns
    where CUDA_VISIBLE_DEVICES lists others; srun leaves the variable to the ranks (each takes the GPU of its local
    rank among those it lists), so the warning was untrue there."""
    from training.pipeline.cli import run

    monkeypatch.setenv("PATH", f"{stand_ins(tmp_path, srun='', sinfo='')}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    argv = ["--step", "1", "--output-dir", str(tmp_path / "out"), "--dry-run", "--deployment-type", "multi_node",
            "--hostfile", hostfile(tmp_path, "localhost slots=2\nworker-2 slots=2\n")]
    run([*argv, "--launcher", "slurm"])
    assert "CUDA_VISIBLE_DEVICES" not in capsys.readouterr().err
    run(argv)
    assert "CUDA_VISIBLE_DEVICES=2,3 is not followed" in capsys.readouterr().err


SRUN_STEP = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "16",
             "SLURM_PROCID": "3"}


@pytest.mark.parametrize("variables, said", [
    (SRUN_STEP, "started by srun as rank 3 of 16 processes (SLURM_STEP_NUM_TASKS=16)"),
    ({**SRUN_STEP, "SLURM_PTY_PORT": "40123"}, "started by srun as rank 3 of 16 processes"),  # not --pty's task 0
    ({**SRUN_STEP, "SLURM_PTY_PORT": "40123", "SLURM_PROCID": "0"},  # a nested srun's task 0, with no terminal
     "started by srun as rank 0 of 16 processes"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"},
     "started by OpenMPI's mpirun as rank 1 of 4 processes (OMPI_COMM_WORLD_SIZE=4)"),
    ({"PMI_SIZE": "4", "PMI_RANK": "2"}, "started by mpirun (MPICH, Intel MPI) as rank 2 of 4 processes (PMI_SIZE=4)"),
])
def test_train_py_started_as_one_of_several_tasks_of_srun_or_mpirun_is_refused(tmp_path, monkeypatch, variables,
                                                                               said):
    """`srun -n 16 python train.py` (or mpirun's) in a batch job started a whole pipeline in every task, all writing
    the same folders: srun and mpirun set no WORLD_SIZE, which alone was looked at."""
    from training.pipeline.cli import run

    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "isatty", lambda fd: False)  # started by srun, not typed at srun --pty's terminal
    out = tmp_path / "out"
    refusal = f"{re.escape(said)}.*Run it once.*as one task.*--launcher slurm.* start the ranks"
    with pytest.raises(UserError, match=refusal):
        run(["--deployment-type", "cpu", "--step", "1", "--output-dir", str(out), "--dry-run"])
    assert not out.exists()


@pytest.mark.parametrize("variables", [
    {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8", "SLURM_PROCID": "0",
     "SLURM_LOCALID": "0", "ENVIRONMENT": "BATCH"},  # the batch script itself, run once on the first node
    {**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"},  # srun -n 1
    {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0", "PMI_SIZE": "1", "PMI_RANK": "0"},  # mpirun -n 1
    {**SRUN_STEP, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_PTY_PORT": "40123"},  # srun -n 8 --pty bash
])
def test_train_py_run_once_in_a_batch_job_or_as_one_task_is_not_refused(monkeypatch, variables):
    """A batch script has SLURM_NTASKS (its #SBATCH --ntasks) but is one process; srun -n 1 and mpirun -n 1 start
    one; an interactive `srun -n 8 --pty bash` gives its terminal to task 0 alone."""
    from training.pipeline.launch import SEVERAL_TASKS_VARIABLES, check_not_under_a_launcher

    for name, (_, rank_name) in SEVERAL_TASKS_VARIABLES.items():
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(rank_name, raising=False)
    monkeypatch.delenv("SLURM_PTY_PORT", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "isatty", lambda fd: fd == 0)  # typed at a terminal (srun --pty's, for task 0)
    check_not_under_a_launcher()


MPIRUN_ONE_TASK = {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                   "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "PMIX_RANK": "0", "PMI_SIZE": "1", "PMI_RANK": "0",
                   "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1", "MV2_COMM_WORLD_RANK": "0"}


def test_the_ranks_of_train_py_run_by_mpirun_as_one_task_get_none_of_its_task_variables(tmp_path, monkeypatch):
    """`mpirun -n 1 python train.py`: mpirun's rank 0 of 1 reached every rank DeepSpeed's launcher started, and
    DeepSpeed's engine asserts LOCAL_RANK == OMPI_COMM_WORLD_LOCAL_RANK, so each rank of local rank 1 or more failed
    in deepspeed.initialize. The job's own variables stay (a nested srun finds its allocation through them)."""
    from types import SimpleNamespace

    from deepspeed.runtime.engine import DeepSpeedEngine

    for name, value in {**MPIRUN_ONE_TASK, "SLURM_JOB_ID": "7"}.items():
        monkeypatch.setenv(name, value)
    env = _launch_env(PipelineConfig(output_dir=tmp_path / "out"), Launcher(DeploymentType.SINGLE_NODE, num_gpus=2))
    assert not set(MPIRUN_ONE_TASK) & set(env) and env["SLURM_JOB_ID"] == "7"
    monkeypatch.setattr(os, "environ", {**env, "LOCAL_RANK": "1"})  # as the launcher starts the second rank
    engine = SimpleNamespace()
    DeepSpeedEngine._configure_with_arguments(engine, SimpleNamespace(), None)
    assert engine.local_rank == 1


def test_train_py_run_by_srun_in_every_task_ends_before_planning(tmp_path):
    """The whole train.py, in a process with srun's variables for one of 16 tasks: it ends with the error alone."""
    argv = [sys.executable, "train.py", "--deployment-type", "cpu", "--output-dir", str(tmp_path / "out")]
    result = subprocess.run(argv, cwd=REPO_ROOT, env={**os.environ, **SRUN_STEP}, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: train.py was started by srun as rank 3 of 16 processes (SLURM_STEP_NUM_TASKS=16)")
    assert not (tmp_path / "out").exists()


def test_a_cuda_visible_devices_sent_to_other_nodes_by_intel_mpi_is_said(tmp_path, monkeypatch, capsys):
    """Hydra's mpirun (MPICH, Intel MPI) passes this machine's environment to every rank: a CUDA_VISIBLE_DEVICES set
    here for this machine's GPUs restricted the ranks on other nodes to the same indices, unsaid. Not said for a
    hostfile of this machine alone, whose ranks it is meant for."""
    from training.pipeline.cli import run

    monkeypatch.setenv("PATH", f"{stand_ins(tmp_path, mpirun='')}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    argv = ["--step", "1", "--output-dir", str(tmp_path / "out"), "--dry-run", "--deployment-type", "multi_node",
            "--launcher", "impi"]
    run([*argv, "--hostfile", hostfile(tmp_path, "localhost slots=2\nworker-2 slots=2\n")])
    assert ("multi_node --launcher impi: CUDA_VISIBLE_DEVICES=2,3 is this machine's, and mpirun passes this "
            "environment to the ranks on every node: those on worker-2 see only its GPUs 2,3 too") in \
        capsys.readouterr().err
    run([*argv, "--hostfile", hostfile(tmp_path, "localhost slots=2\n")])
    assert "CUDA_VISIBLE_DEVICES" not in capsys.readouterr().err
