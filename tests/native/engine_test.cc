// The C++ engine's own test: every collective of engine.h, the fusion queue and
// the ring, with exact expected values, on however many ranks mpiexec starts.
// Built without TensorFlow (Eigen's headers only), so that it can run under
// AddressSanitizer and ThreadSanitizer: benchmarks/sanitizers.py builds and runs it.
//
// Threads are part of the test: while the main thread runs collectives, a
// watcher reads what the process waits for (as kdist's watchdog does), another
// takes timeline lines, and several threads hand tensors to the fusion queue at
// once, as TensorFlow's executor threads do.
//
// Exit status 0 and one line "engine_test: ok ..." per rank when every check passed.
#include <mpi.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "Eigen/Core"
#include "engine.h"
#include "fusion.h"
#include "ring.h"

namespace {

int g_rank = 0, g_size = 1;
int64_t g_checks = 0;

void Fail(const std::string& what) {
  std::fprintf(stderr, "engine_test rank %d: FAILED: %s\n", g_rank, what.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

void Expect(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) Fail(what);
}

void ExpectOk(const kdist::Status& status, const std::string& what) {
  Expect(status.ok, what + ": " + status.message);
}

// Sum over ranks r of f(r), and the like, as the reductions must give them.
template <typename T, typename F>
T Reduced(int64_t op, F value) {
  T result = value(0);
  for (int r = 1; r < g_size; ++r) {
    const T v = value(r);
    switch (op) {
      case kdist::kSum: result = static_cast<T>(result + v); break;
      case kdist::kMin: result = v < result ? v : result; break;
      case kdist::kMax: result = v > result ? v : result; break;
      case kdist::kProduct: result = static_cast<T>(result * v); break;
    }
  }
  return result;
}

template <typename T>
void AllreduceOf(int64_t dtype, int64_t count, bool in_place) {
  for (int64_t op : {kdist::kSum, kdist::kMin, kdist::kMax, kdist::kProduct}) {
    auto value = [&](int rank, int64_t i) { return static_cast<T>((rank + 1) * ((i % 3) + 1)); };
    std::vector<T> send(count), recv(count);
    for (int64_t i = 0; i < count; ++i) send[i] = value(g_rank, i);
    void* out = in_place ? static_cast<void*>(send.data()) : static_cast<void*>(recv.data());
    ExpectOk(kdist::Allreduce(MPI_COMM_WORLD, send.data(), out, count, dtype, op, "test"),
             std::string("allreduce of ") + kdist::DTypeName(dtype));
    const T* got = static_cast<const T*>(out);
    for (int64_t i = 0; i < count; ++i) {
      const T want = Reduced<T>(op, [&](int r) { return value(r, i); });
      Expect(static_cast<double>(got[i]) == static_cast<double>(want),
             std::string("allreduce value of ") + kdist::DTypeName(dtype) + " op " +
                 std::to_string(op) + " at " + std::to_string(i));
    }
  }
}

void Allreduces() {
  for (bool in_place : {false, true}) {
    AllreduceOf<float>(kdist::kFloat32, 1000, in_place);
    AllreduceOf<double>(kdist::kFloat64, 7, in_place);
    AllreduceOf<int32_t>(kdist::kInt32, 33, in_place);
    AllreduceOf<int64_t>(kdist::kInt64, 5, in_place);
    AllreduceOf<Eigen::half>(kdist::kFloat16, 65, in_place);
    AllreduceOf<Eigen::bfloat16>(kdist::kBFloat16, 9, in_place);
  }
  // Eight-bit integers wrap, as MPI's do.
  std::vector<uint8_t> bytes(4, 229), sum(4);
  ExpectOk(kdist::Allreduce(MPI_COMM_WORLD, bytes.data(), sum.data(), 4, kdist::kUInt8,
                            kdist::kSum, "wrapping"), "uint8 allreduce");
  Expect(sum[0] == static_cast<uint8_t>(229 * g_size), "uint8 sums wrap");
}

void Fused() {
  // Two small tensors travel packed, one large one on its own; averaged and scaled.
  const std::vector<int64_t> counts = {3, 5, 70000};
  std::vector<std::vector<float>> in(3), out(3);
  std::vector<const void*> ins;
  std::vector<void*> outs;
  for (size_t t = 0; t < counts.size(); ++t) {
    in[t].assign(counts[t], static_cast<float>(g_rank + 1));
    out[t].assign(counts[t], -1.0f);
    ins.push_back(in[t].data());
    outs.push_back(out[t].data());
  }
  const int64_t keys[3] = {11, 12, 13};
  ExpectOk(kdist::FusedAllreduce(MPI_COMM_WORLD, 3, ins.data(), outs.data(), counts.data(),
                                 kdist::kFloat32, kdist::kSum, true, 0.5, 4.0, 262144, "fused",
                                 keys),
           "fused allreduce");
  // mean over ranks of 0.5 * (r + 1), times 4.
  const double mean = (g_size + 1) / 2.0;
  for (size_t t = 0; t < counts.size(); ++t) {
    for (int64_t i = 0; i < counts[t]; i += 997) {
      Expect(std::fabs(out[t][i] - 2.0 * mean) < 1e-5, "fused value of tensor " +
             std::to_string(t));
    }
  }
}

void Allgathers() {
  // Rank r gives r rows of 3 values (rank 0 gives none), then every rank none.
  for (int round = 0; round < 2; ++round) {
    const int64_t rows = round == 0 ? g_rank : 0;
    std::vector<int32_t> send(rows * 3);
    for (int64_t i = 0; i < rows * 3; ++i) send[i] = 100 * g_rank + static_cast<int32_t>(i);
    std::vector<int32_t> got;
    int64_t total = -1;
    ExpectOk(kdist::Allgather(MPI_COMM_WORLD, send.data(), rows, 3, kdist::kInt32,
                              "uneven rows",
                              [&](int64_t n) -> void* {
                                total = n;
                                got.resize(std::max<int64_t>(n, 1) * 3);
                                return got.data();
                              }),
             "allgather of uneven rows");
    const int64_t want_total = round == 0 ? static_cast<int64_t>(g_size) * (g_size - 1) / 2 : 0;
    Expect(total == want_total, "allgather row count");
    int64_t at = 0;
    for (int r = 0; round == 0 && r < g_size; ++r) {
      for (int64_t i = 0; i < r * 3; ++i, ++at) {
        Expect(got[at] == 100 * r + i, "allgather value in rank order");
      }
    }
  }
}

void Broadcasts() {
  for (int root = 0; root < g_size; ++root) {
    std::vector<double> values(17, g_rank == root ? 3.5 + root : -1.0);
    ExpectOk(kdist::Broadcast(MPI_COMM_WORLD, values.data(), 17, kdist::kFloat64, root, "b"),
             "broadcast");
    Expect(values[16] == 3.5 + root, "broadcast value");
  }
}

void Mismatch() {
  // The last rank announces another count: every rank must fail, naming both.
  const int64_t count = g_rank == g_size - 1 ? 4 : 3;
  std::vector<float> values(count, 1.0f);
  kdist::Status status = kdist::Allreduce(MPI_COMM_WORLD, values.data(), values.data(), count,
                                          kdist::kFloat32, kdist::kSum, "mismatched on purpose");
  Expect(!status.ok, "a mismatch fails");
  Expect(status.message.find("not running the same collective") != std::string::npos &&
             status.message.find("rank " + std::to_string(g_size - 1) + ": allreduce (sum) of 4") !=
                 std::string::npos,
         "the mismatch names what each rank ran: " + status.message);
}

void Ring() {
  MPI_Comm ring;
  MPI_Comm_dup(MPI_COMM_WORLD, &ring);
  const int64_t count = 1001 + g_size;  // parts of uneven length
  std::vector<float> values(count);
  for (int64_t i = 0; i < count; ++i) values[i] = static_cast<float>(g_rank * 10 + i % 5);
  Expect(kdist::RingAllreduce(values.data(), count, 4, MPI_FLOAT, MPI_SUM, ring) == MPI_SUCCESS,
         "ring allreduce runs");
  for (int64_t i = 0; i < count; ++i) {
    const float want = Reduced<float>(kdist::kSum, [&](int r) { return r * 10.0f + i % 5; });
    Expect(values[i] == want, "ring value at " + std::to_string(i));
  }
  MPI_Comm_free(&ring);
}

// Several threads hand tensors to the fusion queue at once while the main
// thread runs its own collectives; each request must complete once, correctly.
void FusionQueue(MPI_Comm comm, int threads, int per_thread) {
  std::mutex mutex;
  std::condition_variable finished;
  int pending = threads * per_thread;
  std::vector<std::vector<double>> in(pending), out(pending);
  std::vector<std::thread> senders;
  std::atomic<int> failures{0};
  for (int t = 0; t < threads; ++t) {
    senders.emplace_back([&, t] {
      for (int k = 0; k < per_thread; ++k) {
        const int id = t * per_thread + k;
        in[id].assign(10 + id, static_cast<double>(g_rank + id));
        out[id].assign(10 + id, 0.0);
        kdist::FusionRequest request;
        request.name = "tensor_" + std::to_string(id);
        request.key = kdist::Hash(request.name.data(), request.name.size(), 0);
        const int64_t shape = 10 + id;
        request.form = kdist::Hash(&shape, sizeof(shape), 0);
        request.dtype = kdist::kFloat64;
        request.count = 10 + id;
        request.op = kdist::kSum;
        request.direct_bytes = 262144;
        request.in = in[id].data();
        request.out = out[id].data();
        request.done = [&, id](const kdist::Status& status) {
          const double want = Reduced<double>(kdist::kSum, [&](int r) {
            return static_cast<double>(r + id);
          });
          if (!status.ok || out[id][0] != want || out[id].back() != want) ++failures;
          std::lock_guard<std::mutex> lock(mutex);
          if (--pending == 0) finished.notify_all();
        };
        kdist::EnqueueAllreduce(comm, std::move(request));
      }
    });
  }
  for (auto& sender : senders) sender.join();
  std::unique_lock<std::mutex> lock(mutex);
  finished.wait(lock, [&] { return pending == 0; });
  Expect(failures.load() == 0, "every queued allreduce completes with its sum");
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (provided != MPI_THREAD_MULTIPLE) Fail("MPI_THREAD_MULTIPLE is not provided");
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 3;

  // The watchdog's and the timeline's readers, on threads of their own throughout.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> seen_waits{0};
  kdist_timeline_record(1);
  std::thread watcher([&] {
    char what[512];
    while (!stop.load()) {
      if (kdist_native_wait(what, sizeof(what)) != 0) ++seen_waits;
      char lines[4096];
      kdist_timeline_take(lines, sizeof(lines));
      std::this_thread::yield();
    }
  });
  // The fusion queue works on a communicator of its own, as kdist gives it the world's copy.
  MPI_Comm queue_comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &queue_comm);
  for (int round = 0; round < rounds; ++round) {
    Allreduces();
    Fused();
    Allgathers();
    Broadcasts();
    Mismatch();
    Ring();
    FusionQueue(queue_comm, 4, 8);
  }
  stop.store(true);
  watcher.join();
  kdist_timeline_record(0);
  MPI_Barrier(MPI_COMM_WORLD);
  std::printf("engine_test: ok rank %d of %d, %lld checks, %d rounds\n", g_rank, g_size,
              static_cast<long long>(g_checks), rounds);
  std::fflush(stdout);
  // The fusion queue's thread lives as long as the process (fusion.cc); it waits,
  // idle, while MPI finalizes.
  MPI_Finalize();
  return 0;
}
