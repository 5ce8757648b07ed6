"""Parameter-server training under real mpiexec: modes, sub-masters, resume, failures."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import HERE, WORKERS

pytestmark = pytest.mark.mpi

SCRIPT = "ps_train.py"
# Per-mode settings under which each algorithm is expected to match plain SGD
# in the same number of epochs. EASGD averages models, so like synchronous
# training its workers need a learning rate scaled with their number.
MODES = {
    "downpour": [],
    "gem": [],
    "easgd": ["--lr", "0.15", "--sync-every", "4"],
}


@pytest.fixture(scope="module")
def sgd_accuracy(tmp_path_factory):
    """Validation accuracy of single-process SGD on the same task and epochs."""
    reports = tmp_path_factory.mktemp("baseline")
    env = dict(os.environ, KDIST_TEST_REPORTS=str(reports), PYTHONPATH=HERE,
               TF_CPP_MIN_LOG_LEVEL="3")
    subprocess.run([sys.executable, os.path.join(WORKERS, SCRIPT), "downpour", "--baseline"],
                   env=env, check=True, timeout=120, capture_output=True)
    with open(reports / "rank-0.json") as f:
        return json.load(f)["val_accuracy"]


def _same_weights_everywhere(job, n):
    assert sorted(job.results) == list(range(n)), job.output[-3000:]
    reference = np.array(job.results[0]["weights"])
    for rank in range(1, n):
        np.testing.assert_array_equal(np.array(job.results[rank]["weights"]), reference,
                                      err_msg=f"rank {rank} ended with other weights")


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_learns_as_well_as_sgd_and_ends_with_one_model(mpirun, sgd_accuracy, mode):
    job = mpirun(SCRIPT, n=4, args=[mode] + MODES[mode], timeout=240)
    _same_weights_everywhere(job, 4)
    master = job.results[0]
    assert master["val_accuracy"] >= sgd_accuracy - 0.02, (mode, master, sgd_accuracy)
    history = master["history"]
    assert len(history["val_accuracy"]) == 6 and len(history["loss"]) == 6
    # Training metrics come from the workers, validation from the central model.
    assert history["loss"][-1] < history["loss"][0]
    assert master["stats"]["updates"] > 0
    assert "Epoch 6/6" in job.output and "staleness" in job.output


def test_submasters_aggregate_for_their_workers(mpirun, sgd_accuracy):
    job = mpirun(SCRIPT, n=5, args=["downpour", "--submasters", 1], timeout=240)
    _same_weights_everywhere(job, 5)
    assert job.results[0]["val_accuracy"] >= sgd_accuracy - 0.02
    # The sub-master serves 3 workers and reports up once per round of them.
    master, sub = job.results[0]["stats"], job.results[1]["stats"]
    assert sub["updates"] > 500
    assert master["updates"] < sub["updates"] / 2
    assert job.results[2]["stats"] is None  # a worker


def test_a_model_of_two_halves_with_two_optimizers_exchanges_both(mpirun):
    job = mpirun("ps_two_models.py", n=3, timeout=180)
    assert sorted(job.results) == [0, 1, 2]
    first, second = job.results[0]["first"], job.results[0]["second"]
    for rank in (1, 2):
        assert job.results[rank]["first"] == first and job.results[rank]["second"] == second
    # 4-8-1 and 1-1 dense layers: 49 + 2 values, and no optimizer slots.
    assert job.results[0]["exchanged"] == 51
    assert all(moved > 0 for moved in job.results[0]["moved"])
    history = job.results[0]["history"]
    assert history["first_loss"][-1] < history["first_loss"][0]


def test_early_stopping_on_the_master_stops_every_rank(mpirun, tmp_path):
    job = mpirun(SCRIPT, n=4, args=["downpour", "--early-stopping", "--logs", tmp_path],
                 timeout=240)
    _same_weights_everywhere(job, 4)
    assert job.results[0]["epochs"] == [0, 1]
    assert "Stopping every worker after epoch 2" in job.output
    # The master's CSVLogger saw both epochs, with the central validation metrics,
    # and TensorBoard wrote event files for training and validation.
    rows = (tmp_path / "log.csv").read_text().strip().splitlines()
    assert len(rows) == 3 and "val_accuracy" in rows[0] and "loss" in rows[0]
    for part in ("train", "validation"):
        events = os.listdir(tmp_path / "tensorboard" / part)
        assert any(name.startswith("events.out") for name in events), events


def test_a_crashed_run_resumes_from_the_master_checkpoint(mpirun, tmp_path):
    directory = tmp_path / "ps"
    args = ["gem", "--checkpoint", directory]
    crashed = mpirun(SCRIPT, n=4, args=args + ["--stop-after", 3], timeout=240, check=False)
    assert crashed.returncode != 0
    assert "stopping after epoch 3 on purpose" in crashed.output
    assert (directory / "master.npz").exists()
    resumed = mpirun(SCRIPT, n=4, args=args, timeout=240)
    assert "Resuming from" in resumed.output
    _same_weights_everywhere(resumed, 4)
    master = resumed.results[0]
    # Epochs 1-3 came from the checkpoint; this run trained 4-6.
    assert master["epochs"] == [0, 1, 2, 3, 4, 5]
    assert "Epoch 4/6" in resumed.output and "Epoch 1/6" not in resumed.output
    assert len(master["history"]["val_accuracy"]) == 6
    assert master["history"]["val_accuracy"][-1] > 0.9


def test_a_killed_worker_ends_the_job_quickly_naming_it(mpirun):
    started = time.monotonic()
    job = mpirun(SCRIPT, n=4, args=["downpour", "--die-on", 2], timeout=120, check=False)
    assert job.returncode != 0
    assert time.monotonic() - started < 60
    assert ",2]" in job.output or "rank 2" in job.output, job.output[-3000:]


def test_with_fault_tolerance_the_master_carries_on_without_a_dead_worker(mpirun):
    job = mpirun(SCRIPT, n=4, args=["downpour", "--die-on", 2, "--fault-tolerant"],
                 timeout=180, check=False, fault_tolerant=True)
    assert "Rank(s) [2] died; carrying on" in job.output, job.output[-3000:]
    assert "carried on without rank(s) [2]" in job.output
    assert sorted(job.results) == [0, 1, 3]
    reference = np.array(job.results[0]["weights"])
    for rank in (1, 3):
        np.testing.assert_array_equal(np.array(job.results[rank]["weights"]), reference)
    master = job.results[0]
    assert master["stats"]["lost"] == [2]
    assert len(master["history"]["val_accuracy"]) == 6
    assert master["val_accuracy"] > 0.9


def test_a_raising_worker_ends_the_job_with_its_error(mpirun):
    job = mpirun(SCRIPT, n=4, args=["downpour", "--raise-on", 1], timeout=120, check=False)
    assert job.returncode != 0
    assert "worker failed on purpose" in job.output
    assert "rank 1" in job.output
