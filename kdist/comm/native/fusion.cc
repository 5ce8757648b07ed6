// The fusion queue; see fusion.h for what it does and why.
#include "fusion.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace kdist {
namespace {

constexpr int kRecord = 4;  // key, dtype, count, form
// A record with this dtype says "this rank gives up" (see Run).
constexpr int64_t kGiveUp = -1;
// In the root field of the agreement's header, so that no allgather of a user's
// (int64 rows of 4 values too) can ever be taken for it.
constexpr int64_t kAgreementMarker = 0x6b647175;

double EnvNumber(const char* name, double fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  return std::max(0.0, std::atof(value));
}

// How long a cycle collects: until no tensor arrived for the quiet time, or
// the cycle time passed since the first one (gradients arrive over the
// backward pass; a cycle that waits for all of them delays the first).
const int64_t kQuietNs = static_cast<int64_t>(EnvNumber("KDIST_FUSION_QUIET_US", 200) * 1e3);
const int64_t kCycleNs = static_cast<int64_t>(EnvNumber("KDIST_FUSION_CYCLE_US", 2000) * 1e3);

std::string Names(const std::vector<FusionRequest>& requests, size_t limit) {
  std::string text;
  for (size_t i = 0; i < requests.size() && i < limit; ++i) {
    text += (i ? ", " : "") + requests[i].name;
  }
  if (requests.size() > limit) text += ", ...";
  return text;
}

const char kMismatch[] = "kdist: the ranks are not running the same collective";

class Queue {
 public:
  explicit Queue(MPI_Comm comm) : comm_(comm) {
    {
      std::lock_guard<std::mutex> lock(CollectiveMutex());
      MPI_Comm_rank(comm_, &rank_);
      MPI_Comm_size(comm_, &size_);
    }
    std::thread([this] { Run(); }).detach();
  }

  // Wakes the queue's thread only when it must act (an arrival at an idle
  // queue, or the last tensor of the burst it waits for): on a core shared
  // with the backward pass, a wake-up per tensor costs more than it saves.
  void Add(FusionRequest request) {
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (awaited_burst_ >= 0) {
        auto known = burst_of_.find(request.key);
        if (known != burst_of_.end() && known->second.second == awaited_burst_) ++awaited_seen_;
      }
      arrived_.push_back(std::move(request));
      last_arrival_ = NowNanoseconds();
      wake = idle_ || (awaited_burst_ >= 0 && awaited_seen_ >= awaited_size_);
    }
    if (wake) wake_.notify_one();
  }

  // The communicator is about to be freed (kdist.shutdown, a process set
  // removed, an elastic reset): the thread fails what it holds and ends. MPI
  // may give a later communicator the same handle, and that one then gets a
  // queue of its own, with its own size and settings. Waits at most `wait_s`
  // for the thread, which may be inside a collective the other ranks never join.
  void Retire(double wait_s) {
    std::unique_lock<std::mutex> lock(mutex_);
    retired_ = true;
    wake_.notify_all();
    ended_.wait_for(lock, std::chrono::duration<double>(wait_s), [this] { return stopped_; });
  }

 private:
  // True once retired; fails what is held or arrived and tells Retire.
  bool Stopped() {
    std::vector<FusionRequest> failed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!retired_) return false;
      failed.swap(held_);
      for (FusionRequest& request : arrived_) failed.push_back(std::move(request));
      arrived_.clear();
    }
    const Status status = Status::Error(
        "kdist: the communicator was released (kdist.shutdown, a removed process set or an "
        "elastic reset) while this allreduce waited for the other ranks");
    for (FusionRequest& request : failed) request.done(status);
    std::lock_guard<std::mutex> lock(mutex_);
    stopped_ = true;
    ended_.notify_all();
    return true;
  }

  // Takes what arrived into held_: waits for a first tensor when none is
  // held, then for the cycle to fill. A cycle starts when every tensor of the
  // burst its first tensor came with last time has arrived (a step's
  // gradients, usually), when none arrived for the quiet time, or when the
  // cycle time passed. After a cycle that reduced nothing, it waits at least a
  // pause that grows, so that ranks out of step do not agree in a busy loop.
  void Collect(int64_t pause_ns) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (held_.empty()) {
      idle_ = true;
      wake_.wait(lock, [this] { return !arrived_.empty() || retired_; });
      idle_ = false;
    }
    if (retired_) return;
    const int64_t start = NowNanoseconds();
    const int64_t first = held_.empty() ? arrived_.front().key : held_.front().key;
    auto known = burst_of_.find(first);
    if (known != burst_of_.end()) {
      awaited_size_ = known->second.first;
      awaited_burst_ = known->second.second;
      awaited_seen_ = 0;
      for (const auto* list : {&held_, &arrived_}) {
        for (const FusionRequest& request : *list) {
          auto other = burst_of_.find(request.key);
          if (other != burst_of_.end() && other->second.second == awaited_burst_) {
            ++awaited_seen_;
          }
        }
      }
    }
    while (true) {
      const int64_t now = NowNanoseconds();
      if (now >= start + pause_ns && awaited_burst_ >= 0 && awaited_seen_ >= awaited_size_) {
        break;
      }
      // Sleeps to the next deadline; a tensor arriving meanwhile moves the
      // quiet deadline without waking this thread.
      int64_t until = std::min(last_arrival_ + kQuietNs, start + kCycleNs);
      until = std::max(until, start + pause_ns);
      if (now >= until) break;
      wake_.wait_for(lock, std::chrono::nanoseconds(until - now));
    }
    awaited_burst_ = -1;
    for (FusionRequest& request : arrived_) held_.push_back(std::move(request));
    arrived_.clear();
  }

  // Remembers the keys reduced since the queue was last empty as one burst.
  void EndBurst() {
    if (burst_keys_.empty()) return;
    ++bursts_;
    for (int64_t key : burst_keys_) burst_of_[key] = {burst_keys_.size(), bursts_};
    burst_keys_.clear();
  }

  // When no tensor could be reduced for KDIST_DEADLOCK_TIMEOUT seconds, this
  // rank says it gives up in its next agreement; every rank sees that in the
  // same cycle and fails what it holds, naming what each rank waited for.
  void Run() {
    double deadlock_s = EnvNumber("KDIST_DEADLOCK_TIMEOUT", 300);
    if (deadlock_s > 1e9) deadlock_s = 0;  // "inf" and the like: never
    const int64_t deadline_ns = static_cast<int64_t>(deadlock_s * 1e9);
    int64_t pause_ns = 0;
    int64_t stalled_since = 0;
    while (true) {
      Collect(pause_ns);
      if (Stopped()) return;
      const bool give_up = deadline_ns > 0 && stalled_since != 0 &&
                           NowNanoseconds() - stalled_since > deadline_ns;
      const bool progress = Cycle(give_up, deadlock_s);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (held_.empty() && arrived_.empty()) EndBurst();
      }
      if (progress) {
        pause_ns = 0;
        stalled_since = 0;
        continue;
      }
      pause_ns = std::min<int64_t>(std::max<int64_t>(2 * pause_ns, 100000), 10000000);
      if (stalled_since == 0) stalled_since = NowNanoseconds();
    }
  }

  void FailAll(const Status& status) {
    std::vector<FusionRequest> failed;
    failed.swap(held_);
    for (FusionRequest& request : failed) request.done(status);
  }

  // One agreement and the reductions it allows; true when any tensor was
  // reduced or failed.
  bool Cycle(bool give_up, double deadlock_s) {
    // One record per key: a node whose earlier run still waits goes next time.
    std::vector<size_t> offered;
    std::unordered_map<int64_t, size_t> mine;
    for (size_t i = 0; i < held_.size(); ++i) {
      if (mine.emplace(held_[i].key, i).second) offered.push_back(i);
    }
    std::vector<int64_t> records;
    for (size_t i : offered) {
      const FusionRequest& r = held_[i];
      records.insert(records.end(), {r.key, r.dtype, r.count, r.form});
    }
    if (give_up) records.insert(records.end(), {0, kGiveUp, 0, 0});
    const int64_t sent = static_cast<int64_t>(records.size()) / kRecord;
    std::vector<int64_t> rows(size_);
    std::vector<int64_t> all;
    std::vector<size_t> ready, differing;
    std::string mismatch;
    std::vector<Status> outcome;
    Status failed;
    {
      std::lock_guard<std::mutex> lock(CollectiveMutex());
      const std::string what = "agreeing on " + std::to_string(offered.size()) +
                               " allreduce(s) to fuse: " + Names(held_, 4);
      failed = AllgatherLocked(
          comm_, records.data(), sent, kRecord, kInt64, what,
          [&all](int64_t total) -> void* {
            all.resize(std::max<int64_t>(total, 1) * kRecord);
            return all.data();
          },
          rows.data(), kAgreementMarker);
      if (failed.ok) {
        Match(rows, all, mine, &ready, &differing, &mismatch);
        outcome = Reduce(ready);
      }
    }
    // Completion may run the graph's next ops on this thread: no lock is held.
    if (!failed.ok) {
      FailAll(failed);
      return true;
    }
    std::vector<bool> finished(held_.size(), false);
    for (size_t j = 0; j < ready.size(); ++j) {
      burst_keys_.push_back(held_[ready[j]].key);
      held_[ready[j]].done(outcome[j]);
      finished[ready[j]] = true;
    }
    if (!differing.empty()) {
      // Every rank found the same keys differing; each fails its own.
      const Status failure = Status::Error(std::string(kMismatch) + " (seen by rank " +
                                           std::to_string(rank_) + "):" + mismatch +
                                           "\nEvery rank must give each allreduce a tensor of "
                                           "the same shape and dtype, with the same "
                                           "reduction and scaling.");
      for (size_t i : differing) {
        held_[i].done(failure);
        finished[i] = true;
      }
    }
    std::string quitters;
    for (size_t r = 0, at = 0; r < rows.size(); ++r) {
      for (int64_t k = 0; k < rows[r]; ++k, at += kRecord) {
        if (all[at + 1] == kGiveUp) {
          quitters += (quitters.empty() ? "" : ", ") + std::to_string(r);
        }
      }
    }
    if (!quitters.empty()) {
      std::vector<FusionRequest> left;
      for (size_t i = 0; i < held_.size(); ++i) {
        if (!finished[i]) left.push_back(std::move(held_[i]));
      }
      held_.swap(left);
      FailAll(Status::Error(
          std::string(kMismatch) + " (seen by rank " + std::to_string(rank_) + "): for " +
          std::to_string(static_cast<int64_t>(deadlock_s)) + " s (KDIST_DEADLOCK_TIMEOUT; " +
          "rank(s) " + quitters + " gave up) no allreduce was ready on every rank; this " +
          "rank waited for " + Names(held_, 8) + ". " + last_others_ +
          " Every rank must run the same graph; an allreduce under a condition that "
          "differs between ranks never completes."));
      return true;
    }
    std::vector<FusionRequest> waiting;
    bool progress = false;
    for (size_t i = 0; i < held_.size(); ++i) {
      if (finished[i]) {
        progress = true;
      } else {
        waiting.push_back(std::move(held_[i]));
      }
    }
    held_.swap(waiting);
    return progress;
  }

  // The held tensors every rank that sent records has ready, in the first such
  // rank's order (`ready`), and a description of keys that differ (`mismatch`).
  void Match(const std::vector<int64_t>& rows, const std::vector<int64_t>& all,
             const std::unordered_map<int64_t, size_t>& mine, std::vector<size_t>* ready,
             std::vector<size_t>* differing, std::string* mismatch) {
    std::vector<std::unordered_map<int64_t, const int64_t*>> by_rank(rows.size());
    int first = -1;
    size_t at = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      for (int64_t k = 0; k < rows[r]; ++k, at += kRecord) {
        if (all[at + 1] != kGiveUp) by_rank[r].emplace(all[at], &all[at]);
      }
      if (rows[r] > 0 && first < 0) first = static_cast<int>(r);
    }
    std::string others;
    for (size_t r = 0; r < rows.size(); ++r) {
      const int64_t waiting = static_cast<int64_t>(by_rank[r].size());
      if (waiting > 0 && static_cast<int>(r) != rank_) {
        others += std::string(others.empty() ? "" : ", ") + "rank " + std::to_string(r) +
                  " waits for " + std::to_string(waiting) + " allreduce(s) of its own";
      }
    }
    last_others_ = others.empty() ? "" : "Meanwhile " + others + ".";
    if (first < 0) return;
    at = 0;
    for (int r = 0; r < first; ++r) at += rows[r] * kRecord;
    for (int64_t k = 0; k < rows[first]; ++k, at += kRecord) {
      const int64_t* record = &all[at];
      if (record[1] == kGiveUp) continue;
      bool everywhere = true, same = true;
      for (size_t r = 0; r < rows.size() && everywhere; ++r) {
        if (rows[r] == 0) continue;  // a rank in kdist.join takes part with neutral values
        auto found = by_rank[r].find(record[0]);
        if (found == by_rank[r].end()) {
          everywhere = false;
        } else if (!std::equal(record, record + kRecord, found->second)) {
          same = false;
        }
      }
      if (!everywhere) continue;
      auto held = mine.find(record[0]);
      if (held == mine.end()) continue;  // cannot happen: this rank sent records
      if (same) {
        ready->push_back(held->second);
        continue;
      }
      differing->push_back(held->second);
      *mismatch += "\n  allreduce '" + held_[held->second].name + "':";
      for (size_t r = 0; r < rows.size(); ++r) {
        auto found = by_rank[r].find(record[0]);
        if (found == by_rank[r].end()) continue;
        const int64_t* theirs = found->second;
        *mismatch += " rank " + std::to_string(r) + " gives " + std::to_string(theirs[2]) +
                     " " + DTypeName(theirs[1]) + " values (shape and reduction #" +
                     std::to_string(static_cast<uint64_t>(theirs[3]) % 100000) + ");";
      }
    }
  }

  // Reduces `ready` in groups that share dtype, reduction and scaling, in
  // order of first appearance; the caller holds the collective lock.
  std::vector<Status> Reduce(const std::vector<size_t>& ready) {
    std::vector<Status> outcome(ready.size());
    std::vector<bool> done(ready.size(), false);
    for (size_t j = 0; j < ready.size(); ++j) {
      if (done[j]) continue;
      const FusionRequest& lead = held_[ready[j]];
      std::vector<size_t> group;
      for (size_t k = j; k < ready.size(); ++k) {
        const FusionRequest& r = held_[ready[k]];
        if (!done[k] && r.dtype == lead.dtype && r.op == lead.op &&
            r.average == lead.average && r.prescale == lead.prescale &&
            r.postscale == lead.postscale && r.direct_bytes == lead.direct_bytes) {
          group.push_back(k);
          done[k] = true;
        }
      }
      std::vector<const void*> in;
      std::vector<void*> out;
      std::vector<int64_t> counts;
      for (size_t k : group) {
        const FusionRequest& r = held_[ready[k]];
        in.push_back(r.in);
        out.push_back(r.out);
        counts.push_back(r.count);
      }
      const std::string what = "fused allreduce of " + std::to_string(group.size()) +
                               " tensor(s) from separate ops: " + lead.name +
                               (group.size() > 1 ? ", ..." : "");
      const Status status = FusedAllreduceLocked(
          comm_, static_cast<int>(group.size()), in.data(), out.data(), counts.data(),
          lead.dtype, lead.op, lead.average, lead.prescale, lead.postscale, lead.direct_bytes,
          what);
      for (size_t k : group) outcome[k] = status;
    }
    return outcome;
  }

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  std::mutex mutex_;
  std::condition_variable wake_;
  // Guarded by mutex_: what arrived, when the last did, whether the thread
  // waits for a first tensor, and the burst it waits to see complete.
  std::vector<FusionRequest> arrived_;
  int64_t last_arrival_ = 0;
  bool idle_ = false;
  bool retired_ = false;
  bool stopped_ = false;
  std::condition_variable ended_;
  int64_t awaited_burst_ = -1;
  size_t awaited_size_ = 0;
  size_t awaited_seen_ = 0;
  std::vector<FusionRequest> held_;     // the queue's thread only
  std::string last_others_;             // the queue's thread only
  // Bursts: the keys reduced between two moments the queue was empty.
  // burst_of_ (guarded by mutex_): key -> (its burst's size, burst number).
  std::vector<int64_t> burst_keys_;  // the queue's thread only
  std::unordered_map<int64_t, std::pair<size_t, int64_t>> burst_of_;
  int64_t bursts_ = 0;
};

std::mutex g_queues_mutex;

// A live communicator's queue; a retired queue is left to its thread, which
// may still be inside a collective when the wait in Retire ends.
std::map<MPI_Comm, Queue*>& Queues() {
  static auto* queues = new std::map<MPI_Comm, Queue*>();
  return *queues;
}

}  // namespace

int64_t Hash(const void* data, size_t bytes, int64_t seed) {
  uint64_t hash = static_cast<uint64_t>(seed) ^ 14695981039346656037ULL;
  const unsigned char* at = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    hash ^= at[i];
    hash *= 1099511628211ULL;
  }
  return static_cast<int64_t>(hash);
}

void EnqueueAllreduce(MPI_Comm comm, FusionRequest request) {
  Queue* queue = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_queues_mutex);
    Queue*& slot = Queues()[comm];
    if (slot == nullptr) slot = new Queue(comm);
    queue = slot;
  }
  queue->Add(std::move(request));
}

}  // namespace kdist

// How many communicators have a queue: one per communicator whose separate
// allreduces ran in a graph, until the communicator is freed.
extern "C" int64_t kdist_fusion_queue_count() {
  std::lock_guard<std::mutex> lock(kdist::g_queues_mutex);
  return static_cast<int64_t>(kdist::Queues().size());
}

// Called before a communicator is freed; a no-op when it never had a queue.
extern "C" void kdist_fusion_retire(int64_t fortran_handle) {
  const MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle));
  kdist::Queue* queue = nullptr;
  {
    std::lock_guard<std::mutex> lock(kdist::g_queues_mutex);
    auto found = kdist::Queues().find(comm);
    if (found == kdist::Queues().end()) return;
    queue = found->second;
    kdist::Queues().erase(found);
  }
  queue->Retire(2.0);
}
