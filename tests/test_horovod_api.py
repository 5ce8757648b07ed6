"""Horovod's Keras surface: the names exist and a Horovod script runs unchanged."""

import numpy as np
import pytest

import kdist

HOROVOD_NAMES = [
    "init", "shutdown", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "allreduce", "allgather", "broadcast", "broadcast_variables", "join", "Compression",
    "DistributedOptimizer", "Average", "Sum", "Min", "Max", "mpi_threads_supported",
]
HOROVOD_CALLBACKS = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
                     "LearningRateWarmupCallback", "LearningRateScheduleCallback"]


def test_horovod_keras_names_are_at_the_top_level():
    missing = [n for n in HOROVOD_NAMES if not hasattr(kdist, n)]
    missing += [f"callbacks.{n}" for n in HOROVOD_CALLBACKS if not hasattr(kdist.callbacks, n)]
    assert not missing
    assert kdist.Compression.none.name == "none" and kdist.Compression.fp16.name == "fp16"


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
