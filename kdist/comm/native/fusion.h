// The fusion queue: separate allreduces that a TensorFlow graph issues close
// together travel as one fused collective, as Horovod's background engine
// does for its ops.
//
// Why a queue: inside a `tf.function`, `[allreduce(g) for g in grads]` gives
// one op per tensor. Run one after another, each pays the wire protocol's
// announcement and its own message. Instead, each op hands its tensor to the
// queue of its communicator and returns (an asynchronous kernel); a thread per
// communicator collects what arrives within a short cycle, agrees with the
// other ranks on which of those tensors every rank has ready, and reduces them
// together with FusedAllreduce.
//
// The agreement is an ordinary announced allgather of one record per waiting
// tensor, [key, dtype, count, form] (marked in the header's root field), so a
// rank in kdist.join takes part with no records, and a rank that leaves the job
// is seen as in any collective:
// - key: a hash of the op's node name, the same on every rank running the
//   same graph (graph_ops queues only from a tf.function's outermost graph,
//   on the world communicator: one queue, and no node running twice at once);
// - form: a hash of the shape, reduction, averaging and scaling.
// Tensors ready on every rank that sent records are reduced in the order of the
// first such rank's records, one FusedAllreduce per dtype, reduction and
// scaling; the rest wait for a later cycle. A key whose dtype, count or form
// differ between ranks fails on every rank, as a mismatch. A rank whose queue
// reduced nothing for KDIST_DEADLOCK_TIMEOUT seconds gives up in its next
// agreement, and every rank then fails what it holds in that same cycle. A rank
// with nothing queued does not agree at all; the others then wait in the
// agreement, where the watchdog sees them (kdist.comm.watchdog).
#ifndef KDIST_FUSION_H_
#define KDIST_FUSION_H_

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>

#include "engine.h"

namespace kdist {

struct FusionRequest {
  std::string name;  // the op's node name
  int64_t key = 0;
  int64_t form = 0;
  int64_t dtype = 0;
  int64_t count = 0;
  int64_t op = 0;
  bool average = false;
  double prescale = 1.0;
  double postscale = 1.0;
  int64_t direct_bytes = 0;
  const void* in = nullptr;
  void* out = nullptr;
  std::function<void(const Status&)> done;  // called once, from the queue's thread
};

// Hands `request` to the queue of `comm`; `done` runs when it is reduced or failed.
void EnqueueAllreduce(MPI_Comm comm, FusionRequest request);

// A 64-bit FNV-1a hash, continued from `seed`.
int64_t Hash(const void* data, size_t bytes, int64_t seed);

}  // namespace kdist

#endif  // KDIST_FUSION_H_
