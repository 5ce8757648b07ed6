"""`join`: a rank that ran out of data keeps the others' collectives going.

Ranks with uneven data take different numbers of steps. A rank that has no
more batches calls `join()`: it then reads each collective the other ranks
announce (`kdist.comm.protocol`) and takes part with neutral values (zeros
for a sum, so averages count only the ranks that trained; no rows for a
gather) until every rank has joined. It follows whatever the others run: a
GAN with more generator than discriminator steps, two models in one loop,
gradient accumulation, any number of buckets.
"""

import logging

import numpy as np

from kdist.comm import processes
from kdist.comm import protocol
from kdist.comm import watchdog

logger = logging.getLogger(__name__)


def join(comm=None):
    """Takes part in the other ranks' collectives until every rank has joined.

    A rank that has run out of data calls it. Until every rank has joined, it takes
    part in whatever collectives the other ranks announce, with neutral values: zeros
    in a sum (an average counts only the ranks that contributed), the identity of Min,
    Max and Product, no rows in an allgather or alltoall; it receives broadcasts and
    passes barriers. It therefore follows any step pattern: several optimizers, a GAN
    with `d_steps != g_steps`, gradient accumulation, explicit fusion groups, sparse
    gradients gathered by allgather.

    Returns the rank that joined last. The ranks that joined early missed
    updates: copy the model from the returned rank (kdist's callbacks do this
    for you at the end of each epoch). A collective that a joined rank cannot take
    part in (`kdist.allgather_object`, or a broadcast from the joined rank itself)
    ends the job with a message saying so. A rank whose script ends instead of joining
    makes `join` raise `kdist.comm.CollectiveMismatch` on the ranks that wait in it,
    naming that rank. In a world of one it returns at once. See "Uneven data and
    join" in the data-parallel guide.

    Args:
        comm: the `kdist.comm.Communicator` whose collectives to follow; the world by
            default. Unlike the other collectives it takes no `process_set=`.

    Example:

        On 2 ranks, where rank 0 runs out of data first:

        >>> import numpy as np, kdist
        >>> kdist.init()
        >>> if kdist.rank() == 1:  # rank 0 has joined: the average is rank 1's value
        ...     average = kdist.allreduce(np.array([4.0]))
        >>> kdist.join()  # the rank that joined last
        1
    """
    return join_and_tell(comm)[0]


def join_and_tell(comm=None):
    """`join()`, also saying whether any rank took part in collectives it did not start."""
    comm = comm if comm is not None else processes.world()
    if comm.size == 1:
        return comm.rank, False
    raw = comm.mpi
    mirrored = 0
    with comm.lock:
        while True:
            header = protocol.announce(raw, 0, what="kdist.join (this rank has run out of data)",
                                       active=False)
            if header is None:
                break
            if int(header[1]) == protocol.LEAVE:
                # Ranks ended their scripts instead of joining: nothing will end this wait.
                notes = raw.allgather("kdist.join (this rank has run out of data)")
                from kdist.comm import leaving

                raise leaving.fail_join(comm.rank, notes)
            _take_part(comm, header)
            mirrored += 1
    everyone = comm.allgather_object(mirrored)
    fewest = min(everyone)
    last = max(rank for rank, count in enumerate(everyone) if count == fewest)
    if mirrored:
        logger.debug("join: took part in %d collective(s); rank %d joined last", mirrored, last)
    return last, max(everyone) > 0


def _take_part(comm, header):
    """The payload side of one collective the active ranks announced, with neutral values."""
    MPI = protocol._mpi()
    raw = comm.mpi
    _, kind, dtype_code, op, count, root = (int(v) for v in header)
    what = protocol.describe(kind, dtype_code, op, count, root)
    with watchdog.waiting(f"kdist.join, taking part in {what}", watchdog.MOVING):
        if kind == protocol.ALLREDUCE:
            dtype = protocol.numpy_dtype(dtype_code)
            values = protocol.neutral(dtype, op, count)
            raw.Allreduce(MPI.IN_PLACE, [values, protocol.mpi_datatype(dtype)],
                          op=protocol.mpi_op(dtype, op))
        elif kind == protocol.ALLGATHER:
            rows = np.empty(comm.size, dtype=np.int64)
            raw.Allgather(np.zeros(1, dtype=np.int64), rows)
            row_bytes = count * protocol.numpy_dtype(dtype_code).itemsize
            received = np.empty(int(rows.sum()) * row_bytes, dtype=np.uint8)
            offsets = np.concatenate([[0], np.cumsum(rows * row_bytes)[:-1]])
            raw.Allgatherv([np.empty(0, np.uint8), MPI.BYTE],
                           [received, (rows * row_bytes).tolist(), offsets.tolist(), MPI.BYTE])
        elif kind == protocol.ALLTOALL:
            rows = np.empty(comm.size, dtype=np.int64)
            raw.Alltoall(np.zeros(comm.size, dtype=np.int64), rows)
            row_bytes = count * protocol.numpy_dtype(dtype_code).itemsize
            received = np.empty(int(rows.sum()) * row_bytes, dtype=np.uint8)
            offsets = np.concatenate([[0], np.cumsum(rows * row_bytes)[:-1]])
            zeros = [0] * comm.size
            raw.Alltoallv([np.empty(0, np.uint8), zeros, zeros, MPI.BYTE],
                          [received, (rows * row_bytes).tolist(), offsets.tolist(), MPI.BYTE])
        elif kind == protocol.BARRIER:
            raw.Barrier()
        elif kind in (protocol.BROADCAST, protocol.OBJECT_BROADCAST) and root != comm.rank:
            if kind == protocol.BROADCAST:
                dtype = protocol.numpy_dtype(dtype_code)
                raw.Bcast([np.empty(count, dtype=dtype), protocol.mpi_datatype(dtype)], root=root)
            else:
                raw.bcast(None, root=root)
        else:
            # Every rank waits in this collective; only ending the job frees them.
            watchdog.abort(
                f"rank {comm.rank} has joined (it ran out of data) while the other ranks "
                f"started {what}, which it cannot take part in with neutral values. Call "
                "kdist.join() only where the other ranks run allreduces, allgathers or "
                "broadcasts from a rank still training.")
