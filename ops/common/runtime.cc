// The runtime's one state object and its background thread. The thread makes every transport
// call: it negotiates rounds with the coordinator and executes the answers in order.
#include "runtime.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "controller.h"
#include "fusion_buffer.h"
#include "message.h"
#include "mpi_controller.h"
#include "reduce.h"
#include "tcp_controller.h"

namespace perseus {
namespace {

// How long an idle rank sleeps before joining a round anyway, so that a peer's shutdown and the
// coordinator's stall checks never wait on a rank that has nothing to submit.
constexpr auto kHeartbeat = std::chrono::seconds(1);
// How long a request waits on the response cache for the other ranks before it goes through the
// coordinator instead, whose stall checks then see it.
constexpr auto kCacheWaitLimit = std::chrono::seconds(1);
// An allreduce tensor at least this large runs as a collective of its own, where it lies, even
// when negotiated together with others: staging it through the fusion buffer would copy it in
// and out, which costs more than one more collective's start-up.
constexpr int64_t kOwnCollectiveBytes = int64_t{256} << 10;

// Flags of the first word of a round's bit vector: AND-ed over ranks, so each is set only when
// it holds on every rank.
constexpr uint64_t kNothingForCoordinator = 1;  // no new, changed or long-waiting requests
constexpr uint64_t kNoRankJoined = 2;
constexpr uint64_t kNothingNew = 4;             // no request arrived since the last round

// PERSEUS_* settings, read once by Init (defaults are in the README's table).
struct Config {
  int64_t fusion_threshold_bytes = int64_t{64} << 20;  // PERSEUS_FUSION_THRESHOLD
  double cycle_time_ms = 1.0;                           // PERSEUS_CYCLE_TIME
  double stall_warning_secs = 60.0;                     // PERSEUS_STALL_WARNING_SECS
  double stall_shutdown_secs = 0.0;                     // PERSEUS_STALL_SHUTDOWN_SECS
  double cache_capacity = 1024;                         // PERSEUS_CACHE_CAPACITY
};

Status ReadNumber(const char* name, double* value) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return Status::OK();
  char* end = nullptr;
  errno = 0;
  const double parsed = std::strtod(text, &end);
  if (end == text || *end != '\0' || errno != 0 || !std::isfinite(parsed) || parsed < 0) {
    return Status::Error(std::string("perseus_legacy: ") + name + "=\"" + text +
                         "\" is not a non-negative number");
  }
  *value = parsed;
  return Status::OK();
}

Status ReadConfig(Config* config) {
  double fusion = static_cast<double>(config->fusion_threshold_bytes);
  Status s = ReadNumber("PERSEUS_FUSION_THRESHOLD", &fusion);
  if (s.ok()) s = ReadNumber("PERSEUS_CYCLE_TIME", &config->cycle_time_ms);
  if (s.ok()) s = ReadNumber("PERSEUS_STALL_WARNING_SECS", &config->stall_warning_secs);
  if (s.ok()) s = ReadNumber("PERSEUS_STALL_SHUTDOWN_SECS", &config->stall_shutdown_secs);
  if (s.ok()) s = ReadNumber("PERSEUS_CACHE_CAPACITY", &config->cache_capacity);
  config->fusion_threshold_bytes = static_cast<int64_t>(fusion);
  return s;
}

RequestMeta MetaOf(const CollectiveRequest& request) {
  RequestMeta meta;
  meta.name = request.name;
  meta.type = request.type;
  meta.dtype = request.dtype;
  meta.reduce_op = request.reduce_op;
  meta.root_rank = request.root_rank;
  meta.prescale_factor = request.prescale_factor;
  meta.postscale_factor = request.postscale_factor;
  meta.shape = request.shape;
  meta.splits = request.splits;
  return meta;
}

std::string Quoted(const CollectiveRequest& request) {
  return std::string(CollectiveTypeName(request.type)) + " \"" + request.name + "\"";
}

void CopyBytes(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
}

// What a joined rank contributes to an allreduce: the identity of `op`, so the result is the
// reduction over the ranks that have data.
void FillIdentity(DataType dtype, ReduceOp op, void* data, int64_t count) {
  DispatchDataType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using Acc = typename Arith<T>::Acc;
    using Limits = std::numeric_limits<Acc>;
    Acc value = 0;
    if (op == ReduceOp::kProduct) value = 1;
    if (op == ReduceOp::kMin) value = Limits::has_infinity ? Limits::infinity() : Limits::max();
    if (op == ReduceOp::kMax) value = Limits::has_infinity ? -Limits::infinity() : Limits::lowest();
    std::fill_n(static_cast<T*>(data), count, Arith<T>::Store(value));
  });
}

class Runtime {
 public:
  ~Runtime() {
    // Reached at process exit without shutdown(): the thread may still be inside the transport,
    // so leave it and the controller alone rather than tear them down under it.
    if (thread_.joinable()) {
      thread_.detach();
      static_cast<void>(controller_.release());
    }
  }

  Status Init(intptr_t comm_handle, const TcpOptions* tcp = nullptr);
  void Shutdown();
  std::vector<Status> EnqueueAll(std::vector<CollectiveRequest> requests);
  Status Join(int* last_joined_rank);
  bool TakePeerJoined() { return peer_joined_.exchange(false); }

  bool initialized() const { return initialized_.load(); }
  int rank() const { return rank_.load(); }
  int size() const { return size_.load(); }
  int local_rank() const { return local_rank_.load(); }
  int local_size() const { return local_size_.load(); }
  int cross_rank() const { return cross_rank_.load(); }
  int cross_size() const { return cross_size_.load(); }
  bool threads_supported() const { return threads_supported_.load(); }
  std::string controller_name() const { return tcp_ ? "tcp" : "mpi"; }

 private:
  using MessageFor = std::function<std::string(const std::string& name)>;

  Status CheckRequest(const CollectiveRequest& request) const;
  Status AdmitLocked(CollectiveRequest& request);
  void Loop();
  // A request this rank announced, with its metadata and where it waits for the other ranks.
  struct Announced {
    CollectiveRequest request;
    RequestMeta meta;
    bool cached = false;  // waits on the response cache, not in the coordinator's table
    Clock::time_point cached_since;
  };

  bool RunRound(const std::vector<std::string>& fresh, RequestList* mine, bool* progressed);
  // The response cache's part of a round; `*full`: a round through the coordinator must follow.
  bool CacheRound(const std::vector<std::string>& fresh, RequestList* mine, bool* progressed,
                  bool* full);
  bool CoordinatorRound(const RequestList& mine, bool* progressed);
  bool Execute(const Response& response, bool from_cache);
  bool CommunicationFailed(const Status& s, const char* during);
  // Each returns the transport's status (a failure stops the runtime). Those that ask the
  // framework for an output set `op` to the status the request completes with. No entries
  // (a null entry): this rank has joined and takes part without data.
  Status RunAllreduce(const Response& response, const std::vector<CollectiveRequest*>& entries);
  // The tensors `group` of `entries`, `total` elements, reduced together in the fusion buffer.
  Status RunFusedAllreduce(const Response& response,
                           const std::vector<CollectiveRequest*>& entries,
                           const std::vector<size_t>& group, int64_t total, double prescale,
                           int64_t divisor, double postscale);
  Status RunAllgather(const Response& response, CollectiveRequest* entry, Status* op);
  Status RunBroadcast(const Response& response, CollectiveRequest* entry);
  Status RunAlltoall(const Response& response, CollectiveRequest& entry, Status* op);
  void* Scratch(size_t bytes, Status* op, Status* comm);
  void Complete(const std::vector<std::string>& names, const Status& status);
  void FinishJoin(const Status& status, int last_joined_rank);
  void Stop(const std::string& reason, const MessageFor& message_for);
  void Log(const std::string& text) const;

  std::mutex init_mu_;  // serializes Init and Shutdown
  std::atomic<bool> initialized_{false};
  std::atomic<int> rank_{-1}, size_{-1}, local_rank_{-1}, local_size_{-1};
  std::atomic<int> cross_rank_{-1}, cross_size_{-1};
  std::atomic<bool> threads_supported_{false};
  std::atomic<bool> tcp_{false};
  // Set when a collective of this rank ran while another rank had joined; TakePeerJoined resets.
  std::atomic<bool> peer_joined_{false};
  Config config_;
  std::unique_ptr<Controller> controller_;
  std::thread thread_;

  // Shared between Enqueue callers and the background thread.
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<CollectiveRequest> queue_;          // arrived, not yet announced
  std::unordered_set<std::string> pending_names_;  // queued or announced, not yet done
  bool shutdown_requested_ = false;
  std::string stopped_reason_;  // set once the background thread has stopped for good
  // join(): kRequested by the caller, kAnnounced once sent to the coordinator, kDone (with
  // join_status_ / join_last_) when every rank has joined or the runtime stopped.
  enum class JoinState { kIdle, kRequested, kAnnounced, kDone };
  JoinState join_state_ = JoinState::kIdle;
  Status join_status_;
  int join_last_ = -1;
  std::condition_variable join_cv_;

  // Background thread only.
  bool joined_ = false;  // this rank announced a join that has not finished yet
  std::unordered_map<std::string, Announced> announced_;
  std::vector<std::string> cached_;  // names of announced_ waiting on the cache, in arrival order
  ResponseCache cache_{0};
  std::unique_ptr<Coordinator> coordinator_;  // rank 0 only
  FusionBuffer fusion_;
};

Runtime& State() {
  static Runtime state;
  return state;
}

Status Runtime::Init(intptr_t comm_handle, const TcpOptions* tcp) {
  std::lock_guard<std::mutex> init_lock(init_mu_);
  if (initialized_) return Status::OK();
  Config config;
  Status s = ReadConfig(&config);
  if (!s.ok()) return s;
  std::unique_ptr<Controller> controller;
  s = tcp ? TcpController::Create(*tcp, &controller)
          : MpiController::Create(comm_handle, &controller);
  if (!s.ok()) return s;

  config_ = config;
  peer_joined_ = false;
  controller_ = std::move(controller);
  tcp_ = tcp != nullptr;
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
    options.fusion_threshold_bytes = config_.fusion_threshold_bytes;
    options.stall_warning_secs = config_.stall_warning_secs;
    options.stall_shutdown_secs = config_.stall_shutdown_secs;
    coordinator_ = std::make_unique<Coordinator>(options);
  }
  announced_.clear();
  cached_.clear();
  cache_ = ResponseCache(static_cast<size_t>(config_.cache_capacity));
  joined_ = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.clear();
    pending_names_.clear();
    shutdown_requested_ = false;
    stopped_reason_.clear();
    join_state_ = JoinState::kIdle;
  }
  thread_ = std::thread(&Runtime::Loop, this);
  initialized_ = true;
  return Status::OK();
}

void Runtime::Shutdown() {
  if (std::this_thread::get_id() == thread_.get_id()) {
    // Called from a done callback: the thread cannot join itself. Ask it to stop; the next
    // Shutdown() from another thread (at the latest the one at exit) finishes the job.
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
    return;
  }
  std::lock_guard<std::mutex> init_lock(init_mu_);
  if (!initialized_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
  }
  cv_.notify_all();
  thread_.join();
  initialized_ = false;
  for (auto* value : {&rank_, &size_, &local_rank_, &local_size_, &cross_rank_, &cross_size_}) {
    *value = -1;
  }
  threads_supported_ = false;
  coordinator_.reset();
  controller_.reset();  // frees the communicators; finalizes MPI if Init started it
}

Status Runtime::CheckRequest(const CollectiveRequest& request) const {
  if (!initialized_) {
    return Status::Error("perseus_legacy has not been initialized: call perseus_legacy.init() "
                         "before " + Quoted(request));
  }
  if (request.name.empty()) {
    return Status::Error(std::string("perseus_legacy: ") + CollectiveTypeName(request.type) +
                         " needs a non-empty name, identical on every rank");
  }
  if (!request.done) {
    return Status::Error("perseus_legacy: " + Quoted(request) + " has no done callback");
  }
  const bool allocates = request.type == CollectiveType::kAllgather ||
                         request.type == CollectiveType::kAlltoall;
  if (allocates && !request.allocate_output) {
    return Status::Error("perseus_legacy: " + Quoted(request) + " has no output allocator");
  }
  return Status::OK();
}

Status Runtime::AdmitLocked(CollectiveRequest& request) {
  if (!stopped_reason_.empty()) {
    return Status::Error("perseus_legacy: cannot run " + Quoted(request) + ": " +
                         stopped_reason_);
  }
  if (shutdown_requested_) {
    return Status::Error("perseus_legacy: cannot run " + Quoted(request) +
                         ": shutdown() was called on this rank");
  }
  if (!pending_names_.insert(request.name).second) {
    return Status::Error("perseus_legacy: " + Quoted(request) + ": a collective named \"" +
                         request.name + "\" is already pending on rank " +
                         std::to_string(rank_) +
                         "; names must be unique among the collectives in flight");
  }
  queue_.push_back(std::move(request));
  return Status::OK();
}

std::vector<Status> Runtime::EnqueueAll(std::vector<CollectiveRequest> requests) {
  std::vector<Status> statuses;
  statuses.reserve(requests.size());
  bool admitted = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (CollectiveRequest& request : requests) {
      Status s = CheckRequest(request);
      if (s.ok()) s = AdmitLocked(request);
      admitted = admitted || s.ok();
      statuses.push_back(std::move(s));
    }
  }
  if (admitted) cv_.notify_one();
  return statuses;
}

Status Runtime::Join(int* last_joined_rank) {
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
  join_cv_.wait(lock, [this] { return join_state_ == JoinState::kDone; });
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
  const auto cycle = std::chrono::duration<double, std::milli>(config_.cycle_time_ms);
  bool last_round_progressed = false;
  while (true) {
    RequestList mine;
    std::vector<std::string> fresh;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto has_news = [this] {
        return !queue_.empty() || shutdown_requested_ || join_state_ == JoinState::kRequested;
      };
      // Idle ranks sleep until an arrival (negotiated at once: a lone request must not wait a
      // cycle) or the heartbeat. Ranks with requests outstanding keep joining rounds, since the
      // other ranks' submissions arrive only through rounds: at once after a round in which
      // something happened (the rest of a burst is likely on its way, and a rank that arrives
      // late must not then wait a cycle for the ranks that were early), otherwise paced by the
      // cycle time, which also batches the arrivals in between into one round. A joined rank
      // waits on the others' submissions like a rank with requests outstanding.
      if (!has_news()) {
        if (announced_.empty() && !joined_) {
          cv_.wait_for(lock, kHeartbeat, has_news);
        } else if (!last_round_progressed) {
          cv_.wait_for(lock, cycle, has_news);
        }
      }
      for (CollectiveRequest& request : queue_) {
        fresh.push_back(request.name);
        Announced& a = announced_[request.name];
        a.meta = MetaOf(request);
        a.request = std::move(request);
      }
      queue_.clear();
      mine.shutting_down = shutdown_requested_;
      if (join_state_ == JoinState::kRequested) {
        join_state_ = JoinState::kAnnounced;
        mine.joined = joined_ = true;
      }
    }
    if (!RunRound(fresh, &mine, &last_round_progressed)) return;
  }
}

bool Runtime::CommunicationFailed(const Status& s, const char* during) {
  if (s.ok()) return false;
  const std::string reason = "communication failed on rank " + std::to_string(rank_) + during +
                             ": " + s.message();
  Stop(reason, [&](const std::string& name) {
    return "perseus_legacy: \"" + name + "\" failed: " + reason;
  });
  return true;
}

bool Runtime::RunRound(const std::vector<std::string>& fresh, RequestList* mine,
                       bool* progressed) {
  bool full = true;
  if (cache_.capacity() == 0) {
    for (const std::string& name : fresh) mine->requests.push_back(announced_[name].meta);
  } else if (!CacheRound(fresh, mine, progressed, &full)) {
    return false;
  }
  if (!full) return true;
  bool coordinator_progress = false;
  if (!CoordinatorRound(*mine, &coordinator_progress)) return false;
  *progressed = (cache_.capacity() > 0 && *progressed) || coordinator_progress;
  return true;
}

bool Runtime::CacheRound(const std::vector<std::string>& fresh, RequestList* mine,
                         bool* progressed, bool* full) {
  const size_t slots = cache_.slots();
  const size_t words = (slots + 63) / 64;
  // [flags][a bit per slot: submitted with unchanged metadata][a bit per slot: still valid]
  std::vector<uint64_t> bits(1 + 2 * words, 0);
  std::fill(bits.begin() + 1 + words, bits.end(), ~uint64_t{0});
  const auto now = Clock::now();
  std::vector<std::string> to_coordinator, waiting;
  auto classify = [&](const std::string& name) {
    Announced& a = announced_[name];
    const int64_t slot = cache_.Find(name);
    const bool fresh_hit = slot != ResponseCache::kMiss && !a.cached && cache_.mine(slot) == a.meta;
    const bool waited = a.cached && now - a.cached_since > kCacheWaitLimit;
    if (slot != ResponseCache::kMiss && ((!a.cached && !fresh_hit) || waited)) {
      // Changed metadata, or waited too long: every rank drops the entry and sends its
      // request for this name through the coordinator.
      bits[1 + words + slot / 64] &= ~(uint64_t{1} << (slot % 64));
    } else if (slot != ResponseCache::kMiss) {
      if (!a.cached) a.cached_since = now;
      a.cached = true;
      bits[1 + slot / 64] |= uint64_t{1} << (slot % 64);
      waiting.push_back(name);
      return;
    }
    a.cached = false;
    to_coordinator.push_back(name);
  };
  for (const std::string& name : cached_) classify(name);
  for (const std::string& name : fresh) classify(name);
  const bool busy_coordinator = coordinator_ && coordinator_->has_pending();
  if (to_coordinator.empty() && !mine->shutting_down && !mine->joined && !busy_coordinator) {
    bits[0] |= kNothingForCoordinator;
  }
  if (!joined_) bits[0] |= kNoRankJoined;
  if (fresh.empty()) bits[0] |= kNothingNew;

  if (CommunicationFailed(controller_->AllreduceBitsAnd(&bits), " while negotiating")) {
    return false;
  }
  const bool no_rank_joined = (bits[0] & kNoRankJoined) != 0;
  *full = !(bits[0] & kNothingForCoordinator) || !no_rank_joined;
  *progressed = !(bits[0] & kNothingNew);

  // Slots that are ready on every rank run now, in slot order, fused as the coordinator would.
  std::vector<Response> ready;
  ResponseFuser fuser(config_.fusion_threshold_bytes, &ready);
  std::vector<size_t> invalid;
  for (size_t slot = 0; slot < slots; ++slot) {
    const uint64_t mask = uint64_t{1} << (slot % 64);
    if (!(bits[1 + words + slot / 64] & mask)) {
      invalid.push_back(slot);
    } else if (bits[1 + slot / 64] & mask) {
      const RequestMeta& meta = cache_.mine(slot);
      cache_.Touch(slot);
      fuser.Add(cache_.response(slot),
                NumElements(meta.shape) * static_cast<int64_t>(DataTypeSize(meta.dtype)));
    }
  }
  cached_.clear();
  for (const std::string& name : waiting) {
    Announced& a = announced_[name];
    const int64_t slot = cache_.Find(name);
    const uint64_t mask = uint64_t{1} << (slot % 64);
    if (bits[1 + slot / 64] & mask) continue;  // ready: runs below
    if (!no_rank_joined || !(bits[1 + words + slot / 64] & mask)) {
      // The coordinator must see it: it counts joined ranks, or the slot is being dropped.
      a.cached = false;
      to_coordinator.push_back(name);
    } else {
      cached_.push_back(name);
    }
  }
  for (size_t slot : invalid) cache_.Erase(slot);
  for (const std::string& name : to_coordinator) mine->requests.push_back(announced_[name].meta);
  if (!ready.empty()) *progressed = true;
  for (const Response& response : ready) {
    if (!Execute(response, /*from_cache=*/true)) return false;
  }
  return true;
}

bool Runtime::CoordinatorRound(const RequestList& mine, bool* progressed) {
  std::vector<std::string> gathered;
  Status s = controller_->GatherToCoordinator(Serialize(mine), &gathered);
  std::string answer;
  bool final_answer = false;  // rank 0: the answer ends the runtime (a shutdown, a fatal error)
  if (s.ok() && coordinator_) {
    const auto now = Clock::now();
    ResponseList plan;
    for (int r = 0; r < size_; ++r) {
      RequestList list;
      if (!Deserialize(gathered[r], &list)) {
        Response fatal;
        fatal.type = ResponseType::kFatal;
        fatal.error = "perseus_legacy: the coordinator received a malformed message from rank " +
                      std::to_string(r);
        plan.responses = {fatal};
        break;
      }
      coordinator_->Add(r, list, now);
    }
    if (plan.responses.empty()) {
      std::string warning;
      plan = coordinator_->Plan(now, &warning);
      if (!warning.empty()) Log(warning);
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
      case ResponseType::kError: {
        std::vector<std::string> mine_failed;
        for (const std::string& name : response.names) {
          if (announced_.count(name)) mine_failed.push_back(name);
        }
        Complete(mine_failed, Status::Error(response.error));
        break;
      }
      default:
        if (!Execute(response, /*from_cache=*/false)) return false;
    }
  }
  return true;
}

bool Runtime::Execute(const Response& response, bool from_cache) {
  const bool without_data = std::find(response.joined_ranks.begin(), response.joined_ranks.end(),
                                      rank_.load()) != response.joined_ranks.end();
  std::vector<CollectiveRequest*> entries;
  for (const std::string& name : response.names) {
    if (without_data) break;
    auto it = announced_.find(name);
    if (it == announced_.end()) {
      const std::string reason = "internal error: the coordinator scheduled \"" + name +
                                 "\", which rank " + std::to_string(rank_) + " never submitted";
      Stop(reason, [&](const std::string&) { return "perseus_legacy: " + reason; });
      return false;
    }
    entries.push_back(&it->second.request);
  }

  CollectiveRequest* entry = entries.empty() ? nullptr : entries.front();
  Status op, comm;
  switch (response.type) {
    case ResponseType::kAllreduce: comm = RunAllreduce(response, entries); break;
    case ResponseType::kAllgather: comm = RunAllgather(response, entry, &op); break;
    case ResponseType::kBroadcast: comm = RunBroadcast(response, entry); break;
    case ResponseType::kAlltoall:  // the coordinator never runs it without every rank's data
      comm = entry ? RunAlltoall(response, *entry, &op) : Status::Error("alltoall without data");
      break;
    default: comm = Status::Error("unknown response type");
  }
  if (!comm.ok()) {
    const std::string reason = "communication failed on rank " + std::to_string(rank_) + ": " +
                               comm.message();
    Stop(reason, [&](const std::string& name) {
      return "perseus_legacy: \"" + name + "\" failed: " + reason;
    });
    return false;
  }
  if (!from_cache && response.joined_ranks.empty()) {
    // Every rank executed it with its own data: remember it for the next time.
    Response single = response;
    single.names.clear();
    for (const std::string& name : response.names) {
      single.names = {name};
      cache_.Put(single, announced_[name].meta);
    }
  }
  if (!without_data) {
    if (!response.joined_ranks.empty()) peer_joined_ = true;  // before the op's done callback
    Complete(response.names, op);
  }
  return true;
}

Status Runtime::RunAllreduce(const Response& response,
                             const std::vector<CollectiveRequest*>& entries) {
  const DataType dtype = response.dtype;
  const size_t item = DataTypeSize(dtype);
  // Average is a Sum followed by a division by the ranks that contributed data: folded into the
  // postscale for floating point; integers divide exactly afterwards (truncating toward zero).
  const int64_t contributors = size_ - static_cast<int64_t>(response.joined_ranks.size());
  const bool integer_average =
      response.reduce_op == ReduceOp::kAverage && IsIntegerType(dtype);
  double postscale = response.postscale_factor;
  if (response.reduce_op == ReduceOp::kAverage && !integer_average) postscale /= contributors;
  const double prescale = response.prescale_factor;

  // The tensors' element counts: from the requests, or (a joined rank has none) the response.
  const size_t n = entries.empty() ? response.sizes.size() : entries.size();
  auto count_of = [&](size_t i) {
    return entries.empty() ? response.sizes[i] : NumElements(entries[i]->shape);
  };
  // One collective for each large tensor, where it lies, and one for the small ones together
  // (through the fusion buffer). Every rank, a joined one too, splits the same way.
  std::vector<std::vector<size_t>> groups;
  std::vector<size_t> small;
  for (size_t i = 0; i < n; ++i) {
    if (count_of(i) * static_cast<int64_t>(item) >= kOwnCollectiveBytes) {
      groups.push_back({i});
    } else {
      small.push_back(i);
    }
  }
  if (!small.empty()) groups.push_back(std::move(small));

  for (const std::vector<size_t>& group : groups) {
    int64_t total = 0;
    for (size_t i : group) total += count_of(i);
    if (total == 0) continue;
    Status s;
    if (entries.empty()) {
      // Joined: the identity of the op, so that the others reduce over the ranks with data.
      void* buffer = fusion_.Get(total * item);
      if (buffer == nullptr) {
        return Status::Error("out of memory for a " + std::to_string(total * item) +
                             "-byte buffer of a joined rank");
      }
      FillIdentity(dtype, response.reduce_op, buffer, total);
      s = controller_->Allreduce(buffer, buffer, total, dtype, response.reduce_op);
    } else if (group.size() == 1) {
      // MPI reads the op's input and writes its output directly: no staging copy.
      CollectiveRequest& e = *entries[group.front()];
      const void* src = e.input;
      if (prescale != 1.0) {
        ScaleBuffer(dtype, e.input, e.output, total, prescale);
        src = e.output;
      }
      s = controller_->Allreduce(src, e.output, total, dtype, response.reduce_op);
      if (s.ok() && integer_average) DivideIntegers(dtype, e.output, total, contributors);
      if (s.ok() && postscale != 1.0) ScaleBuffer(dtype, e.output, e.output, total, postscale);
    } else {
      s = RunFusedAllreduce(response, entries, group, total, prescale,
                            integer_average ? contributors : 1, postscale);
    }
    if (!s.ok()) return s;
  }
  return Status::OK();
}

Status Runtime::RunFusedAllreduce(const Response& response,
                                  const std::vector<CollectiveRequest*>& entries,
                                  const std::vector<size_t>& group, int64_t total,
                                  double prescale, int64_t divisor, double postscale) {
  const DataType dtype = response.dtype;
  const size_t item = DataTypeSize(dtype);
  char* buffer = static_cast<char*>(fusion_.Get(total * item));
  if (buffer == nullptr) {
    return Status::Error("out of memory for a " + std::to_string(total * item) +
                         "-byte fusion buffer");
  }
  int64_t offset = 0;
  for (size_t i : group) {
    const CollectiveRequest* e = entries[i];
    const int64_t count = NumElements(e->shape);
    if (prescale != 1.0) {
      ScaleBuffer(dtype, e->input, buffer + offset * item, count, prescale);
    } else {
      CopyBytes(buffer + offset * item, e->input, count * item);
    }
    offset += count;
  }
  Status s = controller_->Allreduce(buffer, buffer, total, dtype, response.reduce_op);
  if (!s.ok()) return s;
  if (divisor != 1) DivideIntegers(dtype, buffer, total, divisor);
  offset = 0;
  for (size_t i : group) {
    CollectiveRequest* e = entries[i];
    const int64_t count = NumElements(e->shape);
    if (postscale != 1.0) {  // scaled on the way out: one pass instead of two
      ScaleBuffer(dtype, buffer + offset * item, e->output, count, postscale);
    } else {
      CopyBytes(e->output, buffer + offset * item, count * item);
    }
    offset += count;
  }
  return Status::OK();
}

// Where to receive when the framework could not allocate an output: this rank must still take
// part in the collective, or every other rank would wait for it forever.
void* Runtime::Scratch(size_t bytes, Status* op, Status* comm) {
  void* scratch = fusion_.Get(bytes);
  if (scratch == nullptr) {
    *comm = Status::Error("out of memory for " + std::to_string(bytes) + " bytes after: " +
                          op->message());
  }
  return scratch;
}

Status Runtime::RunAllgather(const Response& response, CollectiveRequest* e, Status* op) {
  std::vector<int64_t> out_shape = e ? e->shape : response.shape;
  out_shape[0] = 0;
  for (int64_t rows : response.sizes) out_shape[0] += rows;
  const size_t row_bytes =
      NumElements(std::vector<int64_t>(out_shape.begin() + 1, out_shape.end())) *
      DataTypeSize(response.dtype);
  const size_t total_bytes = out_shape[0] * row_bytes;
  void* out = nullptr;
  // A joined rank sends no rows and receives into scratch.
  *op = e ? e->allocate_output(out_shape, &out) : Status::Error("this rank has joined");
  Status comm;
  if (!op->ok()) out = Scratch(total_bytes, op, &comm);
  if (!comm.ok() || total_bytes == 0) return comm;
  return controller_->Allgatherv(e ? e->input : out, out, response.sizes, row_bytes);
}

Status Runtime::RunBroadcast(const Response& response, CollectiveRequest* e) {
  const int64_t bytes =
      NumElements(e ? e->shape : response.shape) * DataTypeSize(response.dtype);
  if (bytes == 0) return Status::OK();
  void* out = nullptr;
  if (e == nullptr) {  // joined, and not the root (the coordinator checked): receive into scratch
    Status op = Status::Error("this rank has joined"), comm;
    out = Scratch(bytes, &op, &comm);
    if (!comm.ok()) return comm;
  } else {
    out = e->output;
    if (rank_ == response.root_rank) CopyBytes(out, e->input, bytes);
  }
  return controller_->Broadcast(out, bytes, response.root_rank);
}

Status Runtime::RunAlltoall(const Response& response, CollectiveRequest& e, Status* op) {
  const int size = size_;
  const int me = rank_;
  std::vector<int64_t> send(size), recv(size);
  int64_t all_rows = 0;
  for (int r = 0; r < size; ++r) {
    send[r] = response.sizes[static_cast<size_t>(me) * size + r];
    recv[r] = response.sizes[static_cast<size_t>(r) * size + me];
    for (int to = 0; to < size; ++to) {
      all_rows += response.sizes[static_cast<size_t>(r) * size + to];
    }
  }
  std::vector<int64_t> out_shape = e.shape;
  out_shape[0] = 0;
  for (int64_t rows : recv) out_shape[0] += rows;
  const size_t row_bytes = NumElements(std::vector<int64_t>(e.shape.begin() + 1, e.shape.end())) *
                           DataTypeSize(response.dtype);
  void* out = nullptr;
  *op = e.allocate_output(out_shape, &out);
  Status comm;
  if (!op->ok()) out = Scratch(out_shape[0] * row_bytes, op, &comm);
  if (op->ok() && e.received_splits != nullptr) *e.received_splits = recv;
  // Every rank knows the whole matrix, so all of them skip an empty exchange together.
  if (!comm.ok() || all_rows * row_bytes == 0) return comm;
  return controller_->Alltoallv(e.input, send, out, recv, row_bytes);
}

void Runtime::Complete(const std::vector<std::string>& names, const Status& status) {
  {
    // Released before `done` runs, so a callback may submit the same name again at once.
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& name : names) pending_names_.erase(name);
  }
  for (const std::string& name : names) {
    auto node = announced_.extract(name);
    if (!node.empty()) node.mapped().request.done(status);
  }
}

void Runtime::Stop(const std::string& reason, const MessageFor& message_for) {
  std::deque<CollectiveRequest> queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_reason_ = reason;
    queued.swap(queue_);
    pending_names_.clear();
  }
  for (auto& [name, a] : announced_) a.request.done(Status::Error(message_for(name)));
  announced_.clear();
  cached_.clear();
  for (CollectiveRequest& request : queued) request.done(Status::Error(message_for(request.name)));
  FinishJoin(Status::Error("perseus_legacy: join() failed: " + reason), -1);
}

void Runtime::Log(const std::string& text) const {
  std::fprintf(stderr, "perseus_legacy[rank %d]: %s\n", rank_.load(), text.c_str());
  std::fflush(stderr);
}

}  // namespace

Status Init(intptr_t mpi_comm_handle) { return State().Init(mpi_comm_handle); }
Status InitTcp(const TcpOptions& options) { return State().Init(0, &options); }
void Shutdown() { State().Shutdown(); }
bool IsInitialized() { return State().initialized(); }
int Rank() { return State().rank(); }
int Size() { return State().size(); }
int LocalRank() { return State().local_rank(); }
int LocalSize() { return State().local_size(); }
int CrossRank() { return State().cross_rank(); }
int CrossSize() { return State().cross_size(); }
bool MpiThreadsSupported() { return State().threads_supported(); }
bool MpiBuilt() { return true; }
bool TcpBuilt() { return true; }
std::string ControllerName() { return State().controller_name(); }
Status Enqueue(CollectiveRequest request) {
  std::vector<CollectiveRequest> one;
  one.push_back(std::move(request));
  return State().EnqueueAll(std::move(one)).front();
}
std::vector<Status> EnqueueAll(std::vector<CollectiveRequest> requests) {
  return State().EnqueueAll(std::move(requests));
}
Status Join(int* last_joined_rank) { return State().Join(last_joined_rank); }
bool TakePeerJoined() { return State().TakePeerJoined(); }

}  // namespace perseus
