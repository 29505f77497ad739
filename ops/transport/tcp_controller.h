// The Controller over TCP, for jobs launched without MPI (TF_CONFIG, `perseusrun --tcp`).
//
// Start-up (tcp_rendezvous.cc): every rank listens on its own address; each rank dials every
// lower rank once (the data mesh) and rank 0 once more (the control star), from its own address.
// Each connection proves the job secret both ways (HMAC-SHA-256 challenge / response, tcp_auth.h),
// bound to the job: a digest of its address list. A rank runs all its accepted handshakes at once
// (one poll loop, a deadline each). Pending handshakes are counted per source address: each host
// of a rank that dials this one has slots of its own, every other address shares the strangers'
// slots, and a newer connection drops only the oldest of its own source's; so no flood from
// elsewhere can drop a real rank's handshake, however slow its link. Each refusal is logged on
// the listening rank with its address and what was wrong (the first few of each kind, then a
// count). Ranks that do not arrive within the start timeout are listed, with any refused
// connection from their own address that claimed to be one of them. The dialer's whole
// handshake is bounded by the start timeout too.
// Control plane (tcp_control.cc): length-prefixed frames between rank 0 and each rank
// (negotiation messages, and abort notices that carry the first failure to every rank), each
// authenticated by an HMAC-SHA-256 with a key of that connection's handshake and a sequence
// number, so an altered, injected, replayed or reordered frame fails the job naming the peer.
// Data plane (tcp_ring.cc): raw bytes between pairs, moved by one nonblocking engine: ring
// allreduce (reduce-scatter then allgather, chunked, so receiving, reducing and sending
// overlap), halving-doubling and recursive doubling (allreduce_algorithms.h: the cost model
// picks one per size and group), ring allgatherv, pipelined chain broadcast,
// pairwise alltoallv. A closed socket, an abort notice or a peer silent for kPeerSilenceSecs (or
// PERSEUS_STALL_SHUTDOWN_SECS when that is shorter: SetWaitLimits) fails the operation on every
// rank with an error naming the peer.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "transport/allreduce_algorithms.h"
#include "transport/options.h"
#include "transport/controller.h"
#include "transport/tcp_auth.h"
#include "transport/tcp_socket.h"

namespace perseus {

class TcpController : public Controller {
 public:
  // Unconnected: CreateTcpController (its registration) meets the other ranks.
  explicit TcpController(const TcpOptions& options);
  // Closes every connection gracefully (see the definition).
  ~TcpController() override;

  TcpController(const TcpController&) = delete;
  TcpController& operator=(const TcpController&) = delete;

  int rank() const override { return options_.rank; }
  int size() const override { return size_; }
  int local_rank() const override { return options_.local_rank; }
  int local_size() const override { return options_.local_size; }
  int cross_rank() const override { return options_.cross_rank; }
  int cross_size() const override { return options_.cross_size; }
  bool threads_supported() const override { return false; }
  std::string name() const override { return "tcp"; }
  void Abort(const std::string& reason) override { static_cast<void>(Fail(Status::Error(reason))); }
  // A peer silent for `shutdown_secs` (when > 0 and below kPeerSilenceSecs; at least
  // kMinSilenceSecs) counts as lost: a frozen rank or a cut link is noticed at the stall limit
  // (what elastic runs regroup on).
  void SetWaitLimits(double warning_secs, double shutdown_secs) override;

  Status GatherToCoordinator(const std::string& mine, std::vector<std::string>* all) override;
  Status BroadcastFromCoordinator(std::string* bytes) override;

  Status Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                   ReduceOp op) override;
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& counts,
                    size_t unit_bytes) override;
  Status Broadcast(void* data, int64_t bytes, int root) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_counts, void* out,
                   const std::vector<int64_t>& recv_counts, size_t unit_bytes) override;
  Status Barrier() override;
  Status ReduceScatter(const void* in, void* out, int64_t count, DataType dtype,
                       ReduceOp op) override;
  Status AllgatherSegments(void* data, int64_t count, DataType dtype) override;
  void SetAllreducePolicy(const AllreducePolicy& policy) override { policy_ = policy; }
  AllreduceAlgorithm AllreduceAlgorithmFor(int64_t count, DataType dtype) const override {
    return GroupAlgorithm(Everyone(), count, dtype);
  }
  Controller* local() override { return local_.get(); }
  Controller* cross() override { return cross_.get(); }
  Status HierarchicalAllreduce(const void* in, void* out, int64_t count, DataType dtype,
                               ReduceOp op, const char** how,
                               AllreduceAlgorithm* across) override;
  // Over the data mesh's connections between `ranks`: no communication (tcp_process_set.cc).
  Status CreateProcessSet(const std::vector<int>& ranks, std::unique_ptr<Controller>* out) override;

  // The ranks a data-plane operation runs over, in order, and this rank's position among them.
  struct Group {
    std::vector<int> ranks;
    int me = 0;
    int size() const { return static_cast<int>(ranks.size()); }
    // The rank at `position`, taken around the ring (negative and past-the-end wrap).
    int at(int position) const { return ranks[((position % size()) + size()) % size()]; }
  };
  // The collectives over `group`; counts, splits and the root are by position in the group.
  Status GroupAllreduce(const Group& group, const void* in, void* out, int64_t count,
                        DataType dtype, ReduceOp op);
  // What GroupAllreduce runs for `count` elements of `dtype` over `group` (the policy's choice).
  AllreduceAlgorithm GroupAlgorithm(const Group& group, int64_t count, DataType dtype) const;
  // Halving-doubling or recursive doubling over `group` (AllreduceSchedule), a step at a time.
  Status GroupSchedule(const Group& group, AllreduceAlgorithm algorithm, const void* in, void* out,
                       int64_t count, DataType dtype, ReduceOp op);
  // The torus over `group` (allreduce_algorithms.h) as three rings, each streamed like
  // GroupRing: a reduce-scatter along this rank's row, an allreduce of its part down its
  // column, an allgather along its row (large tensors: Pipelined).
  Status GroupTorus(const Group& group, const void* in, void* out, int64_t count, DataType dtype,
                    ReduceOp op);
  // The ring allreduce's reduce-scatter, its allgather, or both (GroupAllreduce), with the
  // segments of Controller::ReduceScatter / AllgatherSegments.
  Status GroupRing(const Group& group, const void* in, void* out, int64_t count, DataType dtype,
                   ReduceOp op, bool reduce_scatter, bool allgather);
  Status GroupAllgatherv(const Group& group, const void* in, void* out,
                         const std::vector<int64_t>& counts, size_t unit_bytes);
  Status GroupBroadcast(const Group& group, void* data, int64_t bytes, int root);
  Status GroupAlltoallv(const Group& group, const void* in, const std::vector<int64_t>& send_counts,
                        void* out, const std::vector<int64_t>& recv_counts, size_t unit_bytes);

 private:
  struct Peer {
    Socket control;  // rank 0 <-> this peer (on rank 0: one per peer; elsewhere: to rank 0 only)
    Socket data;     // this rank <-> the peer
    HmacKey control_key;         // the control connection's frame key (from its handshake)
    uint64_t frames_sent = 0;    // control frames sealed for this peer so far
    uint64_t frames_received = 0;  // control frames from it verified so far
    std::string inbox;                 // control bytes received and not yet parsed
    std::deque<std::string> messages;  // complete control messages, oldest first
    std::string outbox;                // control bytes still to send
    // Why the control stream ended, once it has; reported only after its messages are taken.
    std::string closed;
  };
  // Bytes a data transfer sends or receives, in order.
  struct Piece {
    char* data;
    size_t bytes;
  };
  // Received pieces [0, steps) are reduced with `op` into their place in `out`, each with the
  // bytes at the same offset of `in` (which may be `out`); later ones land there as they are.
  // steps == 0: nothing is reduced. mine_first: op(in, received), else op(received, in).
  struct Reduction {
    DataType dtype;
    ReduceOp op;
    size_t steps = 0;
    const char* in;
    const char* out;
    bool mine_first = false;
  };
  // One transfer of the engine: `sends` to send_peer while receiving `recvs` from recv_peer.
  // With lag >= 0, send piece i waits for received piece i - lag, chunk by chunk (what a ring
  // forwards is what it just received); lag < 0: sends never wait. Lanes that run at once
  // must not share a direction of a connection.
  struct Lane {
    int send_peer = -1;
    std::vector<Piece> sends;
    int recv_peer = -1;
    std::vector<Piece> recvs;
    int lag = -1;
    Reduction reduction{};
  };
  // kBad: a frame failed its MAC or broke the framing (`text` says how); the job fails at once.
  enum class Pumped { kOk, kAbort, kClosed, kBad };

  Group Everyone() const;
  friend Status CreateTcpController(const TransportOptions& options,
                                    std::unique_ptr<Controller>* out);
  Status Rendezvous();
  struct Pending;
  void AcceptLoop(int listener, double deadline, const std::atomic<bool>* stop,
                  std::vector<std::string>* unproven);
  bool ClaimFits(const std::string& claim, std::string* why) const;
  Status AcceptOne(int fd, const std::string& nonce, const std::string& claim);
  // The key of the control frames of a connection whose handshake used these nonces.
  HmacKey ControlKey(const std::string& listener_nonce, const std::string& dialer_nonce,
                         int listener, int dialer) const;
  // `refused`: set when the peer refused our proof of the secret.
  Status Dial(int peer, int channel, double deadline, bool* refused);
  Status StartupBarrier(double deadline);
  // local_ and cross_ from the hosts of the ranks' addresses, when the layout allows
  // (tcp_process_set.cc).
  void SetupHierarchy();

  // The one data-plane engine: runs every lane to its end at once, over nonblocking sockets.
  Status Streams(const std::vector<Lane>& lanes);
  // A ring's reduce-scatter, allgather or both over `group` as one lane (GroupRing).
  Lane RingLane(const Group& group, const void* in, void* out, int64_t count, DataType dtype,
                ReduceOp op, bool reduce_scatter, bool allgather) const;
  // An allreduce in three phases overlapped on `slices` slices of the tensor (tcp_ring.cc): a
  // reduce-scatter over `inner`, an allreduce of this rank's segment over `outer` (a ring, or
  // with `torus` the torus's phases as stages of their own), an allgather over `inner`. The
  // hierarchical allreduce (inner: the host's ranks, outer: one rank a host) and a large torus
  // (inner: its row, outer: its column).
  Status Pipelined(const Group& inner, const Group& outer, bool torus, int slices,
                   const void* in, void* out, int64_t count, DataType dtype, ReduceOp op);
  // The torus's row (`along`) and column (`down`) through this rank, for rows of x.
  static void TorusLines(const Group& group, int x, Group* along, Group* down);
  // Queues `message` for `peer`'s control connection; ControlExchange sends it.
  void QueueMessage(int peer, const std::string& message);
  // One control frame to `peer`: header, payload and its MAC (the next of this connection).
  std::string Seal(int peer, uint32_t kind, const std::string& payload);
  // Takes the complete frames of `peer`'s inbox, each checked against its MAC.
  Pumped TakeFrames(int peer, std::string* text);
  // Flushes every outbox and waits until each of `await_from` has a control message queued.
  Status ControlExchange(const std::vector<int>& await_from, double limit_secs);
  Pumped Pump(int peer, std::string* text);
  std::vector<int> ControlPeers() const;
  Status PumpAll(const std::vector<int>& peers);
  Status Lost(int peer, const std::string& what);
  Status Fail(const Status& status);
  std::string Describe(int peer) const;

  TcpOptions options_;
  int size_;
  // SHA-256 of the job's address list: every handshake proves it, so that two jobs sharing a
  // secret cannot connect to each other.
  std::string job_digest_;
  sockaddr_storage own_address_{};  // this rank's address: the source of the connections it dials
  socklen_t own_address_length_ = 0;
  std::vector<Peer> peers_;
  std::vector<std::vector<char>> scratch_;  // per lane: one received chunk, before it is reduced
  std::vector<char> exchange_;  // what recursive doubling sends while `out` receives
  AllreducePolicy policy_;      // which allreduce algorithm runs (GroupAlgorithm)
  Status failed_;              // the first failure; every later call returns it
  double silence_secs_ = kPeerSilenceSecs;  // how long a silent peer is waited for
  uint64_t control_received_ = 0;  // control bytes received so far (progress of a wait)
  // The hierarchical allreduce's groups over the mesh (local(), cross()); null when it does not
  // apply. Declared last: destroyed first.
  std::unique_ptr<Controller> local_, cross_;
  Group local_group_, cross_group_;  // their ranks
};

}  // namespace perseus
