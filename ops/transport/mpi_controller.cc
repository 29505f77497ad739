// The MPI transport: set-up of its communicators (and of the hierarchical allreduce's local and
// cross ones), the control plane in fixed-size slots, the collectives, with our own reduction
// functions for float16 / bfloat16, and the bounded waits that turn a frozen or unreachable rank
// into an error naming it.
#include "transport/mpi_controller.h"

#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>

#include "common/reduce.h"
#include "transport/registry.h"

namespace perseus {
namespace {

// Each rank's control message travels in one fixed-size slot of a single gather / broadcast;
// only the part of a large message beyond it needs a second step.
constexpr size_t kSlotBytes = 2048;
constexpr size_t kHeaderBytes = sizeof(uint64_t);
constexpr size_t kSlotPayload = kSlotBytes - kHeaderBytes;
constexpr int kOverflowTag = 17;
constexpr int kSlotTag = 18;
constexpr int kAnswerTag = 19;
constexpr int kAnswerOverflowTag = 20;
constexpr int kNoticeTag = 21;
// How long Abort waits for its notices to leave (small messages: normally at once).
constexpr double kNoticeSendSecs = 2.0;

Status Check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return Status::OK();
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  return Status::Error(std::string("MPI error in ") + what + ": " + std::string(text, length));
}

template <typename Comm>
Comm CommFromHandle(intptr_t handle) {
  if constexpr (std::is_pointer<Comm>::value) {
    return reinterpret_cast<Comm>(handle);  // Open MPI: MPI_Comm is a pointer
  } else {
    return static_cast<Comm>(handle);  // MPICH: an integer handle
  }
}

template <DataType D, ReduceOp O>
void UserReduce(void* in, void* inout, int* len, MPI_Datatype*) {
  ReduceInto(D, O, in, inout, *len);
}

template <DataType D>
std::array<MPI_User_function*, 4> UserFunctions() {
  return {&UserReduce<D, ReduceOp::kSum>, &UserReduce<D, ReduceOp::kMin>,
          &UserReduce<D, ReduceOp::kMax>, &UserReduce<D, ReduceOp::kProduct>};
}

size_t OpIndex(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAverage:
    case ReduceOp::kSum: return 0;
    case ReduceOp::kMin: return 1;
    case ReduceOp::kMax: return 2;
    case ReduceOp::kProduct: return 3;
  }
  return 0;
}

// Counts and displacements for the v-collectives: in bytes when they fit MPI's int, otherwise in
// units of a contiguous datatype of `unit_bytes` (freed on destruction). Fits() says whether
// either does; beyond it the controller exchanges the blocks itself (PairwiseExchange).
class VectorLayout {
 public:
  static bool Fits(const std::vector<int64_t>& counts, size_t unit_bytes) {
    int64_t total_bytes = 0;
    for (int64_t c : counts) total_bytes += c * static_cast<int64_t>(unit_bytes);
    if (total_bytes <= INT_MAX) return true;
    int64_t units = 0;  // the last count and displacement are at most the total
    for (int64_t c : counts) units += c;
    return unit_bytes <= INT_MAX && units <= INT_MAX;
  }
  Status Build(const std::vector<int64_t>& counts, size_t unit_bytes) {
    int64_t total_bytes = 0;
    for (int64_t c : counts) total_bytes += c * static_cast<int64_t>(unit_bytes);
    const bool bytes_fit = total_bytes <= INT_MAX;
    const int64_t scale = bytes_fit ? static_cast<int64_t>(unit_bytes) : 1;
    int64_t offset = 0;
    for (int64_t c : counts) {
      counts_.push_back(static_cast<int>(c * scale));
      displs_.push_back(static_cast<int>(offset));
      offset += c * scale;
    }
    type_ = MPI_BYTE;
    if (!bytes_fit) {
      Status s = Check(MPI_Type_contiguous(static_cast<int>(unit_bytes), MPI_BYTE, &type_),
                       "MPI_Type_contiguous");
      if (!s.ok()) return s;
      derived_ = true;
      return Check(MPI_Type_commit(&type_), "MPI_Type_commit");
    }
    return Status::OK();
  }
  ~VectorLayout() {
    if (derived_) MPI_Type_free(&type_);
  }
  const int* counts() const { return counts_.data(); }
  const int* displs() const { return displs_.data(); }
  MPI_Datatype type() const { return type_; }

 private:
  std::vector<int> counts_, displs_;
  MPI_Datatype type_ = MPI_BYTE;
  bool derived_ = false;
};

// {byte offset, bytes} of each rank's block of `counts` rows of `unit_bytes`, one after another.
std::vector<std::pair<int64_t, int64_t>> Blocks(const std::vector<int64_t>& counts,
                                                size_t unit_bytes) {
  std::vector<std::pair<int64_t, int64_t>> spans;
  int64_t offset = 0;
  for (int64_t c : counts) {
    const int64_t bytes = c * static_cast<int64_t>(unit_bytes);
    spans.emplace_back(offset, bytes);
    offset += bytes;
  }
  return spans;
}

// MPI_Init_thread has no bound of its own (Open MPI's waits until every rank's process has
// reached it): while it runs, this watchdog ends the process once `secs` have passed, saying
// why, and mpirun then ends the job. Destroyed when MPI_Init_thread has returned.
class InitWatchdog {
 public:
  explicit InitWatchdog(double secs)
      : thread_([this, secs] {
          std::unique_lock<std::mutex> lock(mu_);
          if (cv_.wait_for(lock, std::chrono::duration<double>(secs), [this] { return done_; })) {
            return;
          }
          std::fprintf(stderr,
                       "perseus_legacy: not every rank reached init() within "
                       "PERSEUS_START_TIMEOUT=%s s (MPI_Init_thread did not return): a rank "
                       "never called init(), is frozen, or has exited; ending this process\n",
                       NumberString(secs).c_str());
          std::fflush(stderr);
          std::_Exit(1);
        }) {}
  ~InitWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;  // last: started once the rest is ready
};

}  // namespace

MpiController::MpiController() {
  half_ops_.fill(MPI_OP_NULL);
  bfloat16_ops_.fill(MPI_OP_NULL);
}

// Initializes MPI when nobody has (and then finalizes it on destruction) and duplicates the
// communicator options.mpi_comm_handle.
Status CreateMpiController(const TransportOptions& options, std::unique_ptr<Controller>* out) {
  auto controller = std::make_unique<MpiController>();
  Status s = controller->Setup(options.mpi_comm_handle, options.mpi_start_timeout_secs);
  if (s.ok()) *out = std::move(controller);
  return s;
}

std::string MpiGroupName(const TransportOptions& options) {
  return options.mpi_comm_handle == 0
             ? "MPI_COMM_WORLD"
             : "the MPI communicator " + std::to_string(options.mpi_comm_handle);
}

const TransportRegistration kMpi(
    {"mpi", "MPI", "init_mpi", /*built=*/true, &CreateMpiController, &MpiGroupName});

template <typename Start>
Status MpiController::StartAndWait(Start start, const char* what, WaitFor kind) {
  std::vector<MPI_Request> request(1, MPI_REQUEST_NULL);
  Status s = Check(start(request.data()), what);
  return s.ok() ? Wait(&request, {-1}, what, kind) : s;
}

Status MpiController::Setup(intptr_t comm_handle, double start_secs) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) {
    return Status::Error(
        "perseus_legacy: MPI has already been finalized in this process: init() after "
        "shutdown() is not supported when perseus_legacy started MPI itself (import mpi4py "
        "before init() so that MPI outlives shutdown())");
  }
  if (!initialized) {
    int provided = 0;
    Status s;
    {
      InitWatchdog watchdog(start_secs);
      s = Check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided),
                "MPI_Init_thread");
    }
    if (!s.ok()) return s;
    owns_mpi_ = true;
  }
  int provided = 0;
  MPI_Query_thread(&provided);
  threads_multiple_ = provided == MPI_THREAD_MULTIPLE;
  // Our background thread makes every MPI call after init, so it needs at least SERIALIZED.
  if (provided < MPI_THREAD_SERIALIZED) {
    return Status::Error(
        "perseus_legacy: MPI was initialized without thread support (level " +
        std::to_string(provided) +
        "); initialize it with MPI_Init_thread(MPI_THREAD_MULTIPLE), as mpi4py does by default");
  }

  MPI_Comm base = comm_handle == 0 ? MPI_COMM_WORLD : CommFromHandle<MPI_Comm>(comm_handle);
  MPI_Comm_rank(base, &rank_);
  // Every wait of the set-up on the other ranks is bounded (SetWaitLimits replaces this): the
  // duplications are nonblocking, so a rank that never calls init() or is frozen in it fails
  // the others instead of holding them. The splits below stay blocking (MPI has no nonblocking
  // split), but every rank has just been seen in the duplications.
  shutdown_secs_ = start_secs;
  Status s = StartAndWait([&](MPI_Request* r) { return MPI_Comm_idup(base, &control_, r); },
                          "MPI_Comm_idup", WaitFor::kStart);
  if (s.ok()) {
    s = StartAndWait([&](MPI_Request* r) { return MPI_Comm_idup(base, &data_, r); },
                     "MPI_Comm_idup", WaitFor::kStart);
  }
  if (!s.ok()) return s;
  // Errors become Status values that fail the pending requests instead of aborting the job.
  MPI_Comm_set_errhandler(control_, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(data_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(control_, &rank_);
  MPI_Comm_size(control_, &size_);
  notice_in_.resize(kNoticeBytes);
  s = Check(MPI_Irecv(notice_in_.data(), kNoticeBytes, MPI_BYTE, MPI_ANY_SOURCE, kNoticeTag,
                      control_, &notice_request_),
            "MPI_Irecv");
  if (!s.ok()) return s;

  s = Check(MPI_Comm_split_type(control_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local_),
            "MPI_Comm_split_type");
  if (!s.ok()) return s;
  MPI_Comm_rank(local_, &local_rank_);
  MPI_Comm_size(local_, &local_size_);
  s = Check(MPI_Comm_split(control_, local_rank_, rank_, &cross_), "MPI_Comm_split");
  if (!s.ok()) return s;
  MPI_Comm_rank(cross_, &cross_rank_);
  MPI_Comm_size(cross_, &cross_size_);

  for (MPI_Datatype* type : {&half_type_, &bfloat16_type_}) {
    s = Check(MPI_Type_contiguous(2, MPI_BYTE, type), "MPI_Type_contiguous");
    if (s.ok()) s = Check(MPI_Type_commit(type), "MPI_Type_commit");
    if (!s.ok()) return s;
  }
  const auto half_fns = UserFunctions<DataType::kFloat16>();
  const auto bfloat16_fns = UserFunctions<DataType::kBFloat16>();
  for (size_t i = 0; i < half_ops_.size(); ++i) {
    s = Check(MPI_Op_create(half_fns[i], 1, &half_ops_[i]), "MPI_Op_create");
    if (s.ok()) s = Check(MPI_Op_create(bfloat16_fns[i], 1, &bfloat16_ops_[i]), "MPI_Op_create");
    if (!s.ok()) return s;
  }

  // Host names, so that a rank that stops answering can be named with its host.
  std::vector<char> name(MPI_MAX_PROCESSOR_NAME, '\0');
  std::vector<char> names(static_cast<size_t>(MPI_MAX_PROCESSOR_NAME) * size_, '\0');
  int name_length = 0;
  MPI_Get_processor_name(name.data(), &name_length);
  s = StartAndWait(
      [&](MPI_Request* r) {
        return MPI_Iallgather(name.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(),
                              MPI_MAX_PROCESSOR_NAME, MPI_CHAR, control_, r);
      },
      "MPI_Iallgather", WaitFor::kStart);
  if (!s.ok()) return s;
  for (int r = 0; r < size_; ++r) {
    const char* host = names.data() + static_cast<size_t>(MPI_MAX_PROCESSOR_NAME) * r;
    hosts_.emplace_back(host, strnlen(host, MPI_MAX_PROCESSOR_NAME));
  }

  slot_.resize(kSlotBytes);
  if (rank_ == 0) gather_slots_.resize(kSlotBytes * size_);
  FindHosts();
  s = SetupHierarchy();
  if (s.ok()) {
    s = StartAndWait([&](MPI_Request* r) { return MPI_Ibarrier(control_, r); }, "MPI_Ibarrier",
                     WaitFor::kStart);
  }
  shutdown_secs_ = 0;
  return s;
}

Status MpiController::SetupHierarchy() {
  // Every rank sees every host's rank count, so that all of them decide alike.
  std::vector<int> local_sizes(static_cast<size_t>(size_));
  Status s = StartAndWait(
      [&](MPI_Request* r) {
        return MPI_Iallgather(&local_size_, 1, MPI_INT, local_sizes.data(), 1, MPI_INT, control_,
                              r);
      },
      "MPI_Iallgather", WaitFor::kStart);
  if (!s.ok()) return s;
  const bool even = std::all_of(local_sizes.begin(), local_sizes.end(),
                                [&](int n) { return n == local_size_; });
  if (!even || local_size_ < 2 || cross_size_ < 2) return Status::OK();
  for (auto [comm, part] : {std::make_pair(local_, &local_data_),
                            std::make_pair(cross_, &cross_data_)}) {
    MPI_Comm own = MPI_COMM_NULL;
    s = StartAndWait([&](MPI_Request* r) { return MPI_Comm_idup(comm, &own, r); },
                     "MPI_Comm_idup", WaitFor::kStart);
    if (!s.ok()) return s;
    *part = Subset(own);
  }
  cross_data_->ring_min_bytes_ = kCrossRingMinBytes;
  return Status::OK();
}

std::unique_ptr<MpiController> MpiController::Subset(MPI_Comm comm) const {
  auto set = std::make_unique<MpiController>();
  set->subset_ = true;
  set->job_ = job_;
  set->policy_ = policy_;
  set->data_ = comm;
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm, &set->rank_);
  MPI_Comm_size(comm, &set->size_);
  std::vector<int> positions(static_cast<size_t>(set->size_));
  for (int r = 0; r < set->size_; ++r) positions[static_cast<size_t>(r)] = r;
  set->world_ranks_.resize(positions.size());
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(data_, &world);
  MPI_Group_translate_ranks(group, set->size_, positions.data(), world,
                            set->world_ranks_.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  set->threads_multiple_ = threads_multiple_;
  set->half_type_ = half_type_;
  set->bfloat16_type_ = bfloat16_type_;
  set->half_ops_ = half_ops_;
  set->bfloat16_ops_ = bfloat16_ops_;
  set->warning_secs_ = warning_secs_;
  set->shutdown_secs_ = shutdown_secs_;
  set->hosts_ = hosts_;
  set->FindHosts();
  return set;
}

void MpiController::FindHosts() {
  ring_crosses_hosts_ = false;
  for (int r = 0; r < size_; ++r) {
    const int a = WorldRank(r), b = WorldRank((r + 1) % size_);
    ring_crosses_hosts_ = ring_crosses_hosts_ || hosts_[a] != hosts_[b];
  }
}

MpiController::~MpiController() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (subset_) {
    // A lost rank is handled (MPI_Abort) by the parent, which is destroyed after this one.
    if (failed_.ok() && data_ != MPI_COMM_NULL) MPI_Comm_free(&data_);
    return;
  }
  Status failed = failed_;
  for (const MpiController* part : {local_data_.get(), cross_data_.get()}) {
    if (failed.ok() && part) failed = part->failed_;
  }
  if (!failed.ok()) {
    // A rank stopped answering: freeing the communicators or MPI_Finalize would wait for it
    // forever, and so would mpi4py's finalize at exit. End the job, as mpirun does when a rank
    // exits with an error; the reason is already on stderr.
    std::fprintf(stderr, "perseus_legacy[rank %d]: aborting the MPI job: %s\n", rank_,
                 failed.message().c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  local_data_.reset();
  cross_data_.reset();
  if (notice_request_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&notice_request_);
    MPI_Wait(&notice_request_, MPI_STATUS_IGNORE);
  }
  for (auto* ops : {&half_ops_, &bfloat16_ops_}) {
    for (MPI_Op& op : *ops) {
      if (op != MPI_OP_NULL) MPI_Op_free(&op);
    }
  }
  for (MPI_Datatype* type : {&half_type_, &bfloat16_type_}) {
    if (*type != MPI_DATATYPE_NULL) MPI_Type_free(type);
  }
  for (MPI_Comm* comm : {&cross_, &local_, &data_, &control_}) {
    if (*comm != MPI_COMM_NULL) MPI_Comm_free(comm);
  }
  if (owns_mpi_) MPI_Finalize();
}

Status MpiController::CreateProcessSet(const std::vector<int>& ranks,
                                       std::unique_ptr<Controller>* out) {
  out->reset();
  if (!failed_.ok()) return failed_;
  const bool member = std::binary_search(ranks.begin(), ranks.end(), rank_);
  MPI_Comm comm = MPI_COMM_NULL;
  // MPI_Comm_split blocks until every rank calls it: a bounded barrier first, so that a rank
  // lost just before is an error here rather than a wait without end.
  Status s = Barrier();
  if (!s.ok()) return s;
  s = Check(MPI_Comm_split(data_, member ? 0 : MPI_UNDEFINED, rank_, &comm), "MPI_Comm_split");
  if (!s.ok() || !member) return s;
  *out = Subset(comm);
  return Status::OK();
}

Status MpiController::Failed(const Status& status) {
  if (failed_.ok()) failed_ = status;
  if (job_ != this && job_->failed_.ok()) job_->failed_ = status;
  return failed_;
}

Status MpiController::TakeNotice() {
  if (job_ != this) return job_->TakeNotice();
  if (notice_request_ == MPI_REQUEST_NULL) return notice_;
  int done = 0;
  MPI_Status status;
  if (MPI_Test(&notice_request_, &done, &status) != MPI_SUCCESS || !done) return Status::OK();
  int length = 0;
  MPI_Get_count(&status, MPI_BYTE, &length);
  notice_ = Status::Error(std::string(notice_in_.data(), static_cast<size_t>(length)));
  std::fprintf(stderr, "perseus_legacy[rank %d]: rank %d failed and told every rank: %s\n",
               rank_, status.MPI_SOURCE, notice_.message().c_str());
  std::fflush(stderr);
  return notice_;
}

void MpiController::Abort(const std::string& reason) {
  if (job_ != this) {
    job_->Abort(reason);
    return;
  }
  // From now on the destructor ends the job (MPI_Abort) instead of finalizing: the other ranks
  // may be inside collectives this rank will never join.
  if (failed_.ok()) failed_ = Status::Error(reason);
  if (!notice_.ok() || !notice_out_.empty() || control_ == MPI_COMM_NULL) return;
  notice_out_ = reason.substr(0, kNoticeBytes);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    notice_sends_.emplace_back();
    if (MPI_Isend(notice_out_.data(), static_cast<int>(notice_out_.size()), MPI_BYTE, r,
                  kNoticeTag, control_, &notice_sends_.back()) != MPI_SUCCESS) {
      notice_sends_.back() = MPI_REQUEST_NULL;
    }
  }
  // Progress them for a moment (best effort: a frozen rank may never take its copy).
  const auto until = Clock::now() + std::chrono::duration<double>(kNoticeSendSecs);
  int all_sent = 0;
  while (Clock::now() < until) {
    if (MPI_Testall(static_cast<int>(notice_sends_.size()), notice_sends_.data(), &all_sent,
                    MPI_STATUSES_IGNORE) != MPI_SUCCESS ||
        all_sent) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::string MpiController::Describe(const std::vector<int>& ranks) const {
  std::string text;
  for (int r : ranks) {
    if (!text.empty()) text += ", ";
    text += "rank " + std::to_string(r);
    if (r >= 0 && r < static_cast<int>(hosts_.size())) text += " (host " + hosts_[r] + ")";
  }
  return text;
}

// Open MPI's blocking calls busy-poll a core. Ranks share few cores, and a negotiation wait
// lasts until the slowest rank submits (its step's compute) or until an idle rank's next
// heartbeat, so every wait polls for 20 us, yields until its yield time, then sleeps a
// sixteenth of the time already waited, from 20 us up to kLongestSleep: a late arrival costs
// at most a few percent of the wait, and a rank waiting on another's compute leaves the cores to
// it. (Yielding alone keeps a core busy whenever no other thread is ready, and takes a fair share
// of it when one is: waiting ranks took 73% of 2 cores on 8 ranks, against 39% over TCP's
// poll().) Data moves only inside these polls (MPI_Test), on both sides: a step that arrives
// during a sleep waits for its end, and a large message between two sleeping ranks stalls. A
// collective's waits (kCollective, kRing) begin only once the negotiation has found every rank
// ready for it, so its peers are on their way in and the wait is the transfer: they yield for
// kTransferYieldFor before sleeping (a 1 MiB allreduce on one host, whose chunks take about
// 100 us each, ran at half of Open MPI's speed when they slept after 100 us); the others
// (negotiation, set-up) after kNegotiationYieldFor.
// Past warning_secs_ the ranks still awaited are named on stderr (again every warning_secs_);
// past shutdown_secs_ the wait fails and the controller is unusable (see the destructor).
namespace {
constexpr auto kNegotiationYieldFor = std::chrono::microseconds(100);
constexpr auto kTransferYieldFor = std::chrono::microseconds(1000);
constexpr auto kLongestSleep = std::chrono::microseconds(250);
}  // namespace

Status MpiController::Wait(std::vector<MPI_Request>* requests, const std::vector<int>& peers,
                           const char* what, WaitFor kind) {
  using std::chrono::microseconds;
  if (!failed_.ok()) return failed_;
  const auto start = Clock::now();
  // A sleep of 20 us oversleeps by the thread's timer slack (50 us by default): 5 us instead.
  static thread_local const bool slack_set = prctl(PR_SET_TIMERSLACK, 5000UL, 0, 0, 0) == 0;
  static_cast<void>(slack_set);
  double next_warning = warning_secs_;
  const bool transfer = kind == WaitFor::kCollective || kind == WaitFor::kRing;
  const microseconds yield_for = transfer ? kTransferYieldFor : kNegotiationYieldFor;
  while (true) {
    std::vector<int> waiting;
    for (size_t i = 0; i < requests->size(); ++i) {
      MPI_Request& request = (*requests)[i];
      if (request == MPI_REQUEST_NULL) continue;
      int done = 0;
      const int rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return Failed(Check(rc, what));
      if (!done) waiting.push_back(peers[i]);
    }
    if (waiting.empty()) return Status::OK();
    Status notice = TakeNotice();
    if (!notice.ok()) return Failed(notice);
    const auto waited = std::chrono::duration_cast<microseconds>(Clock::now() - start);
    const double secs = std::chrono::duration<double>(waited).count();
    const bool give_up = shutdown_secs_ > 0 && secs >= shutdown_secs_;
    if (give_up || (warning_secs_ > 0 && secs >= next_warning)) {
      std::sort(waiting.begin(), waiting.end());
      waiting.erase(std::unique(waiting.begin(), waiting.end()), waiting.end());
      const bool known = waiting.front() >= 0;
      const std::string during = kind == WaitFor::kNegotiation ? "negotiation" : "a collective";
      if (give_up && kind == WaitFor::kStart) {
        Failed(Status::Error(
            "perseus_legacy: not every rank reached init() within PERSEUS_START_TIMEOUT=" +
            NumberString(shutdown_secs_) + " s (rank " + std::to_string(rank_) + " waited in " +
            what + "): a rank never called init(), is frozen, or has exited"));
        std::fprintf(stderr, "perseus_legacy[rank %d]: %s\n", rank_, failed_.message().c_str());
        std::fflush(stderr);
        return failed_;
      }
      if (give_up) {
        const std::string who =
            known ? Describe(waiting) + " stopped responding: nothing from ranks " +
                        RankList(waiting)
                  : std::string("a rank stopped taking part in ") + what + ": nothing";
        Failed(Status::Error(
            "perseus_legacy: " + who + " for " + NumberString(static_cast<int64_t>(secs)) +
            " s during " + during + " (PERSEUS_STALL_SHUTDOWN_SECS=" +
            NumberString(shutdown_secs_) +
            "); the rank is frozen, stopped, or its host is unreachable"));
        std::fprintf(stderr, "perseus_legacy[rank %d]: %s\n", WorldRank(rank_),
                     failed_.message().c_str());
        std::fflush(stderr);
        return failed_;
      }
      std::fprintf(stderr,
                   "perseus_legacy[rank %d]: WARNING: waiting %s s for %s to answer in %s "
                   "(%s, PERSEUS_STALL_WARNING_SECS=%s); a rank may be frozen, stopped, or its "
                   "host unreachable\n",
                   WorldRank(rank_), NumberString(static_cast<int64_t>(secs)).c_str(),
                   known ? Describe(waiting).c_str() : "the other ranks", what, during.c_str(),
                   NumberString(warning_secs_).c_str());
      std::fflush(stderr);
      next_warning += warning_secs_;
    }
    if (waited < microseconds(20)) continue;
    if (waited < yield_for) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::clamp(waited / 16, microseconds(20), kLongestSleep));
  }
}

// The control plane is point-to-point between rank 0 and each rank, so that a wait knows which
// ranks have not answered yet.
Status MpiController::GatherToCoordinator(const std::string& mine,
                                          std::vector<std::string>* all) {
  if (!failed_.ok()) return failed_;
  const uint64_t length = mine.size();
  std::memcpy(slot_.data(), &length, kHeaderBytes);
  std::memcpy(slot_.data() + kHeaderBytes, mine.data(), std::min<size_t>(length, kSlotPayload));
  std::vector<MPI_Request> requests;
  std::vector<int> peers;
  if (rank_ != 0) {
    requests.emplace_back();
    peers.push_back(0);
    Status s = Check(MPI_Isend(slot_.data(), kSlotBytes, MPI_BYTE, 0, kSlotTag, control_,
                               &requests.back()),
                     "MPI_Isend");
    if (s.ok() && length > kSlotPayload) {
      requests.emplace_back();
      peers.push_back(0);
      s = Check(MPI_Isend(mine.data() + kSlotPayload, static_cast<int>(length - kSlotPayload),
                          MPI_BYTE, 0, kOverflowTag, control_, &requests.back()),
                "MPI_Isend");
    }
    return s.ok() ? Wait(&requests, peers, "sending to the coordinator", WaitFor::kNegotiation) : s;
  }

  for (int r = 1; r < size_; ++r) {
    requests.emplace_back();
    peers.push_back(r);
    Status s = Check(MPI_Irecv(gather_slots_.data() + kSlotBytes * r, kSlotBytes, MPI_BYTE, r,
                               kSlotTag, control_, &requests.back()),
                     "MPI_Irecv");
    if (!s.ok()) return s;
  }
  Status s = Wait(&requests, peers, "the coordinator's gather", WaitFor::kNegotiation);
  if (!s.ok()) return s;

  all->assign(size_, std::string());
  (*all)[0] = mine;
  requests.clear();
  peers.clear();
  for (int r = 1; r < size_; ++r) {
    const char* slot = gather_slots_.data() + kSlotBytes * r;
    uint64_t n = 0;
    std::memcpy(&n, slot, kHeaderBytes);
    if (n > kMaxControlMessageBytes) {
      return Status::Error("perseus_legacy: rank " + std::to_string(r) + " announced a control "
                           "message of " + std::to_string(n) + " bytes, beyond the limit of " +
                           std::to_string(kMaxControlMessageBytes) + " bytes");
    }
    std::string& bytes = (*all)[r];
    bytes.assign(slot + kHeaderBytes, std::min<size_t>(n, kSlotPayload));
    if (n <= kSlotPayload) continue;
    bytes.resize(n);
    requests.emplace_back();
    peers.push_back(r);
    s = Check(MPI_Irecv(&bytes[kSlotPayload], static_cast<int>(n - kSlotPayload), MPI_BYTE, r,
                        kOverflowTag, control_, &requests.back()),
              "MPI_Irecv");
    if (!s.ok()) return s;
  }
  return Wait(&requests, peers, "the coordinator's gather", WaitFor::kNegotiation);
}

Status MpiController::BroadcastFromCoordinator(std::string* bytes) {
  if (!failed_.ok()) return failed_;
  std::vector<MPI_Request> requests;
  std::vector<int> peers;
  if (rank_ == 0) {
    const uint64_t length = bytes->size();
    std::memcpy(slot_.data(), &length, kHeaderBytes);
    std::memcpy(slot_.data() + kHeaderBytes, bytes->data(),
                std::min<size_t>(length, kSlotPayload));
    for (int r = 1; r < size_; ++r) {
      for (const bool overflow : {false, true}) {
        if (overflow && length <= kSlotPayload) continue;
        requests.emplace_back();
        peers.push_back(r);
        const Status s =
            overflow ? Check(MPI_Isend(bytes->data() + kSlotPayload,
                                       static_cast<int>(length - kSlotPayload), MPI_BYTE, r,
                                       kAnswerOverflowTag, control_, &requests.back()),
                             "MPI_Isend")
                     : Check(MPI_Isend(slot_.data(), kSlotBytes, MPI_BYTE, r, kAnswerTag,
                                       control_, &requests.back()),
                             "MPI_Isend");
        if (!s.ok()) return s;
      }
    }
    return Wait(&requests, peers, "the coordinator's answer", WaitFor::kNegotiation);
  }
  requests.emplace_back();
  peers.push_back(0);
  Status s = Check(MPI_Irecv(slot_.data(), kSlotBytes, MPI_BYTE, 0, kAnswerTag, control_,
                             &requests.back()),
                   "MPI_Irecv");
  if (s.ok()) s = Wait(&requests, peers, "the coordinator's answer", WaitFor::kNegotiation);
  if (!s.ok()) return s;
  uint64_t length = 0;
  std::memcpy(&length, slot_.data(), kHeaderBytes);
  if (length > kMaxControlMessageBytes) {
    return Status::Error("perseus_legacy: the coordinator announced an answer of " +
                         std::to_string(length) + " bytes, beyond the limit of " +
                         std::to_string(kMaxControlMessageBytes) + " bytes");
  }
  bytes->assign(slot_.data() + kHeaderBytes, std::min<size_t>(length, kSlotPayload));
  bytes->resize(length);
  if (length <= kSlotPayload) return Status::OK();
  requests.assign(1, MPI_REQUEST_NULL);
  s = Check(MPI_Irecv(&(*bytes)[kSlotPayload], static_cast<int>(length - kSlotPayload), MPI_BYTE,
                      0, kAnswerOverflowTag, control_, &requests.back()),
            "MPI_Irecv");
  return s.ok() ? Wait(&requests, peers, "the coordinator's answer", WaitFor::kNegotiation) : s;
}

MPI_Datatype MpiController::Type(DataType dtype) const {
  switch (dtype) {
    case DataType::kFloat16: return half_type_;
    case DataType::kBFloat16: return bfloat16_type_;
    case DataType::kFloat32: return MPI_FLOAT;
    case DataType::kFloat64: return MPI_DOUBLE;
    case DataType::kInt32: return MPI_INT32_T;
    case DataType::kInt64: return MPI_INT64_T;
    case DataType::kUInt8: return MPI_UINT8_T;
    case DataType::kInt8: return MPI_INT8_T;
    case DataType::kBool: return MPI_BYTE;
    case DataType::kInt16: return MPI_INT16_T;
    case DataType::kUInt16: return MPI_UINT16_T;
  }
  return MPI_BYTE;
}

MPI_Op MpiController::Op(DataType dtype, ReduceOp op) const {
  if (dtype == DataType::kFloat16) return half_ops_[OpIndex(op)];
  if (dtype == DataType::kBFloat16) return bfloat16_ops_[OpIndex(op)];
  switch (op) {
    case ReduceOp::kAverage:
    case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMin: return MPI_MIN;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kProduct: return MPI_PROD;
  }
  return MPI_SUM;
}

Status MpiController::Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                                ReduceOp op) {
  switch (AllreduceAlgorithmFor(count, dtype)) {
    case AllreduceAlgorithm::kRing:
      return Ring(in, out, count, dtype, op, RingPart::kAllreduce);
    case AllreduceAlgorithm::kTorus:
      return Torus(in, out, count, dtype, op);
    case AllreduceAlgorithm::kHalvingDoubling:
    case AllreduceAlgorithm::kRecursiveDoubling:
      return Schedule(AllreduceAlgorithmFor(count, dtype), in, out, count, dtype, op);
    default:
      break;
  }
  const MPI_Datatype type = Type(dtype);
  const MPI_Op mpi_op = Op(dtype, op);
  const size_t item = DataTypeSize(dtype);
  for (int64_t done = 0; done < count;) {
    const int n = static_cast<int>(std::min<int64_t>(count - done, INT_MAX));
    char* dst = static_cast<char*>(out) + done * item;
    const void* src = in == out ? MPI_IN_PLACE : static_cast<const char*>(in) + done * item;
    std::vector<MPI_Request> request(1);
    Status s = Check(MPI_Iallreduce(src, dst, n, type, mpi_op, data_, request.data()),
                     "MPI_Iallreduce");
    if (s.ok()) s = Wait(&request, {-1}, "MPI_Iallreduce", WaitFor::kCollective);
    if (!s.ok()) return s;
    done += n;
  }
  return Status::OK();
}

Status MpiController::ReduceScatter(const void* in, void* out, int64_t count, DataType dtype,
                                    ReduceOp op) {
  if (size_ > 1) return Ring(in, out, count, dtype, op, RingPart::kReduceScatter);
  if (in != out) std::memcpy(out, in, static_cast<size_t>(count) * DataTypeSize(dtype));
  return failed_;
}

Status MpiController::AllgatherSegments(void* data, int64_t count, DataType dtype) {
  if (size_ == 1) return failed_;
  return Ring(data, data, count, dtype, ReduceOp::kSum, RingPart::kAllgather);
}

Status MpiController::Allgatherv(const void* in, void* out, const std::vector<int64_t>& counts,
                                 size_t unit_bytes) {
  if (!failed_.ok()) return failed_;
  if (!VectorLayout::Fits(counts, unit_bytes)) {
    // This rank's block goes to every rank: the same span for each.
    const Span mine{0, counts[rank_] * static_cast<int64_t>(unit_bytes)};
    const std::vector<Span> send(counts.size(), mine);
    return PairwiseExchange(static_cast<const char*>(in), send, static_cast<char*>(out),
                            Blocks(counts, unit_bytes), "allgather of 2 GiB or more");
  }
  VectorLayout layout;
  Status s = layout.Build(counts, unit_bytes);
  if (!s.ok()) return s;
  std::vector<MPI_Request> request(1);
  s = Check(MPI_Iallgatherv(in, layout.counts()[rank_], layout.type(), out, layout.counts(),
                            layout.displs(), layout.type(), data_, request.data()),
            "MPI_Iallgatherv");
  return s.ok() ? Wait(&request, {-1}, "MPI_Iallgatherv", WaitFor::kCollective) : s;
}

Status MpiController::Broadcast(void* data, int64_t bytes, int root) {
  constexpr int64_t kChunk = int64_t{1} << 30;
  for (int64_t done = 0; done < bytes; done += kChunk) {
    const int n = static_cast<int>(std::min(bytes - done, kChunk));
    std::vector<MPI_Request> request(1);
    Status s = Check(MPI_Ibcast(static_cast<char*>(data) + done, n, MPI_BYTE, root, data_,
                                request.data()),
                     "MPI_Ibcast");
    if (s.ok()) s = Wait(&request, {-1}, "MPI_Ibcast", WaitFor::kCollective);
    if (!s.ok()) return s;
  }
  return Status::OK();
}

Status MpiController::Alltoallv(const void* in, const std::vector<int64_t>& send_counts,
                                void* out, const std::vector<int64_t>& recv_counts,
                                size_t unit_bytes) {
  if (!failed_.ok()) return failed_;
  // Every rank must take the same path, and each knows only its own counts: they agree on it.
  int fits = VectorLayout::Fits(send_counts, unit_bytes) &&
             VectorLayout::Fits(recv_counts, unit_bytes);
  Status agreed = StartAndWait(
      [&](MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, &fits, 1, MPI_INT, MPI_LAND, data_, r);
      },
      "MPI_Iallreduce", WaitFor::kCollective);
  if (!agreed.ok()) return agreed;
  if (!fits) {
    return PairwiseExchange(static_cast<const char*>(in), Blocks(send_counts, unit_bytes),
                            static_cast<char*>(out), Blocks(recv_counts, unit_bytes),
                            "alltoall of 2 GiB or more");
  }
  VectorLayout send, recv;
  Status s = send.Build(send_counts, unit_bytes);
  if (s.ok()) s = recv.Build(recv_counts, unit_bytes);
  if (!s.ok()) return s;
  std::vector<MPI_Request> request(1);
  s = Check(MPI_Ialltoallv(in, send.counts(), send.displs(), send.type(), out, recv.counts(),
                           recv.displs(), recv.type(), data_, request.data()),
            "MPI_Ialltoallv");
  return s.ok() ? Wait(&request, {-1}, "MPI_Ialltoallv", WaitFor::kCollective) : s;
}

Status MpiController::PairwiseExchange(const char* in, const std::vector<Span>& send, char* out,
                                       const std::vector<Span>& recv, const char* what) {
  constexpr int64_t kMessageBytes = int64_t{1} << 30;
  constexpr int kExchangeTag = 22;  // the ring's is 21, on this communicator too
  const int n = size_, me = rank_;
  if (send[me].second > 0 && out + recv[me].first != in + send[me].first) {
    std::memcpy(out + recv[me].first, in + send[me].first, static_cast<size_t>(send[me].second));
  }
  for (int k = 1; k < n; ++k) {
    const int to = (me + k) % n, from = (me + n - k) % n;
    std::vector<MPI_Request> requests;
    std::vector<int> peers;
    Status s;
    // Posts `span` of `base`, to or from `peer`, in messages of at most kMessageBytes.
    auto post = [&](bool sending, char* base, const Span& span, int peer) {
      for (int64_t done = 0; s.ok() && done < span.second; done += kMessageBytes) {
        requests.emplace_back();
        peers.push_back(WorldRank(peer));
        char* at = base + span.first + done;
        const int bytes = static_cast<int>(std::min(kMessageBytes, span.second - done));
        s = sending ? Check(MPI_Isend(at, bytes, MPI_BYTE, peer, kExchangeTag, data_,
                                      &requests.back()), "MPI_Isend")
                    : Check(MPI_Irecv(at, bytes, MPI_BYTE, peer, kExchangeTag, data_,
                                      &requests.back()), "MPI_Irecv");
      }
    };
    post(false, out, recv[from], from);
    post(true, const_cast<char*>(in), send[to], to);  // MPI_Isend only reads it
    if (s.ok()) s = Wait(&requests, peers, what, WaitFor::kCollective);
    // A failed step leaves requests posted into buffers that will be gone: the end of the plane.
    if (!s.ok()) return Failed(s);
  }
  return Status::OK();
}

int MpiController::BarrierMessages() const {
  int rounds = 1;
  while ((1 << rounds) < size_) ++rounds;
  return rounds;
}

Status MpiController::Barrier() {
  std::vector<MPI_Request> request(1);
  Status s = Check(MPI_Ibarrier(data_, request.data()), "MPI_Ibarrier");
  return s.ok() ? Wait(&request, {-1}, "MPI_Ibarrier", WaitFor::kCollective) : s;
}

}  // namespace perseus
