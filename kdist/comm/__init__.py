"""kdist's communication layer: the only part of kdist that touches MPI.

It holds every process function and collective of the top level (`kdist.init`,
`kdist.rank`, `kdist.allreduce`, ..., `ProcessSet`, `Compression`, the reduction ops),
which are documented here, and the layer beneath them: `Communicator` (a group of
processes), `world()`, `local()` and `cross()`, `launched_by_mpi`,
`CollectiveMismatch`, `TensorReducer` and `plan_buckets` (the data-parallel step's
fused reduction), and `abort`. Horovod's capability queries (`kdist.nccl_built`,
`kdist.is_homogeneous`, ...) are in `kdist.comm.capabilities` and documented with the
top level.

**Collectives.** Every rank of the communicator calls each collective, in the same
order. Each returns the kind of value it was given: numpy in, numpy out; a TensorFlow
tensor in, a tensor out. On tensors they work eagerly, inside `tf.function` (a Keras
train step, for instance) and inside functions compiled with XLA (`jit_compile=True`;
see "XLA" in the data-parallel guide). `allreduce`, `grouped_allreduce`, `allgather`,
`broadcast` and `reducescatter` on tensors run as kdist's C++ ops (`kdist.comm.native`),
which XLA compiles as custom calls; where the C++ ops cannot be built, and always for
`alltoall`, kdist calls MPI from Python instead (through a py-function op in a graph),
which XLA cannot compile.
In a world of one they need no MPI and return the input's value (scaled by the
prescale and postscale factors, if any). Inside a `tf.function` TensorFlow runs the
collectives in program order; in a TensorFlow 1 graph run by a `Session`, where it
would not, kdist makes each collective op wait for the one built before it in the same
graph.

Every collective takes `process_set=`, a registered `ProcessSet`, or `comm=`, a
`Communicator` (see `Communicator.split`), to run on some of the ranks instead of all
(`join` takes `comm=` only); passing both raises `ValueError`. `name` labels the
collective in error messages, stall reports and the timeline. `device_dense`,
`device_sparse` and `ignore_name_scope` are accepted for compatibility and have no
effect.

Every collective, in Python and in the C++ ops, follows one wire protocol
(`kdist.comm.protocol`): before moving data, the ranks exchange a header (kind, dtype,
reduction, count, root) in one small allreduce. Ranks that announced different
collectives therefore fail together with `CollectiveMismatch` (its entry shows the
message and the error classes for tensors), and a rank that has joined (`join`)
reads what the others run and takes part.

**Reduction ops**, for `op=`:

| name | value | meaning |
|---|---|---|
| `Average` | `"average"` | sum divided by the ranks that contributed (the default) |
| `Sum` | `"sum"` | sum |
| `Min` | `"min"` | element-wise minimum |
| `Max` | `"max"` | element-wise maximum |
| `Product` | `"product"` | element-wise product |

`Adasum` (`"adasum"`) is Horovod's adaptive summation, which kdist does not implement:
`allreduce(op=kdist.Adasum)` and `DistributedOptimizer(op=kdist.Adasum)` raise
`ValueError`.

**Process sets.** A `ProcessSet` is a group of world ranks that runs collectives on a
communicator of its own. Every rank registers it (`add_process_set`, or
`init(process_sets=[...])`); `global_process_set`, id 0, holds every rank. Every
collective but `join` takes `process_set=`, and so do `DistributedOptimizer` and
`PartialDistributedOptimizer`. A collective on a set that is not registered, or on a
rank outside the set, raises `ValueError`; anything but a `ProcessSet` raises
`TypeError`.

**Lower-level modules**, for code that builds on kdist's communication:

- `kdist.comm.devices.intra_op_threads(local_core_sets, environ=None, local_rank=0)`:
  the intra-op thread count `init` gives a rank, from the cores each rank on its node
  may run on. A positive `TF_NUM_INTRAOP_THREADS`, or else `OMP_NUM_THREADS`, wins;
  otherwise ranks bound to disjoint cores use all of theirs, and ranks whose cores
  overlap split them evenly (at least 1 each).
- `kdist.comm.native`: kdist's C++ collectives, TensorFlow ops (`KdistAllreduce`,
  `KdistAllgather`, `KdistBroadcast`) that run the protocol's C++ engine inside the
  graph, and their XLA lowering. Both are built with the MPI compiler wrapper `mpicxx`
  into `KDIST_CACHE` (default `~/.cache/kdist`), once per TensorFlow and MPI
  installation; ranks that start together wait for one build. `load()` returns the op
  module, building it on first use (about 15 s), or None when the ops cannot be used
  here (no `mpicxx`, no MPI headers, another MPI library than mpi4py's, or
  `KDIST_NATIVE_OPS=0`); `failure()` then says why, and kdist logs it once. The module
  holds `kdist_allreduce(tensors, comm, reduce_op=1, average=False, prescale=1.0,
  postscale=1.0, direct_bytes=262144, label="")`, `kdist_allgather(tensor, comm,
  size=1, label="")`, `kdist_broadcast(tensor, comm, root=0, label="")` and
  `kdist_mpi_library()`; `comm` is a `Communicator.fortran_handle`, `reduce_op` 1
  (sum), 2 (min), 3 (max) or 4 (product), and with `average` the sum is divided by
  the ranks that contributed. `load_xla()` builds (about a minute) and loads the XLA
  lowering; kdist calls it when it traces a collective inside a function compiled
  with XLA. It raises `RuntimeError`, saying why and to compile with
  `jit_compile=False`, when that is impossible here.
- `kdist.comm.p2p`: point-to-point messages of fixed-size numpy buffers, which the
  parameter server is built on. Every wait shows in stall reports and counts towards
  `KDIST_COLLECTIVE_TIMEOUT`, and a long wait sleeps between tests instead of
  holding a core. `Mailbox(comm, buffers, tag)` keeps one receive posted per peer
  (`buffers` maps a peer's rank to its buffer): `wait_any()` returns the peer whose
  message landed (None when none is posted), `rearm(peer)` posts its next receive,
  `close()` cancels the rest; under Open MPI's fault tolerance `wait_any` raises
  `PeerFailed` (with `.ranks`) when peers died. `Outbox(comm, tag)` makes
  non-blocking sends, one in flight per peer: `send(peer, buffer)`, `wait(peer)`,
  `forget(peer)`, `flush()`. `exchange(comm, peers, messages, replies, up_tag,
  down_tag)` sends `messages[i]` to `peers[i]` and waits for each peer's
  `replies[i]`, with every send and receive posted first, so that several peers serve
  at once; it returns `replies`. `send_object` and `recv_object` carry small
  picklable objects; `failed_ranks(comm)` gives the ranks MPI knows have died
  (acknowledging them).
- `kdist.comm.protocol` (the wire protocol), `kdist.comm.watchdog` (stall reports and
  ending a job that cannot go on) and `kdist.comm.timeline` (see `start_timeline`)
  describe themselves.

A communicator of the even ranks and one of the odd ones (every rank calls `split`):

```python
sub = kdist.comm.world().split(color=kdist.rank() % 2)
total = kdist.allreduce(np.array([1.0]), op=kdist.Sum, comm=sub)
```
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "allgather": "kdist.comm.collectives",
    "allgather_object": "kdist.comm.collectives",
    "allreduce": "kdist.comm.collectives",
    "alltoall": "kdist.comm.collectives",
    "barrier": "kdist.comm.collectives",
    "broadcast": "kdist.comm.collectives",
    "broadcast_": "kdist.comm.collectives",
    "broadcast_global_variables": "kdist.comm.collectives",
    "broadcast_object": "kdist.comm.collectives",
    "broadcast_object_fn": "kdist.comm.collectives",
    "broadcast_variables": "kdist.comm.collectives",
    "grouped_allgather": "kdist.comm.collectives",
    "grouped_allreduce": "kdist.comm.collectives",
    "grouped_reducescatter": "kdist.comm.collectives",
    "reducescatter": "kdist.comm.collectives",
    "Adasum": "kdist.comm.communicator",
    "Average": "kdist.comm.communicator",
    "Communicator": "kdist.comm.communicator",
    "Max": "kdist.comm.communicator",
    "Min": "kdist.comm.communicator",
    "Product": "kdist.comm.communicator",
    "Sum": "kdist.comm.communicator",
    "Compression": "kdist.comm.compression",
    "plan_buckets": "kdist.comm.fusion",
    "join": "kdist.comm.joining",
    "local_rank_op": "kdist.comm.process_ops",
    "local_size_op": "kdist.comm.process_ops",
    "process_set_included_op": "kdist.comm.process_ops",
    "rank_op": "kdist.comm.process_ops",
    "size_op": "kdist.comm.process_ops",
    "add_process_set": "kdist.comm.process_sets",
    "global_process_set": "kdist.comm.process_sets",
    "ProcessSet": "kdist.comm.process_sets",
    "remove_process_set": "kdist.comm.process_sets",
    "cross": "kdist.comm.processes",
    "cross_rank": "kdist.comm.processes",
    "cross_size": "kdist.comm.processes",
    "init": "kdist.comm.processes",
    "is_initialized": "kdist.comm.processes",
    "launched_by_mpi": "kdist.comm.processes",
    "local": "kdist.comm.processes",
    "local_rank": "kdist.comm.processes",
    "local_size": "kdist.comm.processes",
    "mpi_built": "kdist.comm.processes",
    "mpi_enabled": "kdist.comm.processes",
    "mpi_threads_supported": "kdist.comm.processes",
    "rank": "kdist.comm.processes",
    "shutdown": "kdist.comm.processes",
    "size": "kdist.comm.processes",
    "world": "kdist.comm.processes",
    "CollectiveMismatch": "kdist.comm.protocol",
    "TensorReducer": "kdist.comm.tensors",
    "start_timeline": "kdist.comm.timeline",
    "stop_timeline": "kdist.comm.timeline",
    "abort": "kdist.comm.watchdog",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
