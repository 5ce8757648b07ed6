"""Synchronous data parallelism: N ranks at batch b behave as one process at batch N*b."""

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


ENGINES = {"native": {}, "py_function": {"KDIST_NATIVE_OPS": "0"}}


# Each engine with one optimizer: the optimizer only changes what is applied after
# the reduction, which both engines hand back alike.
@pytest.mark.parametrize("engine,optimizer,lr,tolerance", [("native", "adam", 1e-3, 1e-4),
                                                           ("py_function", "sgd", 0.05, 1e-5)])
def test_two_ranks_match_one_process_on_the_global_batch(mpirun, python_run, optimizer, lr,
                                                         tolerance, engine):
    args = ["--optimizer", optimizer, "--lr", lr, "--global-batch", 16, "--steps", 20]
    single = python_run("train.py", args)
    job = mpirun("train.py", n=2, args=args, env=ENGINES[engine])
    rank0, rank1 = job.rank(0), job.rank(1)
    assert rank0["native"] == (engine == "native"), "the engine under test must be the one used"
    assert rank0["weights"] == rank1["weights"], "ranks must hold bit-identical weights"
    np.testing.assert_allclose(rank0["weights"], single["weights"], atol=tolerance, rtol=0)
    assert rank0["iterations"] == single["iterations"] == 20
    assert rank0["loss_after"] < rank0["loss_before"]


def test_broadcast_starts_every_rank_from_the_root_weights(mpirun):
    job = mpirun("train.py", n=2, args=["--seed-per-rank", "--steps", 5])
    rank0, rank1 = job.rank(0), job.rank(1)
    assert rank0["built"] != rank1["built"]
    # Before the first step, not merely by the end: both start from rank 0's.
    assert rank0["first_step"] == rank1["first_step"] == rank0["built"]
    assert rank0["weights"] == rank1["weights"]


def test_compressed_gradients_keep_ranks_identical_and_differ_from_exact_as_their_kind_does(
        mpirun):
    args = ["--steps", 20, "--lr", 0.1]
    runs = {kind: mpirun("train.py", n=2, args=args + ["--compression", kind])
            for kind in ("none", "fp16", "topk")}
    for kind, job in runs.items():
        assert job.rank(0)["weights"] == job.rank(1)["weights"], kind
        assert job.rank(0)["loss_after"] < 0.9 * job.rank(0)["loss_before"], kind
    exact = np.array(runs["none"].rank(0)["weights"])
    # fp16 rounds each gradient to 11 significant bits: close to exact, not equal.
    fp16 = np.abs(np.array(runs["fp16"].rank(0)["weights"]) - exact).max()
    assert 0 < fp16 < 2e-3
    # top-k sends 30% of the entries each step and defers the rest: further from
    # exact after 20 steps, but its error feedback keeps it learning (above).
    topk = np.abs(np.array(runs["topk"].rank(0)["weights"]) - exact).max()
    assert topk > 20 * fp16 and topk > 1e-3


def test_gradient_accumulation_equals_one_larger_batch(mpirun, python_run):
    # 2 ranks x 2 accumulated passes x batch 4 == one process with batch 16.
    args = ["--global-batch", 16, "--steps", 10]
    accumulated = mpirun("train.py", n=2, args=args + ["--accumulate", 2])
    single = python_run("train.py", args)
    assert accumulated.rank(0)["iterations"] == 10 * 2, "every backward pass counts"
    np.testing.assert_allclose(accumulated.rank(0)["weights"], single["weights"], atol=1e-5)
