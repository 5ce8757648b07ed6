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

from kdist.ps import protocol


def _aligned(nbytes, alignment=64):
    return -(-nbytes // alignment) * alignment


class SharedSlots:
    """The shared bodies of one job's exchanges; collective over `comm`.

    Every rank of `comm` must create it, with the same `parent` map (child
    rank -> its server's rank, as `kdist.ps.topology` gives) and `size`
    (values per body). A child whose server shares its node allocates two
    bodies in its own part of the window; its server maps them.

    Call `free()` on every rank, collectively, once no exchange is left.
    """

    def __init__(self, comm, parent, size):
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
        self.local_parent = parent.get(me) in self._node_rank
        nbytes = 2 * self._body_bytes if self.local_parent else 0
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        try:
            self._win = MPI.Win.Allocate_shared(nbytes, 1, info, comm=self._node)
        finally:
            info.Free()
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._local_children = {child for child, server in parent.items()
                                if server == me and child in self._node_rank}

    def _bodies(self, node_rank):
        memory, _ = self._win.Shared_query(node_rank)
        data = np.frombuffer(memory, dtype=np.uint8)
        first = data[:self.size * 4].view(np.float32)
        second = data[self._body_bytes:self._body_bytes + self.size * 4].view(np.float32)
        return first, second

    def link_messages(self):
        """This child's `(message, reply)`, their bodies shared with its server;
        None when the server is on another node."""
        if not self.local_parent:
            return None
        body, reply_body = self._bodies(self._node.Get_rank())
        return protocol.Message(self.size, body=body), protocol.Message(self.size,
                                                                         body=reply_body)

    def server_messages(self, child):
        """A server's `(incoming, reply)` for `child`, sharing the child's bodies;
        None when the child is on another node."""
        if child not in self._local_children:
            return None
        body, reply_body = self._bodies(self._node_rank[child])
        return protocol.Message(self.size, body=body), protocol.Message(self.size,
                                                                         body=reply_body)

    def sync(self):
        """A memory barrier between this process's view and the other side's."""
        self._win.Sync()

    def free(self):
        self._win.Unlock_all()
        self._win.Free()
        self._node.Free()
