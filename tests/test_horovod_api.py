"""Horovod's Keras surface: a Horovod script runs unchanged and each name does its job."""

import numpy as np
import pytest


@pytest.mark.mpi
def test_a_horovod_script_runs_with_only_the_import_changed(mpirun):
    job = mpirun("horovod_script.py", n=2)
    rank0, rank1 = job.rank(0), job.rank(1)
    assert rank0["weights_sum"] == rank1["weights_sum"]
    assert rank0["size"] == 2 and {rank0["local_rank"], rank1["local_rank"]} == {0, 1}
    # Each batch trains with the rate reached at its end: epoch 1's last batch halfway
    # up the ramp from 0.01 to 0.02, epoch 2's last at 0.02; the schedule then halves it.
    ramp = 0.02 * (1 + 1 * (2 - 1) / 2) / 2
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


@pytest.mark.mpi
def test_horovod_optimizer_callback_and_batch_norm_behaviours_on_two_ranks(mpirun):
    job = mpirun("horovod_api.py", n=2)
    ranks = [job.rank(0), job.rank(1)]
    for r, out in enumerate(ranks):
        # Rank r's gradient is r + 1; with op=Sum one reduction gives 3, two would give 6.
        assert out["once"] == {"apply_eager": -3.0, "apply_gradients_traced": -3.0,
                               "computed_gradient": 3.0, "compute_then_apply_eager": -3.0,
                               "compute_clip_apply_traced": -3.0, "fit": -3.0}
        # Two passes per update: nothing moves after the first, then the mean of the
        # ranks' sums (2 and 4); the third pass waits again.
        assert out["accumulated_trace"] == [0.0, -3.0, -3.0]
        assert out["accumulated_counter"] == 1

        own, mean = out["partial_local_tape"], out["partial_mean_tape"]
        scaled, unscaled = out["partial"]["True"], out["partial"]["False"]
        for layer in (0, 1):  # the shared layer's kernel and bias: averaged
            np.testing.assert_allclose(scaled[layer], mean[layer])
            np.testing.assert_allclose(unscaled[layer], mean[layer])
        for layer in (2, 3):  # the local layer: this rank's own gradient
            np.testing.assert_allclose(unscaled[layer], own[layer])
            np.testing.assert_allclose(scaled[layer], np.asarray(own[layer]) / 2)
        assert out["fit_local_error"] < 1e-6

        for as_dense, kind in (("False", "IndexedSlices"), ("True", "EagerTensor")):
            assert out["sparse"][as_dense]["kind"] == kind
            assert out["sparse"][as_dense]["table"] == [[-0.5, -0.5], [-1.0, -1.0], [0.0, 0.0],
                                                        [-1.5, -1.5]]
        assert out["sparse"]["False"]["rows"] == 4  # two rows from each rank

        assert out["grouped_gradients"] == [[1.5] * k for k in (1, 2, 3, 4)]
        assert out["grouped_buckets"] == [[2, 1, 1]]  # the group, then the others alone
        assert out["scaled_sums"] == [[4.5], [4]]
        assert out["predivided_gradient"] == 1.5
        assert out["predivide_factors"] == [0.25, 4.0]

        assert out["broadcast_local"] == [float(r), float(r)]
        assert out["broadcast_shared"] == [1.0, 1.0]  # root_rank 1's values

        bn = out["sync_bn"]
        assert bn.pop("local_statistics_differ") > 0.1
        assert max(bn.values()) < 1e-5, bn
    assert ranks[0]["fit_shared_kernel"] == ranks[1]["fit_shared_kernel"]
    assert ranks[0]["fit_local_kernel"] != ranks[1]["fit_local_kernel"]
