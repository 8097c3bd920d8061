"""The `elastic` command: `elastic train` with no arguments runs the embedded default end to
end; bad input is refused before any actor starts, with one line and exit code 2."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

pytestmark = pytest.mark.waits  # every test here runs `elastic` as a process of its own


def test_cli_default_runs_and_loss_falls(ray_head, tmp_path):
    # Join the session's Ray head through RAY_ADDRESS, as under `ray job submit`. The
    # embedded default in all but its length: its first 8 steps take the loss well past
    # the bound below (5.6 -> 3.8; the whole default reaches 1.0) in a fraction of the time.
    env = ray_head.driver_env()
    completed = subprocess.run(
        [sys.executable, "-m", "elastic", "train", "--quiet", "--steps", "8"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    [summary_path] = list(Path(tmp_path, "runs").glob("*/summary.json"))
    summary = json.loads(summary_path.read_text())
    assert summary["exit"] == "completed"
    topology = summary["topology"]
    assert topology["groups"] >= 2 and topology["shard"] >= 2 and topology["tp"] >= 2
    assert summary["steps_committed"] == summary["config"]["steps"] == len(summary["losses"])
    losses = summary["losses"]
    assert losses[-1] < losses[0] - 1.0
    for key in ("run", "config", "steps_discarded", "final_loss", "wall_s", "tokens_per_s", "goodput", "events"):
        assert key in summary
    # The ranks run in Ray's working directory, not the driver's: the default storage must
    # still put their checkpoint files next to the driver's manifest.
    final = Path(summary["last_checkpoint"])
    assert final.is_relative_to(tmp_path / "runs")
    assert (final / "manifest.json").exists() and (final / ".metadata").exists()


def test_a_rank_killed_on_the_way_shows_as_the_runs_own_line_and_rays_paragraph_goes_to_a_log_file(
        ray_cluster, ray_head, tmp_path):
    from elastic.fleet.ray_messages import LOG_NAME

    env = ray_head.driver_env()
    completed = subprocess.run(
        [sys.executable, "-m", "elastic", "train", "--quiet", "--steps", "6", "--groups", "2", "--shard", "1",
         "--tp", "1", "--checkpoint-every", "0", "--inject", "kill:rank=1,step=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    console = completed.stdout + completed.stderr
    assert completed.returncode == 0, console[-3000:]
    assert "rank 1 of group 1 replaced (death)" in console
    assert "A worker died" not in console and "OOM" not in console, console
    logs = Path(ray_cluster._private.worker._global_node.get_logs_dir_path())
    assert "A worker died or was killed" in (logs / LOG_NAME).read_text()


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_with_the_output_piped_into_a_reader_that_stopped_too_is_a_preemption(ray_head, tmp_path, presses):
    """`elastic train ... 2>&1 | tee log`, then Ctrl-C: tee stops with it, and every later
    write of the driver's finds the pipe broken. The run still stops at a step boundary with
    a checkpoint, and says so: preempted, exit 143. Pressed twice, it stops at once, and says
    that too."""
    from elastic.testing.loopback import wait_for

    env = ray_head.driver_env()
    # Pressed twice, the second press must land before the first stop reaches its step
    # boundary: step 5 does not end while the test runs (a slowdown of minutes, and a
    # deadline past the test's end). Step 5's checkpoint starts at the boundary before it and
    # commits only as the driver watches the segment that begins with it, so the first press
    # always finds the run inside step 5. (With the slow step later, the commit could come at
    # a boundary, and the first press stop the run there before the second.)
    slow_steps = ["--inject", "slow:rank=0,factor=100000,step=5", "--set", "fault_tolerance.min_deadline_s=300"]
    driver = subprocess.Popen(
        [sys.executable, "-m", "elastic", "train", "--run-name", "piped", "--steps", "2000", "--groups", "1",
         "--shard", "1", "--tp", "1", "--checkpoint-every", "5", *(slow_steps if presses == 2 else [])],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        run = tmp_path / "runs" / "piped"
        wait_for(lambda: (run / "checkpoints" / "step-00000005" / "manifest.json").exists(), 240, "a checkpoint")
        driver.stdout.close()  # the reader is gone
        for _ in range(presses):
            driver.send_signal(signal.SIGINT)
            time.sleep(0.5)
        assert driver.wait(120) == 143
    finally:
        driver.kill()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit"].startswith("preempted" if presses == 1 else "preempted: a second SIGINT stopped the run at once")
    assert summary["last_checkpoint"] or presses == 2
    if presses == 2:  # the step it resumes from, which it knows: step 5's committed before the presses
        assert re.search(r"it resumes from its checkpoint of step 5$", summary["exit"]), summary["exit"]
        assert summary["steps_committed"] == 5  # stopped inside the slow step, not at its boundary


def test_sigterm_before_the_trainer_takes_the_signals_over_ends_preempted_with_a_summary(tmp_path):
    """A SIGTERM in the command's first seconds (here: as it reads the config, before torch
    and Ray import) ends the run preempted, exit 143, its summary written, and starts no Ray."""
    signalled_while_reading = (
        "import os, signal, sys\n"
        "import elastic.setup.preflight as preflight\n"
        "read = preflight.load_config\n"
        "def load_config(*args):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return read(*args)\n"
        "preflight.load_config = load_config\n"
        "from elastic.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    completed = subprocess.run([sys.executable, "-c", signalled_while_reading, "train", "--run-name", "early",
                                "--steps", "3", "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 143, completed.stderr[-2000:]
    summary = json.loads((tmp_path / "runs" / "early" / "summary.json").read_text())
    assert summary["exit"] == "preempted: a stop signal before Ray started, before any step"
    assert [e["signal"] for e in summary["events"] if e["kind"] == "stop-requested"] == ["SIGTERM"]
    assert "Ray" not in completed.stderr and summary["steps_committed"] == 0


# `elastic` in a process where Ray cannot even be imported: these inputs must be refused
# before any actor starts, and a check that slipped past that would fail here, not start Ray.
WITHOUT_RAY = "import sys; sys.modules['ray'] = None; from elastic.cli import main; sys.exit(main(sys.argv[1:]))"


def elastic(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_RAY, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def refusal(completed: subprocess.CompletedProcess) -> str:
    """The one line an input refused before the run starts gives, checked for its form."""
    assert completed.returncode == 2, completed.stderr
    assert "Traceback" not in completed.stderr
    [line] = completed.stderr.splitlines()
    assert line.startswith("elastic: ") and not completed.stdout
    return line


def test_a_fault_on_a_rank_beyond_the_layout_is_refused(tmp_path):
    line = refusal(elastic("train", "--inject", "kill:rank=99,step=1", cwd=tmp_path))
    assert "fault_tolerance.inject: rank=99" in line and "from 0 to 7" in line, line


def test_a_yaml_config_that_is_a_list_is_refused(tmp_path):
    (tmp_path / "job.yaml").write_text("- steps: 5\n- seed: 1\n")
    line = refusal(elastic("train", "--config", "job.yaml", cwd=tmp_path))
    assert "--config: job.yaml holds a list at its top level" in line, line


def test_a_config_that_is_not_utf8_is_refused(tmp_path):
    (tmp_path / "job.toml").write_bytes("steps = 5\n# caf\xe9\n".encode("latin-1"))
    line = refusal(elastic("train", "--config", "job.toml", cwd=tmp_path))
    assert "--config: job.toml is not UTF-8" in line and "save it as UTF-8" in line, line


def test_storage_of_an_unknown_protocol_is_refused(tmp_path):
    line = refusal(elastic("train", "--storage", "foo://bar", cwd=tmp_path))
    assert "storage: unknown protocol 'foo'" in line, line


def test_storage_that_cannot_be_created_is_refused(tmp_path):
    line = refusal(elastic("train", "--storage", "/proc/1/runs", cwd=tmp_path))
    assert "storage: cannot create or write /proc/1/runs" in line, line


def test_a_prepare_output_that_cannot_be_written_is_refused(tmp_path):
    (tmp_path / "in.txt").write_text("hello\n")
    line = refusal(elastic("prepare", "in.txt", "--output", "/proc/x.bin", cwd=tmp_path))
    assert "output '/proc/x.bin': cannot write there" in line, line


PRESIGNED = ("https://127.0.0.1:9/bucket/x.txt?X-Amz-Algorithm=AWS4-HMAC-SHA256"
             "&X-Amz-Credential=AKIAEXAMPLEKEY%2F20240101%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20240101T000000Z"
             "&X-Amz-Expires=3600&X-Amz-Security-Token=SESSIONTOKEN&X-Amz-Signature=0123abcd&X-Amz-SignedHeaders=host")


@pytest.mark.parametrize("url,secrets", [
    # port 9 refuses the connection at once: the data check fails without a network
    ("https://alice:hunter2@127.0.0.1:9/x.txt", ["alice", "hunter2"]),
    (PRESIGNED, ["AKIAEXAMPLEKEY", "SESSIONTOKEN", "0123abcd"]),
])
def test_credentials_in_a_data_url_are_never_printed(tmp_path, url, secrets):
    completed = elastic("train", "--data", url, cwd=tmp_path)
    line = refusal(completed)
    assert "data.path" in line and "***" in line, line
    for secret in secrets:
        assert secret not in completed.stdout + completed.stderr


def test_storage_the_system_refuses_and_a_busy_metrics_port_are_one_line_before_ray(tmp_path):
    import socket

    line = refusal(elastic("train", "--storage", "/proc/elastic-runs", cwd=tmp_path))
    assert "storage: cannot create or write /proc/elastic-runs" in line, line
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refusal(elastic("train", "--metrics-port", str(port), cwd=tmp_path))
    assert f"metrics: cannot listen on 127.0.0.1:{port} (Address already in use)" in line, line
    line = refusal(elastic("train", "--metrics-host", "no-such-host.invalid", "--metrics-port", "0", cwd=tmp_path))
    assert "metrics: cannot listen on no-such-host.invalid:0" in line, line


@pytest.mark.parametrize("command,names", [
    (["train", "--storage", "s3://AKIALEAKME:LEAKEDSECRET@bkt/runs"], "storage"),
    (["train", "--data", "s3://AKIALEAKME:LEAKEDSECRET@bkt/x.bin"], "data.path"),
    # a run in a bucket: before the check, boto took the secret for the bucket's name and said so
    (["train", "--init-from", "s3://AKIALEAKME:LEAKEDSECRET@bkt/run@3"], "model.init_from"),
    (["export", "s3://AKIALEAKME:LEAKEDSECRET@bkt/run", "--output", "out"], "RUN"),
    (["prepare", "s3://AKIALEAKME:LEAKEDSECRET@bkt/x.txt", "--output", "x.bin"], "TEXT"),
    (["prepare", "in.txt", "--output", "s3://AKIALEAKME:LEAKEDSECRET@bkt/x.bin"], "--output"),
    (["report", "s3://AKIALEAKME:LEAKEDSECRET@bkt/run"], "RUN"),
])
def test_credentials_in_any_url_are_refused_naming_it_and_never_printed(tmp_path, command, names):
    completed = elastic(*command, cwd=tmp_path)
    line = refusal(completed)
    assert line.startswith(f"elastic: invalid config: {names}: " if "." in names or names == "storage"
                           else f"elastic: {names}: "), line
    assert "a URL with credentials in it" in line and "through the environment" in line, line
    assert "AKIALEAKME" not in completed.stderr and "LEAKEDSECRET" not in completed.stderr


@pytest.mark.parametrize("name,make,says", [
    ("empty.bin", lambda path: path.write_bytes(b""), "holds 0 tokens, fewer than one sample"),
    ("three.txt", lambda path: path.write_bytes(b"abc"), "holds 3 tokens, fewer than one sample"),
    ("fifo.bin", lambda path: os.mkfifo(path), "is not a regular file"),
])
def test_data_too_small_or_not_a_file_is_one_line_and_exit_2(tmp_path, name, make, says):
    make(tmp_path / name)
    line = refusal(elastic("train", "--data", name, cwd=tmp_path))
    assert "data.path" in line and says in line, line


def saved_dataset(directory: Path) -> tuple[list[str], list[Path]]:
    """A HuggingFace save_to_disk directory; ``--data`` naming it, and its state.json and Arrow file."""
    import datasets

    datasets.Dataset.from_dict({"text": [f"document {i}" for i in range(200)]}).save_to_disk(str(directory))
    [arrow] = [entry["filename"] for entry in json.loads((directory / "state.json").read_text())["_data_files"]]
    return ["--data", str(directory)], [directory / "state.json", directory / arrow]


def megatron_pair(directory: Path) -> tuple[list[str], list[Path]]:
    from elastic.testing.megatron import write_megatron_pair

    directory.mkdir()
    write_megatron_pair(directory / "corpus", [list(range(9))] * 30, "uint16")
    return ["--data", str(directory / "corpus")], [directory / "corpus.idx"]


def huggingface_model(directory: Path, sharded: bool) -> tuple[list[str], list[Path]]:
    from checkpointing.huggingface import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME
    from tests.test_pretrained import write_checkpoint

    write_checkpoint(directory, sharded=sharded)
    return ["--init-from", str(directory)], [directory / name for name in
                                             ((CONFIG_NAME, INDEX_NAME) if sharded else (WEIGHTS_NAME,))]


def config_file(directory: Path) -> tuple[list[str], list[Path]]:
    directory.mkdir()
    (directory / "run.toml").write_text("steps = 3\n")
    return ["--config", str(directory / "run.toml")], [directory / "run.toml"]


# The run's address space, capped: a read of /dev/zero that slipped past the check ends in a
# MemoryError, not in the test machine's memory taken first.
WITHIN_8_GIB = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30)); "
                "from elastic.cli import main; sys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("make", [saved_dataset, megatron_pair, config_file, partial(huggingface_model, sharded=False),
                                  partial(huggingface_model, sharded=True)],
                         ids=["save_to_disk", "megatron", "config", "safetensors", "sharded-safetensors"])
def test_a_fifo_or_a_device_for_any_file_a_run_reads_is_refused_in_one_line_naming_it(tmp_path, make):
    """Each file of the data, of ``--init-from`` and the config is opened only once it is known
    to be a regular file: a FIFO would block the run forever, a link to /dev/zero fill memory.
    Every file as a FIFO, and the first as a link to /dev/zero too (one check serves both: a
    CLI process for each of them all took the suite a minute and a half)."""
    args, files = make(tmp_path / "source")
    for file, special in [(file, "fifo") for file in files] + [(files[0], "/dev/zero")]:  # one at a time
        content = file.read_bytes()
        file.unlink()
        os.mkfifo(file) if special == "fifo" else file.symlink_to("/dev/zero")
        completed = subprocess.run([sys.executable, "-c", WITHIN_8_GIB, "train", *args], cwd=tmp_path,
                                   capture_output=True, text=True, timeout=120)
        line = refusal(completed)
        assert f"{file} is not a regular file" in line, line
        file.unlink()
        file.write_bytes(content)


@pytest.mark.parametrize("storage", [[], ["--storage", "runs"]], ids=["default", "relative"])
def test_a_storage_in_rays_runtime_directory_is_refused_naming_storage(tmp_path, storage):
    """Where ``ray job submit --working-dir`` starts the driver: the job's files as Ray unpacked
    them, which it deletes, and a job submitted again gets a package of its own."""
    package = tmp_path / "ray" / "session_2026-01-01_00-00-00_1_1" / "runtime_resources" / "working_dir_files" / \
        "_ray_pkg_0123456789abcdef"
    package.mkdir(parents=True)
    line = refusal(elastic("train", *storage, cwd=package))
    assert line.startswith(f"elastic: invalid config: storage: {package / 'runs'} is in Ray's runtime directory"), line
    assert "give --storage an absolute path outside it" in line and "--run-name" in line, line


def with_namesakes(directory: Path) -> Path:
    """``directory`` holding a package named like each of the trainer's, which fails to import."""
    for name in ("checkpointing", "elastic", "workers"):
        (directory / name).mkdir()
        (directory / name / "__init__.py").write_text(f"raise ImportError('the working directory\\'s {name}')\n")
    return directory


def local_run(directory: Path, driver: str = "from elastic.cli import main") -> subprocess.CompletedProcess:
    """``elastic train`` in ``directory`` on a Ray it starts itself, whose workers Ray gives that
    directory first on their path. The driver imports the installed packages (-P: the working
    directory is not on its own path), as the ``elastic`` command does."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-P", "-c", f"import sys; {driver}; sys.exit(main(sys.argv[1:]))", "train",
                           "--steps", "2", "--groups", "1", "--shard", "2", "--tp", "1", "--checkpoint-every", "0",
                           "--run-name", "namesakes"], cwd=directory, env=env, capture_output=True, text=True,
                          timeout=300)


def test_ranks_import_the_installed_packages_where_the_working_directory_holds_namesakes(tmp_path):
    completed = local_run(with_namesakes(tmp_path))
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "namesakes" / "summary.json").read_text())
    assert summary["exit"] == "completed" and summary["steps_committed"] == 2
    assert not [event for event in summary["events"] if event["kind"] == "group-start-failed"]


def test_ranks_that_cannot_import_the_trainer_stop_the_run_in_one_line_naming_the_cause(tmp_path):
    """Without the installed packages imported first, the ranks import the namesakes and fail as
    their processes start: an error a fresh process raises again, not a death to replace."""
    unguarded = "import elastic.fleet.ray_connection as connection; connection.installed_packages_first = dict"
    completed = local_run(with_namesakes(tmp_path), driver=f"{unguarded}; from elastic.cli import main")
    assert completed.returncode == 1, completed.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "namesakes" / "summary.json").read_text())
    assert summary["exit"] == ("stopped: groups [0] failed to start: ranks [0, 1] raised the same error: its process "
                               "could not start the rank's code: ImportError: the working directory's workers (the "
                               "code or the data, not the cluster; fix it and resume)"), summary["exit"]
    assert not [event for event in summary["events"] if event["kind"] == "rank-evicted"]


def test_an_unreadable_lease_record_is_one_line_naming_it_and_break_lease_needs_the_run(tmp_path):
    from checkpointing.lease import RunLease
    from checkpointing.storage import StorageOptions

    RunLease(str(tmp_path / "runs" / "r1"), StorageOptions(), 60.0).acquire()
    [record] = (tmp_path / "runs" / "r1" / "lease").iterdir()
    record.write_text("")  # what a crash mid-write left before records were written whole
    completed = subprocess.run([sys.executable, "-m", "elastic", "train", "--storage", str(tmp_path / "runs"),
                                "--run-name", "r1"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 1 and "Traceback" not in completed.stderr
    [line] = [line for line in completed.stderr.splitlines() if line.startswith("elastic: ")]
    assert str(record) in line and "--break-lease" in line, line
    line = refusal(elastic("train", "--break-lease", "--storage", str(tmp_path / "runs"), cwd=tmp_path))
    assert "--break-lease: name the run" in line and "--run-name" in line


def test_any_config_field_is_settable_with_set_and_wins_over_the_file(tmp_path):
    from elastic.cli import build_parser, train_overrides
    from elastic.setup.preflight import load_config

    (tmp_path / "run.toml").write_text('[data]\nseq_len = 32\n')
    args = build_parser().parse_args([
        "train", "--config", str(tmp_path / "run.toml"), "--set", "data.seq_len=128", "--set", "optimizer.beta2=0.99",
        "--set", "data.validation_fraction=0.1", "--set", "compute.compile=true", "--set", "run_name=nightly-7",
    ])
    config = load_config(args.config, train_overrides(args))
    assert (config.data.seq_len, config.optimizer.beta2, config.data.validation_fraction) == (128, 0.99, 0.1)
    assert config.compute.compile is True and config.run_name == "nightly-7"
    line = refusal(elastic("train", "--set", "data.seq_lenn=64", cwd=tmp_path))
    assert "seq_lenn" in line, line


def test_abbreviated_flags_are_refused_not_guessed(tmp_path):
    completed = elastic("train", "--step", "5", cwd=tmp_path)
    assert completed.returncode == 2 and "unrecognized arguments: --step 5" in completed.stderr
    from elastic.cli import build_parser

    assert build_parser().parse_args(["report", "runs/r1", "-o", "t.png"]).output == "t.png"


def test_the_cli_keeps_the_metrics_endpoint_up_for_linger_s_after_the_run(capsys):
    from elastic.cli import linger_for_scrapes

    served = [{"kind": "run-started"}, {"kind": "metrics-serving", "address": "127.0.0.1:9400"}]
    slept = []
    linger_for_scrapes(served, 600.0, sleep=slept.append)
    assert slept == [600.0]
    assert "metrics stay up at http://127.0.0.1:9400/metrics for 600 s" in capsys.readouterr().out
    linger_for_scrapes(served, 0.0, sleep=slept.append)  # the default: the process ends with the run
    linger_for_scrapes(served[:1], 600.0, sleep=slept.append)  # nothing served: nothing to keep up
    assert slept == [600.0]

    def interrupted(seconds):
        raise KeyboardInterrupt

    linger_for_scrapes(served, 600.0, sleep=interrupted)  # Ctrl-C ends the wait, not with a traceback


def test_the_commands_do_not_show_torchaos_warnings_of_gpu_kernels_a_cpu_machine_lacks():
    """transformers' models import torchao, which warns of each CUDA kernel library it cannot
    load here; the commands' logging keeps that out of what the user sees."""
    pytest.importorskip("torchao")
    shown = subprocess.run([sys.executable, "-c", "from elastic.cli import configure_logging\n"
                            "configure_logging()\nimport torchao"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "Failed to load" not in shown.stderr and "_pytree" not in shown.stderr, shown.stderr


def test_the_progress_bar_shows_the_step_committed_not_a_count_of_commits():
    """A rollback commits its steps again: the bar goes back with them, never past the run's
    steps (it said 27 steps of a 20-step run)."""
    from types import SimpleNamespace

    from elastic.outputs.progress import ProgressBar

    with ProgressBar(20, enabled=True) as bar:
        bar.skip_to(4)  # resumed from the checkpoint of step 4
        assert bar.bar.n == 4
        for step in [*range(4, 12), *range(8, 20)]:  # a fault at step 12, back to the state after step 7
            bar.update(SimpleNamespace(step=step, loss=1.0, tokens_per_s=1.0, live_ranks=2))
            assert bar.bar.n == step + 1
