// The timeline: what happened to each tensor on this rank, and when, as a Chrome trace-event
// file (chrome://tracing, Perfetto). One row per tensor; complete events ("ph":"X") for its
// phases: QUEUED, NEGOTIATE, MEMCPY_IN_FUSION_BUFFER, the collective (MPI_ALLREDUCE, ...),
// MEMCPY_OUT_FUSION_BUFFER, CALLBACK.
//
// Each rank writes its own file (the rank inserted before the extension, RankedPath): shipping
// every rank's events to rank 0 would add traffic to the control plane that negotiates every
// collective. Events carry "pid" = rank and wall-clock microseconds, so the files of a job
// merge into one trace (python -m perseus_legacy.timeline merge).
//
// The runtime's thread never waits on the file: events go into a bounded queue (dropped and
// counted when it is full) that a writer thread drains. The file is valid JSON after every
// batch the writer flushes, so a rank that is killed leaves a readable trace. When no timeline
// runs, an event site costs one relaxed atomic load (enabled()).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/common.h"

namespace perseus {

class Timeline {
 public:
  ~Timeline() { Stop(); }

  // This rank, and the transport that prefixes the collectives' phases ("MPI", "TCP"). Set by
  // Init while no event can be recorded.
  void SetIdentity(int rank, const std::string& transport);
  // Starts writing to `path` (already this rank's file), truncating it. An error when it cannot
  // be opened or a timeline is running.
  Status Start(const std::string& path);
  // Writes what is queued, closes the file and waits for the writer thread. Safe to call twice.
  void Stop();
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  int64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }

  // A complete event on the row of `tensor`; `phase` is a string literal; `transport`: prefix
  // it with the transport ("MPI_" + phase); `args`: the members of the event's args object as
  // JSON text ("\"bytes\":16"), or "".
  void Record(const std::string& tensor, const char* phase, int64_t start_us, int64_t end_us,
              std::string args = "", bool transport = false);

  // Microseconds since the epoch (wall clock: ranks' files line up when merged).
  static int64_t NowMicros();
  // "trace.json" -> "trace.rank3.json"; "trace" -> "trace.rank3".
  static std::string RankedPath(const std::string& path, int rank);

 private:
  struct Event {
    std::string tensor;
    const char* phase;
    bool transport;
    int64_t start_us, dur_us;
    std::string args;
  };
  void WriterLoop();
  void Write(const std::vector<Event>& batch);
  int Row(const std::string& tensor, std::string* text);

  static constexpr size_t kCapacity = 1 << 16;  // events queued at most

  std::mutex control_mu_;  // serializes Start and Stop
  std::atomic<bool> enabled_{false};
  std::atomic<int64_t> dropped_{0};
  int rank_ = 0;
  std::string transport_ = "MPI";

  std::mutex mu_;  // guards queue_ and stopping_ (held only to push or swap)
  std::condition_variable cv_;
  std::vector<Event> queue_;
  bool stopping_ = false;   // the writer thread is asked to drain the queue and end
  bool accepting_ = false;  // Record queues events (between Start and Stop)
  std::thread writer_;

  // The writer thread's (Start and Stop touch them while it is not running).
  std::FILE* file_ = nullptr;
  std::unordered_map<std::string, int> rows_;
};

}  // namespace perseus
