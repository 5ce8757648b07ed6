"""`kdist launch`: local TensorFlow workers with TF_CONFIG, or MPI ranks."""

import io
import json
import os
import subprocess
import sys
import time

import pytest

from kdist.distribute.launch import free_ports, launch_tf, tf_config

WORKER_SAYS_HELLO = """\
import json, os, sys
config = json.loads(os.environ["TF_CONFIG"])
print("hello from", config["task"]["index"], "of", len(config["cluster"]["worker"]))
print("argv", sys.argv[1:])
"""

# Worker 1 fails once worker 0 is certainly up; worker 0 would sleep forever.
WORKER_ONE_FAILS = """\
import json, os, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
with open(os.path.join(sys.argv[1], f"pid-{index}"), "w") as f:
    f.write(str(os.getpid()))
print("worker", index, "up", flush=True)
if index == 1:
    while not os.path.exists(os.path.join(sys.argv[1], "pid-0")):
        time.sleep(0.05)
    raise RuntimeError("worker 1 gives up")
time.sleep(3600)
"""


def kdist_launch(*args, timeout=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "TF_CONFIG"))}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return subprocess.run([sys.executable, "-m", "kdist.cli", "launch", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_tf_config_and_free_ports():
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports)
    config = json.loads(tf_config(["h:1", "h:2"], 1))
    assert config == {"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 1}}
    with pytest.raises(ValueError, match="outside a cluster of 2"):
        tf_config(["h:1", "h:2"], 2)
    with pytest.raises(ValueError, match="at least 1"):
        launch_tf(0, [sys.executable, "-c", "pass"])


@pytest.mark.timeout(120)
def test_launch_runs_workers_with_prefixed_output(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(WORKER_SAYS_HELLO)
    done = kdist_launch("-n", "2", str(script), "--lr", "0.1")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "[0] hello from 0 of 2" in lines and "[1] hello from 1 of 2" in lines
    assert "[1] argv ['--lr', '0.1']" in lines


def test_launch_tf_in_process_keeps_lines_whole_and_passes_exit_codes():
    out = io.BytesIO()
    code = "import sys; [print('line', i) for i in range(200)]; sys.exit(0)"
    assert launch_tf(2, [sys.executable, "-c", code], out=out) == 0
    lines = out.getvalue().decode().splitlines()
    assert sorted(lines) == sorted(f"[{w}] line {i}" for w in (0, 1) for i in range(200))
    assert launch_tf(1, [sys.executable, "-c", "raise SystemExit(7)"], out=io.BytesIO()) == 7


@pytest.mark.timeout(120)
def test_one_failing_worker_stops_the_others(tmp_path):
    script = tmp_path / "one_fails.py"
    script.write_text(WORKER_ONE_FAILS)
    done = kdist_launch("-n", "2", str(script), str(tmp_path), timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "[1] Traceback (most recent call last):" in done.stdout
    assert "[1] RuntimeError: worker 1 gives up" in done.stdout
    assert "[0] worker 0 up" in done.stdout
    pid = int((tmp_path / "pid-0").read_text())
    assert not alive(pid), "worker 0 must be stopped when worker 1 fails"


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_mpi_backend_is_kdist_run(mpiexec_path):
    done = kdist_launch("-n", "2", "--backend", "mpi", "--", sys.executable, "-c",
                        "import os; print('rank', os.environ['OMPI_COMM_WORLD_RANK'])")
    assert done.returncode == 0, done.stdout + done.stderr
    # As under kdist run: rank 0 untagged, the others tagged.
    assert "rank 0" in done.stdout.splitlines() and "[1] rank 1" in done.stdout


def test_bad_arguments_are_explained(tmp_path):
    done = kdist_launch("-n", "0", "train.py")
    assert done.returncode != 0 and "-n must be at least 1; got 0" in done.stderr
    done = kdist_launch("-n", "2", "no_such_script.py")
    assert done.returncode != 0 and "kdist launch: no such script" in done.stderr
    done = kdist_launch("-n", "2", "--mpi-args", "--bind-to none", "--", "true")
    assert done.returncode != 0 and "only applies to --backend mpi" in done.stderr
