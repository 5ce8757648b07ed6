// The MPI side of kdist's in-graph collectives; see engine.h for the protocol.
#include "engine.h"
#include "ring.h"

#include <execinfo.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "Eigen/Core"

namespace kdist {

Status Announce(MPI_Comm comm, int64_t kind, int64_t dtype, int64_t op, int64_t count,
                int64_t root, const std::string& what, bool* all_active = nullptr);
Status AllgatherCounts(MPI_Comm comm, int64_t rows, int64_t* counts);
Status AllgatherPayload(MPI_Comm comm, const void* send, int64_t send_bytes, void* recv,
                        const int64_t* row_counts, int64_t row_bytes);
int CommSize(MPI_Comm comm);

namespace {

constexpr int kHeaderSize = 6;

// One collective at a time in this process: TensorFlow may call kernels from
// several threads (and the fusion queue has its own), and every rank must
// issue collectives in the same order.
std::mutex g_collective_mutex;

// What this process waits for, read by the watchdog thread.
std::mutex g_wait_mutex;
std::atomic<int64_t> g_wait_since{0};
std::string g_wait_what;

// The timeline: while it records, each phase of each collective appends one
// line "phase<TAB>start_ns<TAB>end_ns<TAB>bytes<TAB>what" (wall-clock time,
// comparable across ranks). 0 = off, 1 = on, 2 = on and marking each fused
// reduction as the start of a cycle.
std::atomic<int> g_timeline_mode{0};
std::mutex g_timeline_mutex;
std::string g_timeline_lines;
constexpr size_t kTimelineLimit = size_t{256} << 20;

int64_t WallNanoseconds() {
  timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<int64_t>(now.tv_sec) * 1000000000LL + now.tv_nsec;
}

void AppendTimelineLine(const char* phase, int64_t start, int64_t end, int64_t bytes,
                        const std::string& what) {
  std::string line = std::string(phase) + '\t' + std::to_string(start) + '\t' +
                     std::to_string(end) + '\t' + std::to_string(bytes) + '\t';
  for (char c : what) line += (c == '\t' || c == '\n') ? ' ' : c;
  line += '\n';
  std::lock_guard<std::mutex> lock(g_timeline_mutex);
  // Bounded, so that a forgotten timeline cannot fill the memory of a long run.
  if (g_timeline_lines.size() + line.size() <= kTimelineLimit) g_timeline_lines += line;
}

// Records one phase of a collective on the timeline, when it records.
class Span {
 public:
  Span(const char* phase, const std::string& what, int64_t bytes)
      : on_(g_timeline_mode.load(std::memory_order_relaxed) != 0) {
    if (!on_) return;
    phase_ = phase;
    what_ = &what;
    bytes_ = bytes;
    start_ = WallNanoseconds();
  }
  ~Span() {
    if (on_) AppendTimelineLine(phase_, start_, WallNanoseconds(), bytes_, *what_);
  }

 private:
  bool on_;
  const char* phase_ = nullptr;
  const std::string* what_ = nullptr;
  int64_t bytes_ = 0;
  int64_t start_ = 0;
};

class WaitScope {
 public:
  explicit WaitScope(const std::string& what) {
    std::lock_guard<std::mutex> lock(g_wait_mutex);
    g_wait_what = what;
    g_wait_since.store(NowNanoseconds());
  }
  ~WaitScope() { g_wait_since.store(0); }
};

std::string MpiError(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  return std::string(text, length);
}

Status Check(int rc, const char* call, const std::string& what) {
  if (rc == MPI_SUCCESS) return Status();
  return Status::Error(std::string("kdist: ") + call + " failed in " + what + ": " + MpiError(rc));
}

// Half-precision reductions: MPI has no 16-bit float type, so they travel as
// 16-bit integers and are combined in float.
template <typename Half, int64_t kOp>
void HalfReduce(void* in, void* inout, int* length, MPI_Datatype*) {
  const Half* a = static_cast<const Half*>(in);
  Half* b = static_cast<Half*>(inout);
  for (int i = 0; i < *length; ++i) {
    const float x = static_cast<float>(a[i]);
    const float y = static_cast<float>(b[i]);
    float r = x + y;
    if (kOp == kMin) r = std::min(x, y);
    if (kOp == kMax) r = std::max(x, y);
    if (kOp == kProduct) r = x * y;
    b[i] = static_cast<Half>(r);
  }
}

template <typename Half>
MPI_Op HalfOp(int64_t op) {
  static MPI_Op ops[5] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  if (ops[op] == MPI_OP_NULL) {
    MPI_User_function* fn = nullptr;
    if (op == kSum) fn = &HalfReduce<Half, kSum>;
    if (op == kMin) fn = &HalfReduce<Half, kMin>;
    if (op == kMax) fn = &HalfReduce<Half, kMax>;
    if (op == kProduct) fn = &HalfReduce<Half, kProduct>;
    MPI_Op_create(fn, /*commute=*/1, &ops[op]);
  }
  return ops[op];
}

// The sum of two contributions, already scaled: with two ranks every element is
// combined exactly once, whatever algorithm MPI picks, so averaging can ride on
// that one combination instead of a separate pass over the result. The factor
// is set under g_collective_mutex just before the reduction that uses it.
double g_scaled_sum_factor = 1.0;

template <typename T>
void ScaledSum(void* in, void* inout, int* length, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  const T by = static_cast<T>(g_scaled_sum_factor);
  for (int i = 0; i < *length; ++i) b[i] = (a[i] + b[i]) * by;
}

MPI_Op ScaledSumOp(int64_t dtype) {
  static MPI_Op ops[2] = {MPI_OP_NULL, MPI_OP_NULL};
  const int which = dtype == kFloat64 ? 1 : 0;
  if (ops[which] == MPI_OP_NULL) {
    MPI_Op_create(which ? &ScaledSum<double> : &ScaledSum<float>, /*commute=*/1, &ops[which]);
  }
  return ops[which];
}

MPI_Datatype MpiType(int64_t dtype) {
  switch (dtype) {
    case kFloat32: return MPI_FLOAT;
    case kFloat64: return MPI_DOUBLE;
    case kInt32: return MPI_INT32_T;
    case kUInt8: return MPI_UINT8_T;
    case kInt16: return MPI_INT16_T;
    case kInt8: return MPI_INT8_T;
    case kInt64: return MPI_INT64_T;
    case kBool: return MPI_C_BOOL;
    case kBFloat16: return MPI_UINT16_T;
    case kUInt16: return MPI_UINT16_T;
    case kFloat16: return MPI_UINT16_T;
    case kUInt32: return MPI_UINT32_T;
    case kUInt64: return MPI_UINT64_T;
    default: return MPI_DATATYPE_NULL;
  }
}

// Sums of 8- and 16-bit integers that wrap around, as C's arithmetic and
// Horovod's do: Open MPI 5's vectorised MPI_SUM (op/avx) saturates them.
template <typename Int>
void WrappingSum(void* in, void* inout, int* length, MPI_Datatype*) {
  using Unsigned = typename std::make_unsigned<Int>::type;
  const Int* a = static_cast<const Int*>(in);
  Int* b = static_cast<Int*>(inout);
  for (int i = 0; i < *length; ++i) {
    b[i] = static_cast<Int>(static_cast<Unsigned>(static_cast<Unsigned>(a[i]) +
                                                  static_cast<Unsigned>(b[i])));
  }
}

MPI_Op WrappingSumOp(int64_t dtype) {
  static MPI_Op ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  const int which = dtype == kInt8 ? 0 : dtype == kUInt8 ? 1 : dtype == kInt16 ? 2 : 3;
  if (ops[which] == MPI_OP_NULL) {
    MPI_User_function* fns[4] = {&WrappingSum<int8_t>, &WrappingSum<uint8_t>,
                                 &WrappingSum<int16_t>, &WrappingSum<uint16_t>};
    MPI_Op_create(fns[which], /*commute=*/1, &ops[which]);
  }
  return ops[which];
}

MPI_Op MpiOp(int64_t dtype, int64_t op) {
  if (dtype == kFloat16) return HalfOp<Eigen::half>(op);
  if (dtype == kBFloat16) return HalfOp<Eigen::bfloat16>(op);
  if (op == kSum && (dtype == kInt8 || dtype == kUInt8 || dtype == kInt16 ||
                     dtype == kUInt16)) {
    return WrappingSumOp(dtype);
  }
  if (dtype == kBool) return (op == kMin || op == kProduct) ? MPI_LAND : MPI_LOR;
  switch (op) {
    case kSum: return MPI_SUM;
    case kMin: return MPI_MIN;
    case kMax: return MPI_MAX;
    case kProduct: return MPI_PROD;
    default: return MPI_OP_NULL;
  }
}

const char* OpName(int64_t op) {
  switch (op) {
    case kSum: return "sum";
    case kMin: return "min";
    case kMax: return "max";
    case kProduct: return "product";
    default: return "?";
  }
}

// Every rank describes what it was doing; all of them fail with the same text.
Status Mismatch(MPI_Comm comm, const std::string& what) {
  const int size = CommSize(comm);
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  int64_t mine = static_cast<int64_t>(what.size());
  std::vector<int64_t> lengths(size);
  MPI_Allgather(&mine, 1, MPI_INT64_T, lengths.data(), 1, MPI_INT64_T, comm);
  std::vector<int> counts(size), offsets(size);
  int total = 0;
  for (int r = 0; r < size; ++r) {
    counts[r] = static_cast<int>(lengths[r]);
    offsets[r] = total;
    total += counts[r];
  }
  std::vector<char> all(std::max(total, 1));
  MPI_Allgatherv(what.data(), static_cast<int>(mine), MPI_CHAR, all.data(), counts.data(),
                 offsets.data(), MPI_CHAR, comm);
  std::string message =
      "kdist: the ranks are not running the same collective (seen by rank " +
      std::to_string(rank) + "):";
  for (int r = 0; r < size; ++r) {
    message += "\n  rank " + std::to_string(r) + ": " +
               std::string(all.data() + offsets[r], counts[r]);
  }
  // The same advice as kdist.comm.protocol.ADVICE.
  message +=
      "\nEvery rank must run the same collectives in the same order. Usually a rank left a "
      "loop early (a callback stopped its fit on that rank alone: pass fit's callbacks "
      "through kdist.callbacks.Agreement().around(...); or it ran out of data: see "
      "kdist.join) or ended its script; otherwise build the same model on every rank, "
      "give tensors the same shapes and dtypes, and use the same step pattern on all ranks.";
  return Status::Error(message);
}

// Packs, scales and unpacks elements of one C++ type.
template <typename T>
struct Elements {
  static void Scale(const void* in, void* out, int64_t count, double factor) {
    const T* src = static_cast<const T*>(in);
    T* dst = static_cast<T*>(out);
    if (factor == 1.0) {
      if (src != dst) std::memcpy(dst, src, count * sizeof(T));
      return;
    }
    // In float: a loop the compiler vectorises, and as exact as the result type.
    const float by = static_cast<float>(factor);
    for (int64_t i = 0; i < count; ++i) {
      dst[i] = static_cast<T>(static_cast<float>(src[i]) * by);
    }
  }
  static void SetOne(void* at) { *static_cast<T*>(at) = static_cast<T>(1.0f); }
  static double Read(const void* at) {
    return static_cast<double>(static_cast<float>(*static_cast<const T*>(at)));
  }
};

template <>
struct Elements<double> {
  static void Scale(const void* in, void* out, int64_t count, double factor) {
    const double* src = static_cast<const double*>(in);
    double* dst = static_cast<double*>(out);
    if (factor == 1.0) {
      if (src != dst) std::memcpy(dst, src, count * sizeof(double));
      return;
    }
    for (int64_t i = 0; i < count; ++i) dst[i] = src[i] * factor;
  }
  static void SetOne(void* at) { *static_cast<double*>(at) = 1.0; }
  static double Read(const void* at) { return *static_cast<const double*>(at); }
};

void ScaleElements(int64_t dtype, const void* in, void* out, int64_t count, double factor) {
  switch (dtype) {
    case kFloat32: return Elements<float>::Scale(in, out, count, factor);
    case kFloat64: return Elements<double>::Scale(in, out, count, factor);
    case kFloat16: return Elements<Eigen::half>::Scale(in, out, count, factor);
    case kBFloat16: return Elements<Eigen::bfloat16>::Scale(in, out, count, factor);
    default:
      // Integers are never scaled (the Python side refuses it).
      if (in != out) std::memcpy(out, in, count * ElementSize(dtype));
  }
}

void SetOne(int64_t dtype, void* at) {
  switch (dtype) {
    case kFloat32: return Elements<float>::SetOne(at);
    case kFloat64: return Elements<double>::SetOne(at);
    case kFloat16: return Elements<Eigen::half>::SetOne(at);
    case kBFloat16: return Elements<Eigen::bfloat16>::SetOne(at);
  }
}

double ReadOne(int64_t dtype, const void* at) {
  switch (dtype) {
    case kFloat32: return Elements<float>::Read(at);
    case kFloat64: return Elements<double>::Read(at);
    case kFloat16: return Elements<Eigen::half>::Read(at);
    case kBFloat16: return Elements<Eigen::bfloat16>::Read(at);
  }
  return 1.0;
}

Status CheckCount(int64_t count, const std::string& what) {
  if (count > INT_MAX) {
    return Status::Error("kdist: " + what + " has more than 2^31 elements in one message; "
                         "reduce bucket_bytes or split the tensor");
  }
  return Status();
}

std::string Describe(const char* kind, int64_t count, int64_t dtype, const std::string& what) {
  return std::string(kind) + " of " + std::to_string(count) + " " + DTypeName(dtype) +
         " values" + (what.empty() ? "" : " (" + what + ")");
}

// What a direct tensor's reduction sends and how it combines, decided once its
// announcement has told whether every rank trains (see FusedAllreduceLocked).
struct Payload {
  const void* send;
  bool scaled_sum;
};
using Prepare = std::function<Payload(bool all_active)>;

// The payload of one announced allreduce; the caller holds the mutex. With
// `scaled_sum` (a sum of two ranks' float32 or float64 values) the result is
// multiplied by g_scaled_sum_factor as it is combined; `prepare`, when given,
// decides both after the announcement.
Status AllreduceLocked(MPI_Comm comm, const void* send, void* recv, int64_t count,
                       int64_t dtype, int64_t op, const std::string& what,
                       bool scaled_sum = false, int64_t shapes_key = 0,
                       const Prepare* prepare = nullptr) {
  Status status = CheckCount(count, what);
  if (!status.ok) return status;
  const std::string description =
      Describe((std::string("allreduce (") + OpName(op) + ")").c_str(), count, dtype, what);
  bool all_active = true;
  status = Announce(comm, kAllreduce, dtype, op, count, shapes_key, description, &all_active);
  if (!status.ok) return status;
  if (prepare != nullptr) {
    const Payload payload = (*prepare)(all_active);
    send = payload.send;
    scaled_sum = payload.scaled_sum;
  }
  WaitScope waiting(description + ", moving data");
  const int64_t bytes = count * ElementSize(dtype);
  const MPI_Op mpi_op = scaled_sum ? ScaledSumOp(dtype) : MpiOp(dtype, op);
  MPI_Comm ring;
  if (UseRing(comm, bytes, &ring)) {
    Span span("ring allreduce", description, bytes);
    if (send != recv) std::memcpy(recv, send, bytes);
    return Check(RingAllreduce(recv, count, ElementSize(dtype), MpiType(dtype), mpi_op, ring),
                 "the ring allreduce", description);
  }
  Span span("allreduce", description, bytes);
  const void* source = send == recv ? MPI_IN_PLACE : send;
  return Check(MPI_Allreduce(source, recv, static_cast<int>(count), MpiType(dtype), mpi_op,
                             comm),
               "MPI_Allreduce", description);
}

std::vector<char>& PackBuffer() {
  static std::vector<char> buffer;
  return buffer;
}

}  // namespace

int CommSize(MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  return size;
}

int64_t ElementSize(int64_t dtype) {
  switch (dtype) {
    case kFloat32: case kInt32: case kUInt32: return 4;
    case kFloat64: case kInt64: case kUInt64: return 8;
    case kFloat16: case kBFloat16: case kInt16: case kUInt16: return 2;
    case kUInt8: case kInt8: case kBool: return 1;
    default: return 0;
  }
}

const char* DTypeName(int64_t dtype) {
  switch (dtype) {
    case kFloat32: return "float32";
    case kFloat64: return "float64";
    case kInt32: return "int32";
    case kUInt8: return "uint8";
    case kInt16: return "int16";
    case kInt8: return "int8";
    case kInt64: return "int64";
    case kBool: return "bool";
    case kBFloat16: return "bfloat16";
    case kUInt16: return "uint16";
    case kFloat16: return "float16";
    case kUInt32: return "uint32";
    case kUInt64: return "uint64";
    default: return "unknown";
  }
}

bool IsFloating(int64_t dtype) {
  return dtype == kFloat32 || dtype == kFloat64 || dtype == kFloat16 || dtype == kBFloat16;
}

Status Announce(MPI_Comm comm, int64_t kind, int64_t dtype, int64_t op, int64_t count,
                int64_t root, const std::string& what, bool* all_active) {
  const int64_t header[kHeaderSize] = {1, kind, dtype, op, count, root};
  int64_t send[2 * kHeaderSize], recv[2 * kHeaderSize];
  for (int i = 0; i < kHeaderSize; ++i) {
    send[i] = header[i];
    send[kHeaderSize + i] = -header[i];
  }
  // Between hosts a wait lasts a network's round trip at least; there the waiting
  // thread goes from spinning straight to sleeping, as the ring does (ring.h).
  // The first time a communicator asks, that is a collective, watched as a wait.
  bool yield = true;
  {
    WaitScope waiting(what);
    yield = !SpansHosts(comm);
  }
  Span span("negotiate", what, 0);
  std::memcpy(recv, send, sizeof(send));
  int rc;
  {
    WaitScope waiting(what);
    rc = DisseminateMax(recv, 2 * kHeaderSize, comm, yield);
  }
  Status status = Check(rc, "announcing a collective", what);
  if (!status.ok) return status;
  for (int i = 1; i < kHeaderSize; ++i) {
    if (recv[i] != -recv[kHeaderSize + i]) return Mismatch(comm, what);
  }
  // Active ranks send -1 there, joined ones 0 (engine.h).
  if (all_active != nullptr) *all_active = recv[kHeaderSize] < 0;
  return Status();
}

Status AllgatherCounts(MPI_Comm comm, int64_t rows, int64_t* counts) {
  return Check(MPI_Allgather(&rows, 1, MPI_INT64_T, counts, 1, MPI_INT64_T, comm),
               "MPI_Allgather", "allgather row counts");
}

Status Allreduce(MPI_Comm comm, const void* send, void* recv, int64_t count, int64_t dtype,
                 int64_t op, const std::string& what) {
  std::lock_guard<std::mutex> lock(g_collective_mutex);
  return AllreduceLocked(comm, send, recv, count, dtype, op, what);
}

std::mutex& CollectiveMutex() { return g_collective_mutex; }

int64_t NowNanoseconds() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<int64_t>(now.tv_sec) * 1000000000LL + now.tv_nsec;
}

namespace {

// 64-bit FNV-1a over little-endian int64 values, from `seed`; kept to 62 bits so
// that no key is the value a joined rank announces.
int64_t HashValues(const int64_t* values, int64_t n, int64_t seed) {
  uint64_t hash = static_cast<uint64_t>(seed) ^ 14695981039346656037ULL;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t value = static_cast<uint64_t>(values[i]);
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= (value >> (8 * byte)) & 0xff;
      hash *= 1099511628211ULL;
    }
  }
  return static_cast<int64_t>(hash & ((uint64_t{1} << 62) - 1));
}

}  // namespace

int64_t ShapeKey(const int64_t* dims, int64_t ndims) { return HashValues(dims, ndims, ndims); }

int64_t ShapesKey(const int64_t* keys, int64_t n) { return HashValues(keys, n, n); }

Status FusedAllreduce(MPI_Comm comm, int n, const void* const* in, void* const* out,
                      const int64_t* counts, int64_t dtype, int64_t op, bool average,
                      double prescale, double postscale, int64_t direct_bytes,
                      const std::string& what, const int64_t* shape_keys) {
  std::lock_guard<std::mutex> lock(g_collective_mutex);
  return FusedAllreduceLocked(comm, n, in, out, counts, dtype, op, average, prescale, postscale,
                              direct_bytes, what, shape_keys);
}

Status FusedAllreduceLocked(MPI_Comm comm, int n, const void* const* in, void* const* out,
                            const int64_t* counts, int64_t dtype, int64_t op, bool average,
                            double prescale, double postscale, int64_t direct_bytes,
                            const std::string& what, const int64_t* shape_keys) {
  const int64_t element = ElementSize(dtype);
  std::vector<bool> direct(n);
  int64_t packed = 0;
  for (int i = 0; i < n; ++i) {
    direct[i] = counts[i] * element >= direct_bytes;
    if (!direct[i]) packed += counts[i];
  }
  const int64_t extra = average ? 1 : 0;
  if (g_timeline_mode.load(std::memory_order_relaxed) == 2) {
    const int64_t now = WallNanoseconds();
    AppendTimelineLine("cycle", now, now, 0, what);
  }
  std::vector<char>& buffer = PackBuffer();
  if (static_cast<int64_t>(buffer.size()) < (packed + extra) * element) {
    buffer.resize((packed + extra) * element);
  }
  char* at = buffer.data();
  {
    Span span("pack", what, packed * element);
    for (int i = 0; i < n; ++i) {
      if (direct[i]) continue;
      ScaleElements(dtype, in[i], at, counts[i], prescale);
      at += counts[i] * element;
    }
  }
  // With nothing packed, the count needs no message of its own: the first direct
  // tensor's announcement tells whether every rank trains, and only when a rank has
  // joined (and there are more than two) is the count reduced, after the tensors.
  const bool count_apart = average && packed == 0;
  if (average && !count_apart) SetOne(dtype, at);
  double factor = postscale;
  int64_t packed_key = 0;
  if (shape_keys != nullptr) {
    std::vector<int64_t> keys;
    for (int i = 0; i < n; ++i) {
      if (!direct[i]) keys.push_back(shape_keys[i]);
    }
    packed_key = ShapesKey(keys.data(), static_cast<int64_t>(keys.size()));
  }
  if (!count_apart && packed + extra > 0) {
    Status status = AllreduceLocked(comm, buffer.data(), buffer.data(), packed + extra, dtype,
                                    op, what + ", packed", false, packed_key);
    if (!status.ok) return status;
    if (average) {
      // The count of ranks that trained; joined ranks sent 0.
      const double contributors = ReadOne(dtype, at);
      if (contributors > 0) factor = postscale / contributors;
    }
  }
  at = buffer.data();
  {
    Span span("unpack", what, packed * element);
    for (int i = 0; i < n; ++i) {
      if (direct[i]) continue;
      ScaleElements(dtype, at, out[i], counts[i], factor);
      at += counts[i] * element;
    }
  }
  // Large tensors travel alone. A sum's scaling needs no pass of its own: with
  // two ranks it rides on the combination, otherwise it joins the prescale (a
  // sum of scaled values is the scaled sum). Other reductions scale after.
  const bool sum = op == kSum && IsFloating(dtype);
  const int size = CommSize(comm);
  const bool pair = size == 2 && (dtype == kFloat32 || dtype == kFloat64);
  bool count_known = !count_apart;
  bool divide_after = false;  // a rank joined, more than two: divide once counted
  double after = 1.0;
  for (int i = 0; i < n; ++i) {
    if (!direct[i]) continue;
    const Prepare prepare = [&, i](bool all_active) {
      if (!count_known) {
        count_known = true;
        // With two ranks and one joined, this rank alone trained.
        if (all_active || size == 2) factor = postscale / (all_active ? size : 1);
        else divide_after = true;
      }
      const bool combine_scaled = sum && pair && prescale * factor != 1.0;
      const double before = combine_scaled ? 1.0 : (sum ? prescale * factor : prescale);
      after = sum ? 1.0 : factor;
      if (combine_scaled) g_scaled_sum_factor = prescale * factor;
      if (before == 1.0) return Payload{in[i], combine_scaled};
      Span span("scale", what, counts[i] * element);
      ScaleElements(dtype, in[i], out[i], counts[i], before);
      return Payload{out[i], combine_scaled};
    };
    const int64_t key = shape_keys == nullptr ? 0 : ShapesKey(&shape_keys[i], 1);
    Status status = AllreduceLocked(comm, in[i], out[i], counts[i], dtype, op,
                                    what + ", tensor " + std::to_string(i), false, key,
                                    &prepare);
    if (!status.ok) return status;
    if (after != 1.0) {
      Span span("scale", what, counts[i] * element);
      ScaleElements(dtype, out[i], out[i], counts[i], after);
    }
  }
  if (divide_after) {
    std::vector<char> one(element);
    SetOne(dtype, one.data());
    Status status = AllreduceLocked(comm, one.data(), one.data(), 1, dtype, kSum,
                                    what + ", ranks that trained");
    if (!status.ok) return status;
    const double contributors = ReadOne(dtype, one.data());
    for (int i = 0; i < n && contributors > 0; ++i) {
      if (!direct[i]) continue;
      Span span("scale", what, counts[i] * element);
      ScaleElements(dtype, out[i], out[i], counts[i], 1.0 / contributors);
    }
  }
  return Status();
}

Status AllgatherPayload(MPI_Comm comm, const void* send, int64_t send_bytes, void* recv,
                        const int64_t* row_counts, int64_t row_bytes) {
  const int size = CommSize(comm);
  std::vector<int> counts(size), offsets(size);
  int64_t total = 0;
  for (int r = 0; r < size; ++r) {
    const int64_t bytes = row_counts[r] * row_bytes;
    if (bytes > INT_MAX || total > INT_MAX) {
      return Status::Error("kdist: allgather of more than 2 GB; gather in smaller pieces");
    }
    counts[r] = static_cast<int>(bytes);
    offsets[r] = static_cast<int>(total);
    total += bytes;
  }
  return Check(MPI_Allgatherv(send, static_cast<int>(send_bytes), MPI_BYTE, recv,
                              counts.data(), offsets.data(), MPI_BYTE, comm),
               "MPI_Allgatherv", "allgather");
}

Status Allgather(MPI_Comm comm, const void* send, int64_t rows, int64_t row_elements,
                 int64_t dtype, const std::string& what,
                 const std::function<void*(int64_t)>& allocate) {
  std::lock_guard<std::mutex> lock(g_collective_mutex);
  return AllgatherLocked(comm, send, rows, row_elements, dtype, what, allocate, nullptr);
}

Status AllgatherLocked(MPI_Comm comm, const void* send, int64_t rows, int64_t row_elements,
                       int64_t dtype, const std::string& what,
                       const std::function<void*(int64_t)>& allocate, int64_t* rank_rows,
                       int64_t root) {
  const std::string description =
      "allgather of " + std::to_string(rows) + " rows of " + std::to_string(row_elements) +
      " " + DTypeName(dtype) + " values" + (what.empty() ? "" : " (" + what + ")");
  Status status = Announce(comm, kAllgather, dtype, 0, row_elements, root, description);
  if (!status.ok) return status;
  WaitScope waiting(description + ", moving data");
  Span span("allgather", description, rows * row_elements * ElementSize(dtype));
  const int size = CommSize(comm);
  std::vector<int64_t> counts(size);
  status = AllgatherCounts(comm, rows, counts.data());
  if (!status.ok) return status;
  int64_t total = 0;
  for (int r = 0; r < size; ++r) total += counts[r];
  if (rank_rows != nullptr) std::copy(counts.begin(), counts.end(), rank_rows);
  void* recv = allocate(total);
  if (recv == nullptr) return Status::Error("kdist: could not allocate the gathered tensor");
  const int64_t row_bytes = row_elements * ElementSize(dtype);
  return AllgatherPayload(comm, send, rows * row_bytes, recv, counts.data(), row_bytes);
}

Status Broadcast(MPI_Comm comm, void* buffer, int64_t count, int64_t dtype, int root,
                 const std::string& what) {
  std::lock_guard<std::mutex> lock(g_collective_mutex);
  Status status = CheckCount(count, what);
  if (!status.ok) return status;
  const std::string description = Describe(
      ("broadcast from rank " + std::to_string(root)).c_str(), count, dtype, what);
  status = Announce(comm, kBroadcast, dtype, 0, count, root, description);
  if (!status.ok) return status;
  WaitScope waiting(description + ", moving data");
  Span span("broadcast", description, count * ElementSize(dtype));
  return Check(MPI_Bcast(buffer, static_cast<int>(count), MpiType(dtype), root, comm),
               "MPI_Bcast", description);
}

namespace {

// Old Fortran handle -> the handle it stands for now (see CurrentComm). An old
// communicator is kept, never freed, while it has an entry, so MPI cannot hand
// its handle to another one.
std::mutex g_rebound_mutex;
std::unordered_map<int64_t, int64_t>* g_rebound = new std::unordered_map<int64_t, int64_t>();
std::atomic<bool> g_any_rebound{false};

}  // namespace

MPI_Comm CurrentComm(int64_t fortran_handle) {
  if (g_any_rebound.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(g_rebound_mutex);
    auto found = g_rebound->find(fortran_handle);
    if (found != g_rebound->end()) fortran_handle = found->second;
  }
  return MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle));
}

}  // namespace kdist

// Ops built with communicator `from` use `to` from now on; those that were
// already rebound to `from` follow.
extern "C" void kdist_comm_rebind(int64_t from, int64_t to) {
  std::lock_guard<std::mutex> lock(kdist::g_rebound_mutex);
  for (auto& entry : *kdist::g_rebound) {
    if (entry.second == from) entry.second = to;
  }
  (*kdist::g_rebound)[from] = to;
  kdist::g_any_rebound.store(true, std::memory_order_release);
}

// Called before communicator `handle` is freed: MPI may give its handle to the
// next communicator it creates, which nothing rebound must reach.
extern "C" void kdist_comm_forget(int64_t handle) {
  std::lock_guard<std::mutex> lock(kdist::g_rebound_mutex);
  for (auto entry = kdist::g_rebound->begin(); entry != kdist::g_rebound->end();) {
    if (entry->first == handle || entry->second == handle) {
      entry = kdist::g_rebound->erase(entry);
    } else {
      ++entry;
    }
  }
}

extern "C" int64_t kdist_native_wait(char* what, int64_t length) {
  const int64_t since = kdist::g_wait_since.load();
  if (since == 0) return 0;
  std::lock_guard<std::mutex> lock(kdist::g_wait_mutex);
  const int64_t n = std::min<int64_t>(length - 1, kdist::g_wait_what.size());
  std::memcpy(what, kdist::g_wait_what.data(), n);
  what[n] = '\0';
  return since;
}

extern "C" void kdist_timeline_record(int64_t mode) {
  kdist::g_timeline_mode.store(static_cast<int>(mode));
}

// With no buffer: how many bytes of lines wait. Otherwise moves whole lines,
// at most `length` bytes, into `buffer`; returns how many bytes it moved.
extern "C" int64_t kdist_timeline_take(char* buffer, int64_t length) {
  std::lock_guard<std::mutex> lock(kdist::g_timeline_mutex);
  std::string& lines = kdist::g_timeline_lines;
  if (buffer == nullptr) return static_cast<int64_t>(lines.size());
  size_t n = std::min<size_t>(static_cast<size_t>(std::max<int64_t>(length, 0)), lines.size());
  if (n < lines.size()) {
    const size_t end = lines.rfind('\n', n == 0 ? 0 : n - 1);
    n = end == std::string::npos ? 0 : end + 1;
  }
  std::memcpy(buffer, lines.data(), n);
  lines.erase(0, n);
  return static_cast<int64_t>(n);
}

// A crash in native code (a fault in one of TensorFlow's threads, say) ends the
// process with its signal; Python's faulthandler then prints every thread's
// Python stack, in which the native frames that crashed do not show. Once kdist's
// ops are loaded, a crash first writes the crashing thread's native backtrace to
// standard error, then hands the signal on to the handler that was there before
// (faulthandler's, or the default one). KDIST_NATIVE_BACKTRACE=0 leaves the
// handlers alone.
namespace {

constexpr int kCrashSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
constexpr int kCrashSignalCount = sizeof(kCrashSignals) / sizeof(kCrashSignals[0]);
struct sigaction g_previous_actions[kCrashSignalCount];

void WriteNativeBacktrace(int signal_number, siginfo_t*, void*) {
  static const char kHeader[] = "\nkdist: native backtrace of the crashing thread:\n";
  if (write(STDERR_FILENO, kHeader, sizeof(kHeader) - 1) < 0) {
    // Nothing else can be said.
  }
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  for (int i = 0; i < kCrashSignalCount; ++i) {
    if (kCrashSignals[i] == signal_number) {
      sigaction(signal_number, &g_previous_actions[i], nullptr);
    }
  }
  // Blocked while this handler runs; delivered to the handler put back above.
  raise(signal_number);
}

struct NativeBacktraceOnCrash {
  NativeBacktraceOnCrash() {
    const char* setting = std::getenv("KDIST_NATIVE_BACKTRACE");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return;
    void* warm_up[1];
    backtrace(warm_up, 1);  // loads the unwinder now, not inside the handler
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_sigaction = WriteNativeBacktrace;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    for (int i = 0; i < kCrashSignalCount; ++i) {
      sigaction(kCrashSignals[i], &action, &g_previous_actions[i]);
    }
  }
};

const NativeBacktraceOnCrash g_native_backtrace_on_crash;

}  // namespace
