// kdist's collective engine: the MPI side of every collective that runs inside
// a TensorFlow graph or an XLA program.
//
// Every collective is announced before it moves data. The announcement (the
// "header") is a maximum over the ranks (DisseminateMax, ring.h) of six int64
// values and their negations:
//   [active, kind, dtype, op, count, root]
// (for an allreduce, `root` carries a key of the tensors' shapes: ShapesKey)
// from every rank that takes part (a rank that has joined sends INT64_MIN
// everywhere but in the negated `active`, where it sends 0: the maximum there
// is 0 when a rank has joined, -1 when every rank takes part). The maxima and
// minima tell each rank what the active ranks are about to do and whether they
// agree. When they disagree, every rank sees it
// at the same moment, so all of them gather each other's descriptions and fail
// with the same message instead of exchanging mismatched buffers; a joined
// rank reads the header and takes part in the payload with neutral values.
// kdist/comm/protocol.py implements the same wire protocol in Python.
#ifndef KDIST_ENGINE_H_
#define KDIST_ENGINE_H_

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

namespace kdist {

// Collective kinds, as announced in the header.
enum Kind : int64_t {
  kAllreduce = 1,
  kAllgather = 2,
  kBroadcast = 3,
  kBarrier = 4,
  kObjectAllgather = 5,
  kObjectBroadcast = 6,
  kAlltoall = 7,
};

// Reduction operations.
enum Op : int64_t { kSum = 1, kMin = 2, kMax = 3, kProduct = 4 };

// Element types: TensorFlow's DataType numbers, so Python and both runtimes agree.
enum DType : int64_t {
  kFloat32 = 1,
  kFloat64 = 2,
  kInt32 = 3,
  kUInt8 = 4,
  kInt16 = 5,
  kInt8 = 6,
  kInt64 = 9,
  kBool = 10,
  kBFloat16 = 14,
  kUInt16 = 17,
  kFloat16 = 19,
  kUInt32 = 22,
  kUInt64 = 23,
};

// The communicator that the one with Fortran handle `fortran_handle` stands for now.
// A fault-tolerant job's world takes a new MPI communicator when ranks are lost
// (Communicator.adopt in Python), while graphs traced before name the old one in
// their ops' attributes: ops resolve their handle each time they run, so that a
// traced train step goes on with the survivors.
MPI_Comm CurrentComm(int64_t fortran_handle);

struct Status {
  bool ok = true;
  std::string message;
  static Status Error(std::string text) { return Status{false, std::move(text)}; }
};

// The number of ranks of `comm`.
int CommSize(MPI_Comm comm);

// Bytes per element of a dtype, or 0 if kdist does not move that type.
int64_t ElementSize(int64_t dtype);
const char* DTypeName(int64_t dtype);
bool IsFloating(int64_t dtype);

// Sums (or min/max/product) `count` elements across `comm`, from `send` into
// `recv` (which may be the same buffer).
Status Allreduce(MPI_Comm comm, const void* send, void* recv, int64_t count, int64_t dtype,
                 int64_t op, const std::string& what);

// A key for a tensor's shape (`ndims` dimensions), and one for the shapes of
// the tensors one message carries (`keys` of `n` tensors). An allreduce
// announces it in the header's `root` field (0: shapes not given: under XLA, and
// in the fusion queue, whose agreement compared them already),
// so that tensors of the same size in other shapes fail as a mismatch instead
// of being reduced as flat data. kdist/comm/protocol.py computes the same keys.
int64_t ShapeKey(const int64_t* dims, int64_t ndims);
int64_t ShapesKey(const int64_t* keys, int64_t n);

// Reduces several buffers of one dtype: buffers smaller than `direct_bytes`
// travel packed in one message, larger ones on their own. With `average`, the
// packed message carries one more element, 1 from every rank that trains,
// and results are divided by that count, so ranks that joined (sending zeros)
// do not bias the mean. With nothing packed the count costs no message while
// every rank trains: the announcement says so. out = reduce(in * prescale) * postscale [/ count].
// `shape_keys`: each tensor's ShapeKey, or null.
Status FusedAllreduce(MPI_Comm comm, int n, const void* const* in, void* const* out,
                      const int64_t* counts, int64_t dtype, int64_t op, bool average,
                      double prescale, double postscale, int64_t direct_bytes,
                      const std::string& what, const int64_t* shape_keys = nullptr);

// FusedAllreduce for a caller that holds CollectiveMutex().
Status FusedAllreduceLocked(MPI_Comm comm, int n, const void* const* in, void* const* out,
                            const int64_t* counts, int64_t dtype, int64_t op, bool average,
                            double prescale, double postscale, int64_t direct_bytes,
                            const std::string& what, const int64_t* shape_keys = nullptr);

// The lock every collective of this process holds while it runs.
std::mutex& CollectiveMutex();

// CLOCK_MONOTONIC, in nanoseconds.
int64_t NowNanoseconds();

// Gathers `rows` rows of `row_elements` elements from every rank, in rank
// order; ranks may give different numbers of rows. `allocate(total_rows)`
// returns where the result goes.
Status Allgather(MPI_Comm comm, const void* send, int64_t rows, int64_t row_elements,
                 int64_t dtype, const std::string& what,
                 const std::function<void*(int64_t)>& allocate);

// Allgather for a caller that holds CollectiveMutex(); with `rank_rows`, also
// writes how many rows each rank gave (0 from a rank that has joined). `root`
// goes into the header's unused root field, to tell this allgather apart.
Status AllgatherLocked(MPI_Comm comm, const void* send, int64_t rows, int64_t row_elements,
                       int64_t dtype, const std::string& what,
                       const std::function<void*(int64_t)>& allocate, int64_t* rank_rows,
                       int64_t root = 0);

// Broadcasts `count` elements from `root` in place.
Status Broadcast(MPI_Comm comm, void* buffer, int64_t count, int64_t dtype, int root,
                 const std::string& what);

}  // namespace kdist

// What a rank is waiting for, for the watchdog (read from Python with ctypes).
extern "C" {
// Copies the description of the collective this process is waiting in into
// `what` (at most `length` bytes, NUL-terminated) and returns since when it
// has waited (CLOCK_MONOTONIC nanoseconds), or 0 when it is not waiting.
int64_t kdist_native_wait(char* what, int64_t length);
void kdist_timeline_record(int64_t mode);
int64_t kdist_timeline_take(char* buffer, int64_t length);
}

#endif  // KDIST_ENGINE_H_
