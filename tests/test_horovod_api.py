"""Horovod's Keras surface: a Horovod script runs unchanged and each name does its job."""

import numpy as np
import pytest


@pytest.mark.mpi
def test_a_horovod_script_runs_with_only_the_import_changed(mpirun):
    job = mpirun("horovod_script.py", n=2)
    rank0, rank1 = job.rank(0), job.rank(1)
    assert rank0["weights_sum"] == rank1["weights_sum"]
    assert rank0["size"] == 2 and {rank0["local_rank"], rank1["local_rank"]} == {0, 1}
    # Epoch 1 ends at its last batch, 7/8 into the ramp from 0.01 to 0.02; warm-up
    # reaches 0.02 at the end of epoch 2; the schedule then halves it.
    ramp = 0.02 * (1 + (7 / 8) * (2 - 1) / 2) / 2
    assert np.allclose(rank0["lr"], [ramp, 0.02, 0.01], rtol=1e-5)
    assert rank0["accuracy"] == rank1["accuracy"]
    assert "finished warming up" in job.output
    # The rest of Horovod's top-level names, called as in Horovod, across 2 ranks.
    values = np.array([[1.0, 10.0], [2.0, 20.0]])
    for rank in (0, 1):
        api = job.rank(rank)["api"]
        assert api["average"] == values.mean(0).tolist() and api["sum"] == values.sum(0).tolist()
        assert api["min"] == values.min(0).tolist() and api["max"] == values.max(0).tolist()
        assert api["allgather"] == [[0, 0], [1, 1], [1, 1]]
        assert api["broadcast"] == values[1].tolist()
        assert api["broadcast_variables"] == [1.0, 1.0, 1.0]
        assert api["cross"] == [0, 1] and api["local_size"] == 2
        assert api["threads"] == api["threads_expected"]
        assert api["join"] in (0, 1) and api["join"] == job.rank(1 - rank)["api"]["join"]
        assert api["after_shutdown"] is False and api["reinit_sum"] == [2.0]
