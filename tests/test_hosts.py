"""Jobs across several hosts, emulated on this machine (tests/emulated_hosts.py): ranks
launched from the first host through Open MPI's remote-shell agent, TCP the only path
between hosts, as on a cluster."""

import time

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("hosts,n", [(2, 4), (3, 3)])
def test_ranks_know_their_host_and_collectives_cross_hosts(mpirun, hosts, n):
    job = mpirun("collectives.py", n=n, hosts=hosts)
    per_host = n // hosts
    values = [np.array([r + 1.0, 10.0 * (r + 1)]) for r in range(n)]
    for r in range(n):
        got = job.rank(r)
        assert (got["size"], got["rank"]) == (n, r)
        # Ranks fill the hosts in order: local rank within the host, one rank per host
        # in each cross communicator.
        assert (got["local_rank"], got["local_size"]) == (r % per_host, per_host)
        assert got["cross_size"] == hosts
        assert np.allclose(got["np_average"], np.mean(values, axis=0))
        assert np.allclose(got["np_sum"], np.sum(values, axis=0))


def test_distributed_optimizer_across_hosts_matches_one_process(mpirun, python_run):
    args = ["--optimizer", "adam", "--lr", 1e-3, "--global-batch", 16, "--steps", 10]
    single = python_run("train.py", args)
    job = mpirun("train.py", n=2, args=args, hosts=2)
    assert job.rank(0)["weights"] == job.rank(1)["weights"]
    np.testing.assert_allclose(job.rank(0)["weights"], single["weights"], atol=1e-4, rtol=0)
    assert job.rank(0)["iterations"] == single["iterations"] == 10


def test_mpi_strategy_across_hosts_matches_one_process(mpirun, python_run):
    args = ["--optimizer", "adam", "--lr", 1e-3]
    single = python_run("strategy.py", args + ["--strategy", "mirrored"])
    job = mpirun("strategy.py", n=2, args=args + ["--strategy", "mpi", "--seed-per-rank"],
                 hosts=2)
    rank0, rank1 = job.rank(0), job.rank(1)
    assert rank0["weights"] == rank1["weights"] and rank0["replicas"] == 2
    np.testing.assert_allclose(rank0["weights"], single["weights"], atol=1e-4, rtol=0)


def test_a_host_that_drops_off_the_network_ends_the_job_in_seconds(mpirun):
    # Rank 1 pulls its host's cable mid-training. Open MPI's launcher, with the keepalive
    # settings kdist gives multi-host jobs, notices the lost daemon within about 30 s and
    # ends the job (its default would take 8 minutes); the fixture's timeout would fail
    # the test on a hang.
    started = time.monotonic()
    job = mpirun("unplug.py", n=2, hosts=2, check=False, timeout=150)
    assert time.monotonic() - started < 120
    assert "lost communication with a remote daemon" in job.output
    assert "on node h1" in job.output
    assert not any(report.get("finished") for report in job.results.values())
