"""The shipped examples run and learn, on one process and on two."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGY_EXAMPLE = os.path.join(ROOT, "examples", "strategy_quickstart.py")

pytest.importorskip("sklearn")


def _accuracy(output):
    found = re.findall(r"test accuracy ([0-9.]+)", output)
    assert len(found) == 1, "exactly one process reports:\n" + output[-3000:]
    return float(found[0])


@pytest.mark.mpi
def test_strategy_example_under_mpiexec_uses_the_mpi_strategy(mpirun):
    job = mpirun(STRATEGY_EXAMPLE, n=2, args=["--epochs", 3], timeout=240)
    assert "MPIStrategy: 2 replica(s), global batch 64" in job.output
    assert _accuracy(job.output) > 0.85


def test_strategy_example_under_kdist_launch_uses_the_multi_worker_strategy(tf_launch):
    job = tf_launch(STRATEGY_EXAMPLE, n=2, args=["--epochs", 3], timeout=240)
    assert "MultiWorkerMirroredStrategy: 2 replica(s), global batch 64" in job.output
    assert _accuracy(job.output) > 0.85


PS_EXAMPLE = os.path.join(ROOT, "examples", "ps_quickstart.py")


@pytest.mark.mpi
def test_parameter_server_example_learns_and_saves_the_central_model(mpirun, tmp_path):
    saved = tmp_path / "digits.keras"
    job = mpirun(PS_EXAMPLE, n=4, args=["--mode", "gem", "--epochs", 4, "--save", saved],
                 timeout=240)
    assert "ParameterServerStrategy(gem): 3 worker(s)" in job.output
    assert "Epoch 4/4" in job.output
    assert _accuracy(job.output) > 0.85
    assert saved.exists()
