// The waiting ring allreduce; see ring.h.
#include "ring.h"

#include <sched.h>
#include <sys/prctl.h>
#include <time.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace kdist {

int64_t NowNanoseconds();

namespace {

int64_t EnvInteger(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  const int64_t parsed = std::atoll(value);
  return parsed < 0 ? 0 : parsed;
}

// What kdist keeps on a communicator (an MPI attribute, freed with it).
struct RingInfo {
  bool spans_hosts = false;
  MPI_Comm ring = MPI_COMM_NULL;
};

int FreeRingInfo(MPI_Comm, int, void* value, void*) {
  RingInfo* info = static_cast<RingInfo*>(value);
  if (info->ring != MPI_COMM_NULL) MPI_Comm_free(&info->ring);
  delete info;
  return MPI_SUCCESS;
}

RingInfo* InfoOf(MPI_Comm comm) {
  static int keyval = MPI_KEYVAL_INVALID;
  if (keyval == MPI_KEYVAL_INVALID) {
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, FreeRingInfo, &keyval, nullptr);
  }
  void* value = nullptr;
  int found = 0;
  MPI_Comm_get_attr(comm, keyval, &value, &found);
  if (found) return static_cast<RingInfo*>(value);
  RingInfo* info = new RingInfo();
  // On failure (a communicator that lost ranks) the info says "one host, no
  // ring": MPI_Allreduce then reports the failure as it would have anyway.
  MPI_Comm node;
  if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) ==
      MPI_SUCCESS) {
    int node_size = 0, size = 0;
    MPI_Comm_size(node, &node_size);
    MPI_Comm_size(comm, &size);
    MPI_Comm_free(&node);
    if (MPI_Comm_dup(comm, &info->ring) == MPI_SUCCESS) {
      info->spans_hosts = node_size < size;
    } else {
      info->ring = MPI_COMM_NULL;
    }
  }
  MPI_Comm_set_attr(comm, keyval, info);
  return info;
}

// One step of the ring: `send_count` elements from `send` to the right-hand
// neighbour, `receive_count` into `receive` from the left-hand one, both waited
// for without holding the core.
int Shift(const char* send, int64_t send_count, char* receive, int64_t receive_count,
          MPI_Datatype type, int left, int right, MPI_Comm ring) {
  constexpr int kTag = 7411;
  MPI_Request requests[2];
  int rc = MPI_Irecv(receive, static_cast<int>(receive_count), type, left, kTag, ring,
                     &requests[0]);
  if (rc != MPI_SUCCESS) return rc;
  rc = MPI_Isend(send, static_cast<int>(send_count), type, right, kTag, ring, &requests[1]);
  if (rc != MPI_SUCCESS) return rc;
  return WaitAll(2, requests, false);
}

}  // namespace

int WaitAll(int n, MPI_Request* requests, bool yield) {
  static const int64_t spin_ns = EnvInteger("KDIST_WAIT_SPIN_US", 100) * 1000;
  static const int64_t yield_ns = EnvInteger("KDIST_WAIT_YIELD_US", 2000) * 1000;
  static const int64_t sleep_ns = EnvInteger("KDIST_WAIT_SLEEP_US", 50) * 1000;
  const int64_t start = NowNanoseconds();
  int done = 0;
  // Linux lets a sleep overrun by the thread's timer slack (50 us by default), which
  // would double each pause; MPI makes no progress on a transfer between tests, so
  // on a fast link an overrun is a stalled link. The slack is the caller's again after.
  int slack = -1;
  int rc = MPI_SUCCESS;
  while (true) {
    rc = MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS || done) break;
    const int64_t waited = NowNanoseconds() - start;
    if (waited < spin_ns) continue;
    if (yield && waited < yield_ns) {
      sched_yield();
    } else {
      if (slack < 0) {
        slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
        if (slack >= 0) prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0);
      }
      timespec pause{0, static_cast<long>(sleep_ns)};
      nanosleep(&pause, nullptr);
    }
  }
  if (slack >= 0) prctl(PR_SET_TIMERSLACK, slack, 0, 0, 0);
  return rc;
}

int DisseminateMax(int64_t* values, int count, MPI_Comm comm, bool yield) {
  constexpr int kAnnounceTag = 7300;  // + the round (protocol.py: ANNOUNCE_TAG)
  int size = 1, rank = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  std::vector<int64_t> outgoing(count), incoming(count);
  for (int round = 0, step = 1; step < size; ++round, step *= 2) {
    std::memcpy(outgoing.data(), values, sizeof(int64_t) * count);
    MPI_Request requests[2];
    int rc = MPI_Irecv(incoming.data(), count, MPI_INT64_T, (rank - step + size) % size,
                       kAnnounceTag + round, comm, &requests[0]);
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Isend(outgoing.data(), count, MPI_INT64_T, (rank + step) % size,
                   kAnnounceTag + round, comm, &requests[1]);
    if (rc != MPI_SUCCESS) return rc;
    rc = WaitAll(2, requests, yield);
    if (rc != MPI_SUCCESS) return rc;
    for (int i = 0; i < count; ++i) {
      if (incoming[i] > values[i]) values[i] = incoming[i];
    }
  }
  return MPI_SUCCESS;
}

bool SpansHosts(MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  return size > 1 && InfoOf(comm)->spans_hosts;
}

bool UseRing(MPI_Comm comm, int64_t bytes, MPI_Comm* ring) {
  static const std::string mode = [] {
    const char* value = std::getenv("KDIST_RING");
    return std::string(value == nullptr || *value == '\0' ? "auto" : value);
  }();
  static const int64_t threshold = EnvInteger("KDIST_RING_BYTES", int64_t{1} << 20);
  if (mode == "0" || bytes < threshold) return false;
  int size = 1;
  MPI_Comm_size(comm, &size);
  if (size < 2) return false;
  RingInfo* info = InfoOf(comm);
  if (info->ring == MPI_COMM_NULL || (mode != "1" && !info->spans_hosts)) return false;
  *ring = info->ring;
  return true;
}

int RingAllreduce(void* buffer, int64_t count, int64_t element_size, MPI_Datatype type,
                  MPI_Op op, MPI_Comm ring) {
  int size = 1, rank = 0;
  MPI_Comm_size(ring, &size);
  MPI_Comm_rank(ring, &rank);
  if (size == 1 || count == 0) return MPI_SUCCESS;
  // Part i: `offsets[i]` onwards, `counts[i]` elements; the first parts take
  // one more element each when the count does not divide.
  std::vector<int64_t> counts(size), offsets(size);
  for (int i = 0, at = 0; i < size; ++i) {
    counts[i] = count / size + (i < count % size ? 1 : 0);
    offsets[i] = at;
    at += counts[i];
  }
  char* data = static_cast<char*>(buffer);
  std::vector<char> incoming(static_cast<size_t>(counts[0] * element_size));
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  auto part = [&](int step) { return ((step % size) + size) % size; };
  // Reduce-scatter: after step s, part (rank - s - 1) holds s + 2 ranks' values;
  // after size - 1 steps this rank holds part (rank + 1) reduced over all ranks.
  for (int s = 0; s < size - 1; ++s) {
    const int out = part(rank - s), in = part(rank - s - 1);
    int rc = Shift(data + offsets[out] * element_size, counts[out], incoming.data(),
                   counts[in], type, left, right, ring);
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Reduce_local(incoming.data(), data + offsets[in] * element_size,
                          static_cast<int>(counts[in]), type, op);
    if (rc != MPI_SUCCESS) return rc;
  }
  // Allgather: each reduced part travels once round the ring.
  for (int s = 0; s < size - 1; ++s) {
    const int out = part(rank + 1 - s), in = part(rank - s);
    const int rc = Shift(data + offsets[out] * element_size, counts[out],
                         data + offsets[in] * element_size, counts[in], type, left, right,
                         ring);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

}  // namespace kdist
