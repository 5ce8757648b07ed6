// How large payloads move between hosts: a ring of point-to-point messages
// whose waits give the core back.
//
// A blocking MPI_Allreduce polls its transport until the data has arrived. On
// a network that is time the core could have spent on backpropagation: the
// reducing thread of a rank with one core takes turns with the thread that
// computes the earlier layers' gradients, so overlap hides nothing and the
// compute slows down instead. The ring posts each step's messages and waits
// for them the way kdist's announcements wait (spin briefly, then yield, then
// sleep between tests), so the transfer runs while the core computes.
#pragma once

#include <mpi.h>

#include <cstdint>

namespace kdist {

// Waits for `n` requests: spins for KDIST_WAIT_SPIN_US (100), then, with
// `yield`, yields the core until KDIST_WAIT_YIELD_US (2000) have passed, then
// sleeps KDIST_WAIT_SLEEP_US (50) between tests. Returns MPI's error code.
// A yielding thread stays runnable and takes turns with the computing one, so
// the ring, whose waits last as long as a transfer, goes from spin to sleep.
int WaitAll(int n, MPI_Request* requests, bool yield = true);

// The element-wise maximum of `count` int64 `values` over `comm`, in place, by
// dissemination: in round k each rank sends what it holds to rank + 2^k and keeps
// the maximum with what rank - 2^k sends, ceil(log2 size) rounds of one message
// each way, waited for with WaitAll. A rank that arrives last finishes at once;
// MPI's nonblocking allreduce needs each rank to test it several times, so with
// a sleeping waiter it cost the last rank 0.4-0.6 ms on an emulated 10 Gbit/s
// link, where this takes 0.05. Announcements use it (kdist/comm/protocol.py runs
// the same rounds on the same tags).
int DisseminateMax(int64_t* values, int count, MPI_Comm comm, bool yield);

// Whether the ranks of `comm` are on more than one host. Collective over
// `comm` the first time a communicator asks (as UseRing).
bool SpansHosts(MPI_Comm comm);

// Whether an allreduce of `bytes` over `comm` takes the ring, and on which
// communicator (a duplicate of `comm`, so that its messages meet no one
// else's). KDIST_RING: "auto" (the default) takes it when `comm` spans more
// than one host and `bytes` >= KDIST_RING_BYTES (1 MiB); "1" whenever
// `bytes` >= KDIST_RING_BYTES; "0" never. Collective over `comm` the first
// time a communicator asks, so every rank of it must ask at the same point.
bool UseRing(MPI_Comm comm, int64_t bytes, MPI_Comm* ring);

// Reduces `count` elements of `buffer` in place over `ring` with `op`:
// reduce-scatter, then allgather, each step's messages waited for with
// WaitAll. Each part is reduced on one rank and copied to the others, so
// every rank ends with the same bytes.
int RingAllreduce(void* buffer, int64_t count, int64_t element_size, MPI_Datatype type,
                  MPI_Op op, MPI_Comm ring);

}  // namespace kdist
