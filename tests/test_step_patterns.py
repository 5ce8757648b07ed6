"""Collectives match in every step pattern, with uneven data per rank.

Each pattern runs on 2 ranks with 4 and 6 batches and is compared with one
process that replays the same steps on the rows of the ranks that still had
data: a rank that ran out must take part in the others' reductions with
neutral values (and not bias the average), however many reductions a step makes.
"""

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


_RUNS = {}


@pytest.fixture
def runs(mpirun, python_run):
    """The two-rank job and the one-process replay, run once for this module's tests."""
    if not _RUNS:
        _RUNS["job"] = mpirun("patterns.py", n=2, timeout=300)
        _RUNS["reference"] = python_run("patterns.py", ["--reference"])
    return _RUNS["job"], _RUNS["reference"]


@pytest.mark.parametrize("pattern", ["gan", "fits_in_a_row", "folds", "two_models"])
def test_uneven_ranks_train_like_one_process_replaying_their_steps(runs, pattern):
    job, reference = runs
    assert job.rank(0)[pattern] == job.rank(1)[pattern], "ranks must end identical"
    np.testing.assert_allclose(job.rank(0)[pattern], reference[pattern], atol=1e-5, rtol=0)


def test_a_gan_counts_every_update_of_the_rank_with_most_data(runs):
    job, _ = runs
    # 6 batches x 2 epochs: one discriminator and two generator updates per batch.
    assert job.rank(0)["gan_updates"] == job.rank(1)["gan_updates"] == [12, 24]


def test_optimizers_of_finished_folds_are_released(runs):
    job, _ = runs
    assert job.rank(0)["fold_optimizers_alive"] == 0


def test_many_fit_calls_keep_memory_and_reducers_flat(mpirun):
    # benchmarks/lifetime.py runs the same loop 1,000 times.
    job = mpirun("lifetime.py", n=2, args=[60], timeout=240)
    for rank in (0, 1):
        got = job.rank(rank)
        assert got["reducers"] == 1 and got["plans"] == 1
        assert got["iterations"] == 60 * 2, "rank 0 copies the state of rank 1, which has 2 batches"
        # Resident memory over many calls is benchmarks/lifetime.py's measurement.
