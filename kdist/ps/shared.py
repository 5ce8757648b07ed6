"""Exchange buffers in memory that a server and its children on one node share.

Over messages, every exchange copies the model twice on the server's side:
the child's update into the server's receive buffer, and the reply into the
child's. When both processes live on one node, the child's message body and
its reply body can instead sit in an MPI shared-memory window: the child
fills its body in place (`Layout.read_` writes straight into it), sends only
the small header, and the server reads the update from the child's memory
and writes the reply into it. The server then touches the model once per
update, in the rule's own arithmetic, and moves no bytes for the child.

The header message still travels over MPI, which orders the two sides: a
body is written before its header is sent and read after it is received
(with a memory barrier, `MPI_Win_sync`, on both sides of each).

Children on another node, and jobs without MPI, keep plain messages; the
server serves both kinds in the same loop.
"""

import numpy as np


def _aligned(nbytes, alignment=64):
    return -(-nbytes // alignment) * alignment


class SharedSlots:
    """The shared bodies of one job's exchanges; collective over `comm`.

    Every rank of `comm` must create it, with the same `servers_of` (child
    rank -> the ranks of the servers it exchanges with) and `size` (float32
    values per body). A child with a server on its node allocates its message
    and reply bodies in its own part of an MPI shared-memory window; each such
    server maps them, and one that holds a shard of the centre uses its share
    of them.

    Call `free()` on every rank, collectively, once no exchange is left.

    Raises:
        ValueError: the job was not started under MPI.
    """

    def __init__(self, comm, servers_of, size):
        from kdist.comm.processes import _mpi

        MPI = _mpi()
        raw = comm.mpi
        if raw is None:
            raise ValueError("Shared exchange buffers need an MPI job; start it with "
                             "mpiexec -n N or kdist run -n N.")
        self.size = int(size)
        self._body_bytes = _aligned(self.size * 4)
        self._node = raw.Split_type(MPI.COMM_TYPE_SHARED)
        members = self._node.allgather(raw.Get_rank())
        self._node_rank = {rank: index for index, rank in enumerate(members)}
        me = raw.Get_rank()
        self._allocated = any(self.on_node(s) for s in servers_of.get(me, ()))
        nbytes = 2 * self._body_bytes if self._allocated else 0
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        try:
            self._win = MPI.Win.Allocate_shared(nbytes, 1, info, comm=self._node)
        finally:
            info.Free()
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._local_children = {child for child, servers in servers_of.items()
                                if me in servers and self.on_node(child)}

    def on_node(self, rank):
        """True when `rank` (of `comm`) shares this process's node."""
        return rank in self._node_rank

    def _bodies(self, node_rank):
        memory, _ = self._win.Shared_query(node_rank)
        data = np.frombuffer(memory, dtype=np.uint8)
        first = data[:self.size * 4].view(np.float32)
        second = data[self._body_bytes:self._body_bytes + self.size * 4].view(np.float32)
        return first, second

    def link_bodies(self):
        """This child's whole `(message body, reply body)`, or None when none of
        its servers is on this node."""
        return self._bodies(self._node.Get_rank()) if self._allocated else None

    def child_bodies(self, child):
        """A server's views of `child`'s whole `(message body, reply body)`, or
        None when the child is on another node."""
        if child not in self._local_children:
            return None
        return self._bodies(self._node_rank[child])

    def sync(self):
        """A memory barrier between this process's view and the other side's."""
        self._win.Sync()

    def free(self):
        """Releases the window (collective: every rank of `comm` calls it)."""
        self._win.Unlock_all()
        self._win.Free()
        self._node.Free()
