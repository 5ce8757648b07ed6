"""Synchronous data parallelism: N ranks at batch b behave as one process at batch N*b."""

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


ENGINES = {"native": {}, "py_function": {"KDIST_NATIVE_OPS": "0"}}


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("optimizer,lr,tolerance", [("sgd", 0.05, 1e-5), ("adam", 1e-3, 1e-4)])
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


def test_broadcast_makes_different_initial_weights_identical(mpirun):
    job = mpirun("train.py", n=2, args=["--seed-per-rank", "--steps", 5])
    assert job.rank(0)["weights"] == job.rank(1)["weights"]


@pytest.mark.parametrize("compression", ["fp16", "topk"])
def test_compressed_gradients_keep_ranks_identical_and_learn(mpirun, compression):
    args = ["--compression", compression, "--steps", 20, "--lr", 0.1]
    job = mpirun("train.py", n=2, args=args)
    assert job.rank(0)["weights"] == job.rank(1)["weights"]
    assert job.rank(0)["loss_after"] < 0.9 * job.rank(0)["loss_before"]


def test_fp16_compression_stays_close_to_float32(mpirun):
    exact = mpirun("train.py", n=2, args=["--steps", 10])
    half = mpirun("train.py", n=2, args=["--steps", 10, "--compression", "fp16"])
    difference = np.abs(np.subtract(exact.rank(0)["weights"], half.rank(0)["weights"]))
    assert 0 < difference.max() < 2e-3


def test_gradient_accumulation_equals_one_larger_batch(mpirun, python_run):
    # 2 ranks x 2 accumulated passes x batch 4 == one process with batch 16.
    args = ["--global-batch", 16, "--steps", 10]
    accumulated = mpirun("train.py", n=2, args=args + ["--accumulate", 2])
    single = python_run("train.py", args)
    assert accumulated.rank(0)["iterations"] == 10 * 2, "every backward pass counts"
    np.testing.assert_allclose(accumulated.rank(0)["weights"], single["weights"], atol=1e-5)
