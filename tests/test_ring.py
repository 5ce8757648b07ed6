"""The ring allreduce (kdist/comm/native/ring.h): large payloads between hosts move by
point-to-point messages whose waits give the core back; the results must be those of
MPI_Allreduce, the same bytes on every rank."""

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

SIZES = [5, 1001, 40003]
# Each allreduce its own collective (no fusion queue), so that payload sizes are known:
# some below the threshold, some above.
ENV = {"KDIST_RING_BYTES": "4096", "KDIST_FUSION": "0"}


def check(job, ranks):
    expected = []
    for size in SIZES:
        base = (np.arange(size) % 50).astype(np.float64)
        for floating in (True, True, False, True):  # float32, float64, int32, float16
            expected += [(base * 6, True), (base * 3, True)]  # sum and max of 3 ranks
            if floating:
                expected.append((base * 2, False))  # average
    for r in range(ranks):
        got = job.rank(r)
        assert got["same_as_rank_0"]
        assert len(got["results"]) == len(expected)
        for result, (want, exact) in zip(got["results"], expected):
            if exact:
                np.testing.assert_array_equal(result, want)
            else:
                np.testing.assert_allclose(result, want, rtol=2e-3)
    phases = [tuple(p) for p in job.rank(0)["phases"]]
    return ({nbytes for name, nbytes in phases if name == "ring allreduce"},
            {nbytes for name, nbytes in phases if name == "allreduce"})


def test_across_hosts_large_payloads_take_the_ring_small_ones_mpi(mpi_job, tmp_path):
    # Three ranks on three hosts, parts of uneven length.
    """Its own job: its ranks run on three emulated hosts."""
    job = mpi_job("ring.py", n=3, hosts=3, env=ENV,
                  args=[tmp_path / "timeline.json", ",".join(map(str, SIZES))])
    ring, plain = check(job, 3)
    assert ring and min(ring) >= 4096
    assert plain and max(plain) < 4096


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_on_one_host_the_ring_is_taken_only_when_asked(mpi_job, tmp_path, mode):
    # Over shared memory MPI_Allreduce costs next to nothing and nothing is hidden by
    # waiting, so "auto" keeps it; KDIST_RING=1 forces the ring, with the same results.
    """Its own job: KDIST_RING and KDIST_RING_BYTES are read once per process, by the C++
    engine.
    """
    job = mpi_job("ring.py", n=3, env={**ENV, "KDIST_RING": mode},
                  args=[tmp_path / "timeline.json", ",".join(map(str, SIZES))])
    ring, plain = check(job, 3)
    if mode == "auto":
        assert not ring and max(plain) >= 4096
    else:
        assert ring and min(ring) >= 4096 and max(plain) < 4096
