"""Collectives inside train steps compiled with XLA (`jit_compile=True`).

Keras turns XLA on by itself when a GPU is visible ("auto"), so every kdist
path that reduces inside a step must compile: its results must equal the same
training without XLA.
"""

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


def test_distributed_optimizer_under_xla_matches_one_process_without_it(mpirun, python_run):
    args = ["--optimizer", "adam", "--lr", 1e-3, "--steps", 12]
    single = python_run("train.py", args)
    job = mpirun("train.py", n=2, args=args + ["--jit"], timeout=420)
    assert job.rank(0)["jit"] and job.rank(0)["native"], "XLA compiled kdist's C++ collective"
    assert job.rank(0)["weights"] == job.rank(1)["weights"]
    np.testing.assert_allclose(job.rank(0)["weights"], single["weights"], atol=1e-5, rtol=0)


def test_mpi_strategy_under_xla_matches_one_process_without_it(mpirun, python_run):
    single = python_run("strategy.py", ["--strategy", "mirrored"])
    job = mpirun("strategy.py", n=2, args=["--strategy", "mpi", "--jit"], timeout=300)
    assert job.rank(0)["jit"]
    assert job.rank(0)["weights"] == job.rank(1)["weights"]
    np.testing.assert_allclose(job.rank(0)["weights"], single["weights"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(job.rank(0)["predictions"], single["predictions"], atol=1e-4)


@pytest.mark.parametrize("mode", ["hvd", pytest.param("mpi", marks=pytest.mark.slow)])
def test_gan_under_xla_matches_one_process_without_it(mpirun, python_run, mode):
    args = ["--d-steps", 1, "--g-steps", 2]
    single = python_run("gan_train.py", ["--mode", "single"] + args)
    job = mpirun("gan_train.py", n=2, args=["--mode", mode, "--jit"] + args, timeout=300)
    assert job.rank(0)["jit"]
    for part in ("generator", "discriminator"):
        assert job.rank(0)[part] == job.rank(1)[part]
        np.testing.assert_allclose(job.rank(0)[part], single[part], atol=1e-5, rtol=0)
    assert job.rank(0)["g_iterations"] == 2 * job.rank(0)["d_iterations"]


@pytest.mark.slow
def test_parameter_server_worker_under_xla_matches_it_without(mpirun):
    args = ["downpour", "--epochs", 2]
    plain = mpirun("ps_train.py", n=2, args=args, timeout=300)
    compiled = mpirun("ps_train.py", n=2, args=args + ["--jit"], timeout=300)
    assert compiled.rank(1)["jit"] and not plain.rank(1)["jit"]
    # One worker: the master applies its updates in order, so both runs are the same.
    np.testing.assert_allclose(compiled.rank(0)["weights"], plain.rank(0)["weights"],
                               atol=1e-5, rtol=0)
    assert compiled.rank(1)["weights"] == compiled.rank(0)["weights"]
