// The runtime's one state object and its background thread. The thread makes every transport
// call: it negotiates rounds (through the response cache, response_cache.h, and the coordinator,
// negotiation.h) and executes the answers in order (response_executor.h). Requests reach it
// through the tensor queue (tensor_queue.h). It counts what it does (stats.h) and, while one
// runs, records each tensor's phases on the timeline (timeline.h). Under PERSEUS_AUTOTUNE,
// rank 0 measures its rounds and sends new fusion and cycle values with its answers
// (autotune.h), which every rank applies at the same point.
#include "runtime/runtime.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <exception>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <pthread.h>
#include <stdexcept>
#include <thread>

#include "runtime/autotune.h"
#include "runtime/fusion.h"
#include "runtime/message.h"
#include "runtime/negotiation.h"
#include "runtime/response_executor.h"
#include "runtime/response_cache.h"
#include "runtime/settings.h"
#include "runtime/stats.h"
#include "runtime/tensor_queue.h"
#include "runtime/timeline.h"
#include "transport/allreduce_algorithms.h"
#include "transport/controller.h"
#include "transport/registry.h"

namespace perseus {
namespace {

// How long an idle rank sleeps before joining a round anyway, so that a peer's shutdown and the
// coordinator's stall checks never wait on a rank that has nothing to submit.
constexpr auto kHeartbeat = std::chrono::seconds(1);
// How long Abort waits for the background thread to have told the other ranks.
constexpr auto kAbortWait = std::chrono::seconds(10);

// Settings that change which transfers a collective makes, or how the ranks' negotiation
// messages line up, must be the same on every rank, or the ranks would wait on transfers the
// others never make: PERSEUS_FUSION_THRESHOLD (each rank fuses the cache's answers itself),
// PERSEUS_CACHE_CAPACITY (the cache's bit vectors and positions),
// PERSEUS_HIERARCHICAL_ALLREDUCE and the allreduce algorithm's settings (each rank picks the
// algorithm itself). Each setting's value as this rank has it, by name.
std::vector<std::pair<std::string, std::string>> SettingsThatMustAgree(const Settings& settings) {
  return {{"PERSEUS_FUSION_THRESHOLD", std::to_string(settings.fusion_threshold_bytes)},
          {"PERSEUS_CACHE_CAPACITY", std::to_string(settings.cache_capacity)},
          {"PERSEUS_HIERARCHICAL_ALLREDUCE", HierarchicalName(settings.hierarchical)},
          {"PERSEUS_ALLREDUCE_ALGORITHM", AllreduceAlgorithmName(settings.allreduce.algorithm)},
          {"PERSEUS_ALLREDUCE_HOP_LATENCY_US",
           settings.measure_hop_latency
               ? std::string("auto")
               : std::to_string(settings.allreduce.hop_latency_secs * 1e6)},
          {"PERSEUS_ALLREDUCE_LINK_GBIT",
           std::to_string(settings.allreduce.link_bytes_per_sec * 8 / 1e9)}};
}

// Rank 0 gathers every rank's settings that must agree (over the control plane, whose waits name
// a rank that does not answer) and answers with the verdict, the same text for every rank: empty,
// or an error naming each setting that differs and its value on each rank.
Status AgreeOnSettings(Controller* controller, const Settings& settings) {
  const auto mine = SettingsThatMustAgree(settings);
  std::string values;
  for (const auto& [name, value] : mine) values += value + '\n';
  std::vector<std::string> all;
  Status s = controller->GatherToCoordinator(values, &all);
  if (!s.ok()) return s;
  std::string verdict;
  if (controller->rank() == 0) {
    std::vector<std::vector<std::string>> by_rank;
    for (const std::string& text : all) {
      by_rank.emplace_back();
      size_t start = 0;
      for (size_t end; (end = text.find('\n', start)) != std::string::npos; start = end + 1) {
        by_rank.back().push_back(text.substr(start, end - start));
      }
      by_rank.back().resize(mine.size(), "?");
    }
    for (size_t i = 0; i < mine.size(); ++i) {
      std::string differ;
      for (size_t r = 1; r < by_rank.size(); ++r) {
        if (by_rank[r][i] != by_rank[0][i]) {
          differ += ", rank " + std::to_string(r) + " has " + by_rank[r][i];
        }
      }
      if (differ.empty()) continue;
      verdict += (verdict.empty() ? "" : "; ") + mine[i].first +
                 " differs between ranks: rank 0 has " + by_rank[0][i] + differ;
      if (mine[i].first == "PERSEUS_HIERARCHICAL_ALLREDUCE") verdict += " (unset is auto)";
    }
    if (!verdict.empty()) {
      verdict = "perseus_legacy: " + verdict + "; give every rank the same value";
    }
  }
  s = controller->BroadcastFromCoordinator(&verdict);
  // Rank 0 made the verdict: it reports it even when a rank that got it has left already.
  if (controller->rank() == 0 && !verdict.empty()) return Status::Error(verdict);
  if (!s.ok()) return s;
  return verdict.empty() ? Status::OK() : Status::Error(verdict);
}

// PERSEUS_ALLREDUCE_HOP_LATENCY_US=auto. A barrier is BarrierMessages() messages one after
// another (over TCP a gather to rank 0 and its answer; over MPI ceil(log2 n) rounds), each with
// its wake-ups, which is what one step of an allreduce algorithm pays. Rank 0 times
// kLatencyProbes of them and sends the median over that count; every rank takes that value, so
// that all pick the same algorithms. Clamped to 1 us - 1 s.
Status MeasureHopLatency(Controller* controller, double* secs) {
  constexpr int kLatencyProbes = 9;
  std::vector<double> took;
  for (int i = 0; i < kLatencyProbes; ++i) {
    const auto start = std::chrono::steady_clock::now();
    Status s = controller->Barrier();
    if (!s.ok()) return s;
    took.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(took.begin(), took.begin() + kLatencyProbes / 2, took.end());
  std::string value =
      std::to_string(took[kLatencyProbes / 2] / std::max(1, controller->BarrierMessages()));
  Status s = controller->BroadcastFromCoordinator(&value);
  if (!s.ok()) return s;
  char* end = nullptr;
  const double measured = std::strtod(value.c_str(), &end);
  if (end == value.c_str()) {
    return Status::Error("perseus_legacy: malformed step latency from rank 0: \"" + value + "\"");
  }
  *secs = std::min(1.0, std::max(1e-6, measured));
  return Status::OK();
}

class Runtime {
 public:
  Status Init(const std::string& transport, const TransportOptions& options);
  void Shutdown();
  void Abort(const std::string& reason);
  // In the child of a fork(): the background thread and the connections stayed with the parent.
  void AfterFork() {
    if (initialized_) forked_ = true;
  }
  std::vector<Status> EnqueueAll(std::vector<CollectiveRequest> requests);
  Status Join(int* last_joined_rank, const Interrupted& interrupted);
  Status ChangeProcessSet(SetChange kind, const std::vector<int>& ranks, int32_t* id,
                          const Interrupted& interrupted);
  std::vector<std::pair<int32_t, std::vector<int>>> process_sets();
  bool TakePeerJoined() { return peer_joined_.exchange(false); }

  bool initialized() const { return initialized_.load(); }
  int rank() const { return rank_.load(); }
  int size() const { return size_.load(); }
  int local_rank() const { return local_rank_.load(); }
  int local_size() const { return local_size_.load(); }
  int cross_rank() const { return cross_rank_.load(); }
  int cross_size() const { return cross_size_.load(); }
  bool threads_supported() const { return threads_supported_.load(); }
  std::string controller_name() const {
    const Transport* transport = transport_.load();
    return transport ? transport->name : "";
  }
  std::vector<std::pair<std::string, int64_t>> stats() const;
  Status StartTimeline(const std::string& path);
  void StopTimeline() { timeline_.Stop(); }

 private:
  using MessageFor = std::function<std::string(const std::string& name)>;

  // Why `request` cannot run now (a stop, a shutdown), or OK (under mu_).
  Status CheckRunning(const CollectiveRequest& request) const;
  Status AdmitLocked(CollectiveRequest& request);
  // Whether `request` completes on the submitting thread (CompleteOnSingleRank): a job of one
  // rank has nobody to negotiate with, and waking the background thread for a copy costs more
  // than the copy (under mu_).
  bool ShortCut(const CollectiveRequest& request) const;
  // Under init_mu_: stops the background thread and tears the group down.
  void ShutdownLocked();
  // An error unless this process is the one that called init() (not a forked child).
  Status CheckNotForked(const char* what) const;
  // The background thread: LoopRounds, and any exception it throws becomes Fatal.
  void Loop();
  void LoopRounds();
  // This rank cannot go on (an internal error, an exception): every pending and later request
  // fails with `reason`, and the other ranks are told it at once (Controller::Abort).
  void Fatal(const std::string& reason);
  bool DebugFaultHere(DebugFault kind) const {
    return settings_.debug_fault == kind && settings_.debug_fault_rank == rank_.load();
  }
  bool RunRound(const std::vector<std::string>& fresh, RequestList* mine, bool* progressed);
  // The response cache's part of a round; `*full`: a round through the coordinator must follow.
  bool CacheRound(const std::vector<std::string>& fresh, RequestList* mine, bool* progressed,
                  bool* full);
  bool CoordinatorRound(const RequestList& mine, bool* progressed);
  // The cache round's bits, AND-ed over ranks, and its carried allreduces (response_cache.h),
  // through the coordinator.
  Status CarryRound(std::vector<uint64_t>* bits, std::map<size_t, std::string>* carried);
  // Runs one response of a round (ResponseExecutor) and completes this rank's requests in it;
  // `carried`: the result the round carried (an allreduce that then needs no data plane).
  bool Execute(const Response& response, bool from_cache, const std::string* carried = nullptr);
  // Applies a kTune answer (autotune.h) on this rank; false when it is malformed.
  bool ApplyTuning(const Response& response);
  // The values PERSEUS_AUTOTUNE sets, as in force, in the counters of runtime_stats().
  void ShowTuned();
  bool CommunicationFailed(const Status& s, const char* during);
  void Complete(const std::vector<std::string>& names, const Status& status);
  void FinishJoin(const Status& status, int last_joined_rank);
  // Applies an answered process-set change on this rank; false when the transport failed.
  bool ApplySetChange(const Response& response);
  void FinishSetChange(const Status& status, int32_t id);
  // An error unless this rank is in the process set `request` names (under mu_).
  Status CheckProcessSet(const CollectiveRequest& request) const;
  void Stop(const std::string& reason, const MessageFor& message_for);
  void Log(const std::string& text) const;
  // Waits on `cv` (with `lock` on mu_) until `done`, asking `interrupted` (unlocked) every
  // 100 ms; false when it said to stop.
  bool WaitUnlessInterrupted(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                             const std::function<bool()>& done, const Interrupted& interrupted);
  // The timeline's QUEUED and NEGOTIATE events of this rank's `entries` of `response`.
  void RecordNegotiation(const Response& response, const std::vector<CollectiveRequest*>& entries,
                         bool from_cache);

  std::mutex init_mu_;  // serializes Init and Shutdown
  std::atomic<bool> initialized_{false};
  // Which group the current Init formed (its transport and options), so that an Init with a
  // different one is an error rather than a silent no-op.
  std::string group_;
  std::atomic<bool> forked_{false};
  std::atomic<std::thread::id> loop_id_{};  // the background thread's, while one runs
  std::atomic<int> rank_{-1}, size_{-1}, local_rank_{-1}, local_size_{-1};
  std::atomic<int> cross_rank_{-1}, cross_size_{-1};
  std::atomic<bool> threads_supported_{false};
  std::atomic<const Transport*> transport_{nullptr};  // of the current or last Init
  // Set when a collective of this rank ran while another rank had joined; TakePeerJoined resets.
  std::atomic<bool> peer_joined_{false};
  Settings settings_;  // of the current Init
  std::unique_ptr<Controller> controller_;
  std::thread thread_;
  RuntimeStats stats_;  // since the process started; any thread reads them
  Timeline timeline_;

  // Shared between Enqueue callers and the background thread.
  std::mutex mu_;
  std::condition_variable cv_;
  TensorQueue queue_;
  bool shutdown_requested_ = false;
  std::string stopped_reason_;  // set once the background thread has stopped for good
  std::string abort_reason_;    // Abort's, until the background thread has made it Fatal
  std::condition_variable stopped_cv_;  // notified once stopped_reason_ is set
  // join(): kRequested by the caller, kAnnounced once sent to the coordinator, kDone (with
  // join_status_ / join_last_) when every rank has joined or the runtime stopped.
  enum class JoinState { kIdle, kRequested, kAnnounced, kDone };
  JoinState join_state_ = JoinState::kIdle;
  Status join_status_;
  int join_last_ = -1;
  std::condition_variable join_cv_;
  // The registered process sets, by id, each's ranks in order (the background thread changes
  // them, any thread reads them).
  std::map<int32_t, std::vector<int>> sets_;
  // add/remove_process_set: one call at a time (set_change_mu_); the same states as join's.
  std::mutex set_change_mu_;
  JoinState set_change_state_ = JoinState::kIdle;
  SetChange set_change_ = SetChange::kNone;
  std::vector<int64_t> set_change_ranks_;
  int32_t set_change_id_ = 0;
  Status set_change_status_;
  std::condition_variable set_change_cv_;

  // Background thread only.
  bool joined_ = false;  // this rank announced a join that has not finished yet
  AnnouncedTable announced_;
  CacheRounds cache_{0};
  std::unique_ptr<Coordinator> coordinator_;  // rank 0 only
  // The data planes of the process sets this rank belongs to (the global set's is controller_).
  std::map<int32_t, std::unique_ptr<Controller>> set_controllers_;
  FusionBuffer fusion_;
  int64_t round_start_us_ = 0;  // while a timeline runs: when the current round started
  // PERSEUS_AUTOTUNE on rank 0: the search, and the allreduce bytes of the current round.
  std::unique_ptr<Autotuner> tuner_;
  int64_t round_allreduce_bytes_ = 0;
};

// Never destroyed: a background thread still running at exit (no shutdown()) keeps using it.
Runtime& State() {
  static Runtime& state = *new Runtime();
  return state;
}

// Which group Init with these arguments forms, in words (the transport's registration says).
std::string GroupName(const std::string& name, const Transport* transport,
                      const TransportOptions& options) {
  return transport != nullptr && transport->group != nullptr ? transport->group(options) : name;
}

Status Runtime::Init(const std::string& name, const TransportOptions& options) {
  // Before any lock: a forked child may have inherited it locked by a thread it does not have.
  Status s = CheckNotForked("init()");
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> init_lock(init_mu_);
  const Transport* transport = FindTransport(name);
  const std::string group = GroupName(name, transport, options);
  if (initialized_) {
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping = shutdown_requested_;
    }
    if (!stopping) {
      if (group == group_) return Status::OK();
      return Status::Error("perseus_legacy: init() was already called for " + group_ +
                           " on rank " + std::to_string(rank_) + "; this call asks for " + group +
                           ": call shutdown() first to form another group");
    }
    // shutdown() from a done callback only asked the thread to stop: finish it, then start anew.
    ShutdownLocked();
  }
  static const int at_fork = pthread_atfork(nullptr, nullptr, [] { State().AfterFork(); });
  static_cast<void>(at_fork);
  if (transport == nullptr) {
    std::string known;
    for (const Transport& t : RegisteredTransports()) known += (known.empty() ? "" : ", ") + t.name;
    return Status::Error("perseus_legacy: no transport is called \"" + name +
                         "\"; this build registers: " + known);
  }
  if (transport->create == nullptr) {
    return Status::Error("perseus_legacy: this build has no " + transport->label + " transport");
  }
  Settings settings;
  s = ReadSettings(&settings);
  if (!s.ok()) return s;
  std::unique_ptr<Controller> controller;
  s = transport->create(options, &controller);
  if (!s.ok()) return s;
  // Before the agreement, so that a rank lost during it fails the others within the limits.
  controller->SetWaitLimits(settings.stall_warning_secs, settings.stall_shutdown_secs);
  controller->SetAllreducePolicy(settings.allreduce);
  if (settings.debug_fault == DebugFault::kStopAtAgreement &&
      settings.debug_fault_rank == controller->rank()) {
    std::raise(SIGSTOP);
  }
  s = AgreeOnSettings(controller.get(), settings);
  if (!s.ok()) return s;
  if (settings.measure_hop_latency) {
    s = MeasureHopLatency(controller.get(), &settings.allreduce.hop_latency_secs);
    if (!s.ok()) return s;
    controller->SetAllreducePolicy(settings.allreduce);
  }

  settings_ = settings;
  group_ = group;
  peer_joined_ = false;
  controller_ = std::move(controller);
  transport_ = transport;
  rank_ = controller_->rank();
  size_ = controller_->size();
  local_rank_ = controller_->local_rank();
  local_size_ = controller_->local_size();
  cross_rank_ = controller_->cross_rank();
  cross_size_ = controller_->cross_size();
  threads_supported_ = controller_->threads_supported();
  coordinator_.reset();
  if (rank_ == 0) {
    CoordinatorOptions options;
    options.size = size_;
    options.fusion_threshold_bytes = settings_.fusion_threshold_bytes;
    options.stall_warning_secs = settings_.stall_warning_secs;
    options.stall_shutdown_secs = settings_.stall_shutdown_secs;
    coordinator_ = std::make_unique<Coordinator>(options);
  }
  tuner_.reset();
  if (rank_ == 0 && settings_.autotune) {
    tuner_ = std::make_unique<Autotuner>(
        TunedValues{settings_.fusion_threshold_bytes, settings_.cycle_time_ms,
                    settings_.allreduce.hop_latency_secs * 1e6},
        settings_.autotune_cycles_per_sample, settings_.autotune_log);
    if (!tuner_->log_status().ok()) Log("WARNING: " + tuner_->log_status().message());
  }
  RuntimeStats::Set(stats_.autotune_fixed, 0);
  ShowTuned();
  announced_.clear();
  cache_ = CacheRounds(settings_.cache_capacity);
  cache_.set_carried_bytes(settings_.carried_allreduce_bytes);
  joined_ = false;
  timeline_.SetIdentity(rank_, transport->label);
  if (rank_ == 0 && settings_.hierarchical == Hierarchical::kAlways &&
      (controller_->local() == nullptr || controller_->cross() == nullptr)) {
    Log("PERSEUS_HIERARCHICAL_ALLREDUCE=1, but every allreduce runs flat: the hierarchical one "
        "needs several hosts with the same number of ranks, more than one, on each (here " +
        std::to_string(cross_size_) + " host(s), " + std::to_string(local_size_) +
        " rank(s) on rank 0's)");
  }
  if (!settings_.timeline_path.empty()) {
    // Not fatal: the job runs as it would without PERSEUS_TIMELINE, and says why there is none.
    s = timeline_.Start(Timeline::RankedPath(settings_.timeline_path, rank_));
    if (!s.ok()) Log("WARNING: PERSEUS_TIMELINE: " + s.message());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.Clear();
    shutdown_requested_ = false;
    stopped_reason_.clear();
    abort_reason_.clear();
    join_state_ = JoinState::kIdle;
    set_change_state_ = JoinState::kIdle;
    sets_.clear();
    for (int r = 0; r < size_; ++r) sets_[0].push_back(r);
  }
  set_controllers_.clear();
  thread_ = std::thread(&Runtime::Loop, this);
  loop_id_ = thread_.get_id();
  initialized_ = true;
  return Status::OK();
}

Status Runtime::CheckNotForked(const char* what) const {
  if (!forked_) return Status::OK();
  return Status::Error(std::string("perseus_legacy: ") + what + " in a process forked after "
                       "init(): the runtime's background thread and connections stay with the "
                       "parent (rank " + std::to_string(rank_.load()) + "); run collectives in "
                       "the parent, or start the child fresh (multiprocessing's \"spawn\" or "
                       "\"forkserver\") and init() there");
}

void Runtime::Shutdown() {
  if (std::this_thread::get_id() == loop_id_.load()) {
    // Called from a done callback: the thread cannot join itself. Ask it to stop; the next
    // Shutdown() or Init() from another thread (at the latest the shutdown at exit) finishes.
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
    cv_.notify_all();
    return;
  }
  if (forked_) {
    // The thread and the connections are the parent's: leave them alone (closing a socket
    // here would end the parent's connection too).
    return;
  }
  std::lock_guard<std::mutex> init_lock(init_mu_);
  ShutdownLocked();
}

void Runtime::Abort(const std::string& reason) {
  if (forked_ || !initialized_) return;
  std::unique_lock<std::mutex> lock(mu_);
  // Once stopped (a lost peer, a failure of this rank's own, a shutdown), every rank knows why.
  if (shutdown_requested_ || !stopped_reason_.empty() || !abort_reason_.empty()) return;
  abort_reason_ = reason;
  cv_.notify_all();
  // From a done callback the thread takes it up when the callback returns: do not wait on it.
  if (std::this_thread::get_id() == loop_id_.load()) return;
  stopped_cv_.wait_for(lock, kAbortWait, [this] { return !stopped_reason_.empty(); });
}

void Runtime::ShutdownLocked() {
  if (!initialized_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
  }
  cv_.notify_all();
  thread_.join();
  loop_id_ = std::thread::id();
  timeline_.Stop();
  initialized_ = false;
  for (auto* value : {&rank_, &size_, &local_rank_, &local_size_, &cross_rank_, &cross_size_}) {
    *value = -1;
  }
  threads_supported_ = false;
  coordinator_.reset();
  tuner_.reset();
  set_controllers_.clear();  // they may use the controller's connections
  {
    std::lock_guard<std::mutex> lock(mu_);
    sets_.clear();
  }
  controller_.reset();  // frees the communicators; finalizes MPI if Init started it
}

Status Runtime::CheckRunning(const CollectiveRequest& request) const {
  if (!stopped_reason_.empty()) {
    return Status::Error("perseus_legacy: cannot run " + Quoted(request.type, request.name) +
                         ": " + stopped_reason_);
  }
  if (shutdown_requested_) {
    return Status::Error("perseus_legacy: cannot run " + Quoted(request.type, request.name) +
                         ": shutdown() was called on this rank");
  }
  return Status::OK();
}

Status Runtime::AdmitLocked(CollectiveRequest& request) {
  Status s = CheckRunning(request);
  if (s.ok()) s = CheckProcessSet(request);
  return s.ok() ? queue_.Admit(request, rank_) : s;
}

bool Runtime::ShortCut(const CollectiveRequest& request) const {
  // The timeline keeps its phases of every collective: with it on, one rank takes the rounds.
  return size_.load() == 1 && request.process_set_id == 0 && !timeline_.enabled() &&
         CoveredOnSingleRank(request);
}

Status Runtime::CheckProcessSet(const CollectiveRequest& request) const {
  if (request.process_set_id == 0) return Status::OK();
  const std::string what = "perseus_legacy: " + Quoted(request.type, request.name) + " on rank " +
                           std::to_string(rank_) + ": ";
  auto set = sets_.find(request.process_set_id);
  if (set == sets_.end()) {
    return Status::Error(what + "process set " + std::to_string(request.process_set_id) +
                         " is not registered (add_process_set() or init(process_sets=...))");
  }
  if (!std::binary_search(set->second.begin(), set->second.end(), rank_.load())) {
    return Status::Error(what + "this rank is not in process set " +
                         std::to_string(request.process_set_id) + " (ranks " +
                         RankList(set->second) + "); only its ranks may run its collectives");
  }
  return Status::OK();
}

std::vector<std::pair<int32_t, std::vector<int>>> Runtime::process_sets() {
  std::lock_guard<std::mutex> lock(mu_);
  return {sets_.begin(), sets_.end()};
}

bool Runtime::WaitUnlessInterrupted(std::unique_lock<std::mutex>& lock,
                                    std::condition_variable& cv,
                                    const std::function<bool()>& done,
                                    const Interrupted& interrupted) {
  if (!interrupted) {
    cv.wait(lock, done);
    return true;
  }
  while (!cv.wait_for(lock, std::chrono::milliseconds(100), done)) {
    lock.unlock();
    const bool stop = interrupted();
    lock.lock();
    if (stop) return false;
  }
  return true;
}

Status Runtime::ChangeProcessSet(SetChange kind, const std::vector<int>& ranks, int32_t* id,
                                 const Interrupted& interrupted) {
  const char* what = kind == SetChange::kAdd ? "add_process_set()" : "remove_process_set()";
  if (forked_) return CheckNotForked(what);  // before the locks, as in Init
  std::lock_guard<std::mutex> one_at_a_time(set_change_mu_);
  std::unique_lock<std::mutex> lock(mu_);
  if (!initialized_) {
    return Status::Error(std::string("perseus_legacy has not been initialized: call "
                                     "perseus_legacy.init() before ") + what);
  }
  if (!stopped_reason_.empty()) {
    return Status::Error(std::string("perseus_legacy: ") + what + " failed: " + stopped_reason_);
  }
  if (shutdown_requested_) {
    return Status::Error(std::string("perseus_legacy: cannot call ") + what +
                         ": shutdown() was called on rank " + std::to_string(rank_));
  }
  set_change_ = kind;
  set_change_ranks_.assign(ranks.begin(), ranks.end());
  set_change_id_ = *id;
  set_change_state_ = JoinState::kRequested;
  cv_.notify_one();
  if (!WaitUnlessInterrupted(
          lock, set_change_cv_, [this] { return set_change_state_ == JoinState::kDone; },
          interrupted)) {
    return Status::Error(std::string("perseus_legacy: ") + what + " interrupted on rank " +
                         std::to_string(rank_));
  }
  set_change_state_ = JoinState::kIdle;
  *id = set_change_id_;
  return set_change_status_;
}

void Runtime::FinishSetChange(const Status& status, int32_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (set_change_state_ != JoinState::kAnnounced && set_change_state_ != JoinState::kRequested) {
      return;
    }
    set_change_state_ = JoinState::kDone;
    set_change_status_ = status;
    set_change_id_ = id;
  }
  set_change_cv_.notify_all();
}

bool Runtime::ApplySetChange(const Response& response) {
  if (!response.error.empty()) {
    FinishSetChange(Status::Error(response.error, ErrorKind::kMismatch), -1);
    return true;
  }
  const int32_t id = response.process_set_id;
  if (response.type == ResponseType::kProcessSetRemoved) {
    set_controllers_.erase(id);
    std::lock_guard<std::mutex> lock(mu_);
    sets_.erase(id);
  } else {
    const std::vector<int> ranks(response.sizes.begin(), response.sizes.end());
    std::unique_ptr<Controller> set;
    const Status s = controller_->CreateProcessSet(ranks, &set);
    if (CommunicationFailed(s, " while adding a process set")) return false;
    if (set) set_controllers_[id] = std::move(set);
    std::lock_guard<std::mutex> lock(mu_);
    sets_[id] = ranks;
  }
  FinishSetChange(Status::OK(), id);
  return true;
}

std::vector<Status> Runtime::EnqueueAll(std::vector<CollectiveRequest> requests) {
  std::vector<Status> statuses;
  statuses.reserve(requests.size());
  bool admitted = false;
  std::vector<CollectiveRequest*> short_cut;
  const int64_t now_us = timeline_.enabled() ? Timeline::NowMicros() : 0;
  if (forked_) {  // before the lock, as in Init
    for (CollectiveRequest& request : requests) {
      statuses.push_back(CheckNotForked(Quoted(request.type, request.name).c_str()));
    }
    return statuses;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (CollectiveRequest& request : requests) {
      Status s = CheckRequest(request, initialized_);
      const CollectiveType type = request.type;
      const int64_t bytes =
          s.ok() ? NumElements(request.shape) * static_cast<int64_t>(DataTypeSize(request.dtype))
                 : 0;
      request.submitted_us = now_us;
      const bool alone = s.ok() && ShortCut(request);
      if (alone) {
        s = CheckRunning(request);
        if (s.ok()) short_cut.push_back(&request);
      } else if (s.ok()) {
        s = AdmitLocked(request);
        admitted = admitted || s.ok();
      }
      if (s.ok()) stats_.Submitted(type, bytes);
      statuses.push_back(std::move(s));
    }
  }
  if (admitted) cv_.notify_one();
  for (CollectiveRequest* request : short_cut) {
    CompleteOnSingleRank(*request);
    stats_.Executed(request->type);
    RuntimeStats::Add(stats_.single_rank_shortcuts, 1);
    request->done(Status::OK());
  }
  return statuses;
}

Status Runtime::Join(int* last_joined_rank, const Interrupted& interrupted) {
  if (forked_) return CheckNotForked("join()");  // before the lock, as in Init
  std::unique_lock<std::mutex> lock(mu_);
  const std::string on_rank = " on rank " + std::to_string(rank_);
  if (!initialized_) {
    return Status::Error("perseus_legacy has not been initialized: call perseus_legacy.init() "
                         "before join()");
  }
  if (!stopped_reason_.empty()) {
    return Status::Error("perseus_legacy: join() failed: " + stopped_reason_);
  }
  if (shutdown_requested_) {
    return Status::Error("perseus_legacy: cannot join(): shutdown() was called" + on_rank);
  }
  if (join_state_ != JoinState::kIdle) {
    return Status::Error("perseus_legacy: join() is already in progress" + on_rank);
  }
  join_state_ = JoinState::kRequested;
  cv_.notify_one();
  if (!WaitUnlessInterrupted(
          lock, join_cv_, [this] { return join_state_ == JoinState::kDone; }, interrupted)) {
    return Status::Error("perseus_legacy: join() interrupted" + on_rank);
  }
  join_state_ = JoinState::kIdle;
  *last_joined_rank = join_last_;
  return join_status_;
}

void Runtime::FinishJoin(const Status& status, int last_joined_rank) {
  joined_ = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (join_state_ == JoinState::kIdle || join_state_ == JoinState::kDone) return;
    join_state_ = JoinState::kDone;
    join_status_ = status;
    join_last_ = last_joined_rank;
  }
  join_cv_.notify_all();
}

void Runtime::Loop() {
  try {
    LoopRounds();
  } catch (const std::exception& e) {
    Fatal("rank " + std::to_string(rank_) + " failed: an exception on its background thread: " +
          e.what());
  } catch (...) {
    Fatal("rank " + std::to_string(rank_) + " failed: an unknown exception on its background "
          "thread");
  }
}

void Runtime::Fatal(const std::string& reason) {
  Log(reason);
  try {
    controller_->Abort("perseus_legacy: " + reason);
  } catch (...) {
    Log("could not tell the other ranks (a second exception while sending the notice)");
  }
  Stop(reason, [&](const std::string& name) {
    return "perseus_legacy: \"" + name + "\" failed: " + reason;
  });
}

void Runtime::LoopRounds() {
  bool last_round_progressed = false;
  while (true) {
    // Read each round: PERSEUS_AUTOTUNE's answers change it.
    const auto cycle = std::chrono::duration<double, std::milli>(settings_.cycle_time_ms);
    RequestList mine;
    std::vector<std::string> fresh;
    std::string abort_reason;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto has_news = [this] {
        return !queue_.empty() || shutdown_requested_ || !abort_reason_.empty() ||
               join_state_ == JoinState::kRequested || set_change_state_ == JoinState::kRequested;
      };
      // Idle ranks sleep until an arrival (negotiated at once: a lone request must not wait a
      // cycle) or the heartbeat. Ranks with requests outstanding keep joining rounds, since the
      // other ranks' submissions arrive only through rounds: at once after a round in which
      // something happened (the rest of a burst is likely on its way, and a rank that arrives
      // late must not then wait a cycle for the ranks that were early), otherwise paced by the
      // cycle time, which also batches the arrivals in between into one round. A joined rank
      // waits on the others' submissions like a rank with requests outstanding.
      if (!has_news()) {
        if (announced_.empty() && !joined_ && set_change_state_ != JoinState::kAnnounced) {
          cv_.wait_for(lock, kHeartbeat, has_news);
        } else if (!last_round_progressed) {
          cv_.wait_for(lock, cycle, has_news);
        }
      }
      abort_reason = abort_reason_;
      if (abort_reason.empty()) fresh = queue_.AnnounceInto(&announced_);
      if (DebugFaultHere(DebugFault::kException)) {
        for (const std::string& name : fresh) {
          if (name.rfind(kDebugFaultPrefix, 0) == 0) {
            throw std::runtime_error("PERSEUS_DEBUG_FAULT=exception@" + std::to_string(rank_) +
                                     ": thrown on purpose at \"" + name + "\"");
          }
        }
      }
      // After the announcement, so that every request this round settles was submitted before.
      round_start_us_ = timeline_.enabled() ? Timeline::NowMicros() : 0;
      mine.shutting_down = shutdown_requested_;
      if (join_state_ == JoinState::kRequested) {
        join_state_ = JoinState::kAnnounced;
        mine.joined = joined_ = true;
      }
      if (set_change_state_ == JoinState::kRequested) {
        set_change_state_ = JoinState::kAnnounced;
        mine.set_change = set_change_;
        mine.set_ranks = set_change_ranks_;
        mine.set_id = set_change_id_;
      }
    }
    if (!abort_reason.empty()) {
      Fatal(abort_reason);
      return;
    }
    round_allreduce_bytes_ = 0;
    if (!RunRound(fresh, &mine, &last_round_progressed)) return;
    if (tuner_ && round_allreduce_bytes_ > 0) {
      tuner_->Cycle(round_allreduce_bytes_,
                    std::chrono::duration<double>(Clock::now().time_since_epoch()).count());
    }
  }
}

bool Runtime::CommunicationFailed(const Status& s, const char* during) {
  if (s.ok()) return false;
  const std::string reason = "communication failed on rank " + std::to_string(rank_) + during +
                             ": " + s.message();
  // The transport has told the others already when it lost a peer; a failure of this rank's
  // own (a malformed message, bit vectors that do not match) they learn only this way.
  controller_->Abort("perseus_legacy: " + reason);
  Stop(reason, [&](const std::string& name) {
    return "perseus_legacy: \"" + name + "\" failed: " + reason;
  });
  return true;
}

bool Runtime::RunRound(const std::vector<std::string>& fresh, RequestList* mine,
                       bool* progressed) {
  bool full = true;
  if (!cache_.enabled()) {
    for (const std::string& name : fresh) mine->requests.push_back(announced_[name].meta);
  } else if (!CacheRound(fresh, mine, progressed, &full)) {
    return false;
  }
  if (!full) return true;
  bool coordinator_progress = false;
  if (!CoordinatorRound(*mine, &coordinator_progress)) return false;
  *progressed = (cache_.enabled() && *progressed) || coordinator_progress;
  return true;
}

bool Runtime::CacheRound(const std::vector<std::string>& fresh, RequestList* mine,
                         bool* progressed, bool* full) {
  RuntimeStats::Add(stats_.cache_rounds, 1);
  const bool busy_coordinator = coordinator_ && coordinator_->has_pending();
  std::vector<uint64_t> bits = cache_.Offer(
      fresh, &announced_,
      mine->shutting_down || mine->joined || mine->set_change != SetChange::kNone ||
          busy_coordinator || (tuner_ && tuner_->has_change()),
      joined_);
  if (DebugFaultHere(DebugFault::kBitVector) &&
      std::any_of(fresh.begin(), fresh.end(), [](const std::string& name) {
        return name.rfind(kDebugFaultPrefix, 0) == 0;
      })) {
    bits.push_back(~uint64_t{0});
  }
  std::map<size_t, std::string> carried;
  if (CommunicationFailed(CarryRound(&bits, &carried), " while negotiating")) return false;
  CacheRounds::Outcome outcome = cache_.Settle(bits, &announced_, settings_.fusion_threshold_bytes,
                                               mine, std::move(carried));
  *full = outcome.full;
  *progressed = outcome.progressed;
  RuntimeStats::Add(stats_.cache_hits, outcome.hits);
  RuntimeStats::Add(stats_.cache_misses, outcome.misses);
  RuntimeStats::Add(stats_.cache_invalidations, outcome.invalidated);
  RuntimeStats::Add(stats_.carried_allreduces, static_cast<int64_t>(outcome.carried.size()));
  for (const auto& [response, result] : outcome.carried) {
    if (!Execute(response, /*from_cache=*/true, &result)) return false;
  }
  for (const Response& response : outcome.ready) {
    if (!Execute(response, /*from_cache=*/true)) return false;
  }
  return true;
}

Status Runtime::CarryRound(std::vector<uint64_t>* bits, std::map<size_t, std::string>* carried) {
  std::vector<std::string> all;
  Status s = controller_->GatherToCoordinator(cache_.Encode(*bits, announced_), &all);
  std::string answer;
  // A failure of rank 0's own reaches the others through CommunicationFailed's abort notice.
  if (s.ok() && rank_ == 0) s = cache_.Combine(all, &answer);
  if (s.ok()) s = controller_->BroadcastFromCoordinator(&answer);
  if (s.ok()) s = cache_.Decode(answer, bits, carried);
  return s;
}

bool Runtime::CoordinatorRound(const RequestList& mine, bool* progressed) {
  RuntimeStats::Add(stats_.coordinator_rounds, 1);
  std::vector<std::string> gathered;
  Status s = controller_->GatherToCoordinator(Serialize(mine), &gathered);
  std::string answer;
  bool final_answer = false;  // rank 0: the answer ends the runtime (a shutdown, a fatal error)
  if (s.ok() && coordinator_) {
    std::string warning;
    ResponseList plan = coordinator_->Answer(gathered, &warning);
    // After the answer's collectives, which the coordinator fused with the values in force.
    if (tuner_ && tuner_->has_change()) plan.responses.push_back(tuner_->TakeChange());
    if (!warning.empty()) {
      RuntimeStats::Add(stats_.stall_warnings, 1);
      Log(warning);
    }
    answer = Serialize(plan);
    for (const Response& response : plan.responses) {
      final_answer = final_answer || response.type == ResponseType::kShutdown ||
                     response.type == ResponseType::kFatal;
    }
  }
  if (s.ok()) s = controller_->BroadcastFromCoordinator(&answer);
  // Ranks that received a final answer may exit at once, which the broadcast to the others can
  // then see as a lost connection; the answer itself is still the reason to report.
  if (!s.ok() && final_answer) s = Status::OK();
  ResponseList plan;
  if (s.ok() && !Deserialize(answer, &plan)) {
    s = Status::Error("malformed answer from the coordinator");
  }
  if (CommunicationFailed(s, " while negotiating")) return false;

  *progressed = plan.progress;
  for (const Response& response : plan.responses) {
    switch (response.type) {
      case ResponseType::kShutdown: {
        const std::string who = response.error;
        Stop(who + " shut down (it exited or called shutdown()); no collective can run after "
                   "that",
             [&](const std::string& name) {
               return "perseus_legacy: " + who + " shut down while \"" + name +
                      "\" was pending on this rank (it exited or called shutdown())";
             });
        return false;
      }
      case ResponseType::kFatal:
        Stop(response.error, [&](const std::string&) { return response.error; });
        return false;
      case ResponseType::kJoin:
        FinishJoin(Status::OK(), response.root_rank);
        break;
      case ResponseType::kProcessSetAdded:
      case ResponseType::kProcessSetRemoved:
        if (!ApplySetChange(response)) return false;
        break;
      case ResponseType::kTune:
        if (!ApplyTuning(response)) return false;
        break;
      case ResponseType::kError: {
        std::vector<std::string> mine_failed;
        for (const std::string& name : response.names) {
          if (announced_.count(name)) mine_failed.push_back(name);
        }
        Complete(mine_failed, Status::Error(response.error, ErrorKind::kMismatch));
        break;
      }
      case ResponseType::kAllreduce:
      case ResponseType::kAllgather:
      case ResponseType::kBroadcast:
      case ResponseType::kAlltoall:
        if (!Execute(response, /*from_cache=*/false)) return false;
        break;
    }
  }
  return true;
}

bool Runtime::Execute(const Response& response, bool from_cache, const std::string* carried) {
  Controller* controller = controller_.get();
  if (response.process_set_id != 0) {
    auto set = set_controllers_.find(response.process_set_id);
    if (set == set_controllers_.end()) return true;  // not in the set: nothing to do here
    controller = set->second.get();
  }
  const bool without_data = std::find(response.joined_ranks.begin(), response.joined_ranks.end(),
                                      rank_.load()) != response.joined_ranks.end();
  std::vector<CollectiveRequest*> entries;
  for (const std::string& name : response.names) {
    if (without_data) break;
    const bool lose = DebugFaultHere(DebugFault::kInternal) &&
                      name.rfind(kDebugFaultPrefix, 0) == 0;
    auto it = lose ? announced_.end() : announced_.find(name);
    if (it == announced_.end()) {
      Fatal("internal error on rank " + std::to_string(rank_) +
            ": the coordinator scheduled \"" + name + "\", which rank " +
            std::to_string(rank_) + " never submitted");
      return false;
    }
    entries.push_back(&it->second.request);
  }

  if (timeline_.enabled()) RecordNegotiation(response, entries, from_cache);
  if (tuner_ && response.type == ResponseType::kAllreduce) {
    const int64_t item = static_cast<int64_t>(DataTypeSize(response.dtype));
    for (const CollectiveRequest* e : entries) {
      round_allreduce_bytes_ += NumElements(e->shape) * item;
    }
  }
  Status op;
  const Status comm =
      ResponseExecutor(controller, settings_.hierarchical,
                       OwnCollectiveBytes(controller->size(), settings_.allreduce), &fusion_,
                       &stats_, &timeline_, carried)
          .Run(response, entries, &op);
  if (CommunicationFailed(comm, "")) return false;
  if (!from_cache && response.joined_ranks.empty() && response.process_set_id == 0) {
    // Every rank executed it with its own data. Other process sets' collectives always go
    // through the coordinator: the cache's bit vector is an AND over every rank.
    RuntimeStats::Add(stats_.cache_evictions, cache_.Remember(response, &announced_));
  }
  if (!without_data) {
    if (!response.joined_ranks.empty()) peer_joined_ = true;  // before the op's done callback
    Complete(response.names, op);
  }
  return true;
}

bool Runtime::ApplyTuning(const Response& response) {
  TunedValues values;
  bool final = false;
  if (!TunedFrom(response, &values, &final)) {
    Fatal("internal error on rank " + std::to_string(rank_) +
          ": a malformed PERSEUS_AUTOTUNE answer from the coordinator");
    return false;
  }
  // Every rank applies it after the same collectives of the same answer: the next cache round
  // fuses with the same threshold everywhere.
  settings_.fusion_threshold_bytes = values.fusion_threshold_bytes;
  settings_.cycle_time_ms = values.cycle_time_ms;
  settings_.allreduce.hop_latency_secs = values.hop_latency_us * 1e-6;
  if (coordinator_) coordinator_->set_fusion_threshold(values.fusion_threshold_bytes);
  // The algorithm of each later allreduce, on every data plane (sets' copies included).
  controller_->SetAllreducePolicy(settings_.allreduce);
  for (auto& [id, set] : set_controllers_) set->SetAllreducePolicy(settings_.allreduce);
  RuntimeStats::Add(stats_.autotune_changes, 1);
  if (final) RuntimeStats::Set(stats_.autotune_fixed, 1);
  ShowTuned();
  if (tuner_) {
    const std::string chosen = tuner_->Applied();
    if (!chosen.empty()) Log(chosen);
  }
  return true;
}

void Runtime::ShowTuned() {
  RuntimeStats::Set(stats_.fusion_threshold_bytes, settings_.fusion_threshold_bytes);
  RuntimeStats::Set(stats_.cycle_time_us,
                    static_cast<int64_t>(std::llround(settings_.cycle_time_ms * 1000)));
  const double latency_ns = settings_.allreduce.hop_latency_secs * 1e9;
  RuntimeStats::Set(stats_.hop_latency_ns, static_cast<int64_t>(std::llround(latency_ns)));
}

void Runtime::Complete(const std::vector<std::string>& names, const Status& status) {
  {
    // Released before `done` runs, so a callback may submit the same name again at once.
    std::lock_guard<std::mutex> lock(mu_);
    queue_.Release(names);
  }
  for (const std::string& name : names) {
    auto node = announced_.extract(name);
    if (node.empty()) continue;
    const bool timed = timeline_.enabled();
    const int64_t start = timed ? Timeline::NowMicros() : 0;
    node.mapped().request.done(status);
    if (timed) timeline_.Record(name, "CALLBACK", start, Timeline::NowMicros());
  }
}

void Runtime::RecordNegotiation(const Response& response,
                                const std::vector<CollectiveRequest*>& entries,
                                bool from_cache) {
  const int64_t now = Timeline::NowMicros();
  const int64_t round_start = round_start_us_ ? round_start_us_ : now;
  for (const CollectiveRequest* e : entries) {
    if (e->submitted_us != 0) {  // submitted while the timeline ran
      std::string args;
      if (coordinator_ && !from_cache) {
        auto late = coordinator_->late_ranks().find(e->name);
        if (late != coordinator_->late_ranks().end()) {
          args = "\"late_ranks\":" + RankList(late->second);
        }
      }
      timeline_.Record(e->name, "QUEUED", e->submitted_us, round_start, std::move(args));
    }
    timeline_.Record(e->name, "NEGOTIATE", round_start, now,
                     std::string("\"cache_hit\":") + (from_cache ? "true" : "false"));
  }
}

void Runtime::Stop(const std::string& reason, const MessageFor& message_for) {
  std::deque<CollectiveRequest> queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_reason_ = reason;
    queued = queue_.TakeAll();
  }
  stopped_cv_.notify_all();
  for (auto& [name, a] : announced_) a.request.done(Status::Error(message_for(name)));
  announced_.clear();
  cache_.ForgetWaiting();
  for (CollectiveRequest& request : queued) request.done(Status::Error(message_for(request.name)));
  FinishJoin(Status::Error("perseus_legacy: join() failed: " + reason), -1);
  FinishSetChange(Status::Error("perseus_legacy: the process-set change failed: " + reason), -1);
}

std::vector<std::pair<std::string, int64_t>> Runtime::stats() const {
  std::vector<std::pair<std::string, int64_t>> all = stats_.Snapshot();
  all.emplace_back("timeline_events_dropped", timeline_.dropped());
  return all;
}

Status Runtime::StartTimeline(const std::string& path) {
  std::lock_guard<std::mutex> init_lock(init_mu_);
  if (!initialized_) {
    return Status::Error("perseus_legacy has not been initialized: call perseus_legacy.init() "
                         "before start_timeline()");
  }
  return timeline_.Start(Timeline::RankedPath(path, rank_));
}

void Runtime::Log(const std::string& text) const {
  std::fprintf(stderr, "perseus_legacy[rank %d]: %s\n", rank_.load(), text.c_str());
  std::fflush(stderr);
}

}  // namespace

Status Init(const std::string& transport, const TransportOptions& options) {
  return State().Init(transport, options);
}
void Shutdown() { State().Shutdown(); }
void Abort(const std::string& reason) { State().Abort(reason); }
bool IsInitialized() { return State().initialized(); }
int Rank() { return State().rank(); }
int Size() { return State().size(); }
int LocalRank() { return State().local_rank(); }
int LocalSize() { return State().local_size(); }
int CrossRank() { return State().cross_rank(); }
int CrossSize() { return State().cross_size(); }
bool MpiThreadsSupported() { return State().threads_supported(); }
std::string ControllerName() { return State().controller_name(); }
Status Enqueue(CollectiveRequest request) {
  std::vector<CollectiveRequest> one;
  one.push_back(std::move(request));
  return State().EnqueueAll(std::move(one)).front();
}
std::vector<Status> EnqueueAll(std::vector<CollectiveRequest> requests) {
  return State().EnqueueAll(std::move(requests));
}
Status Join(int* last_joined_rank, const Interrupted& interrupted) {
  return State().Join(last_joined_rank, interrupted);
}
Status AddProcessSet(const std::vector<int>& ranks, int32_t* id, const Interrupted& interrupted) {
  *id = 0;
  return State().ChangeProcessSet(SetChange::kAdd, ranks, id, interrupted);
}
Status RemoveProcessSet(int32_t id, const Interrupted& interrupted) {
  return State().ChangeProcessSet(SetChange::kRemove, {}, &id, interrupted);
}
std::vector<std::pair<int32_t, std::vector<int>>> ProcessSets() {
  return State().process_sets();
}
std::vector<std::pair<std::string, int64_t>> RuntimeStatsSnapshot() { return State().stats(); }
Status StartTimeline(const std::string& path) { return State().StartTimeline(path); }
void StopTimeline() { State().StopTimeline(); }
bool TakePeerJoined() { return State().TakePeerJoined(); }

}  // namespace perseus
