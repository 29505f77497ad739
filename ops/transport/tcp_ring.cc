// The TCP transport's data plane: one nonblocking engine (Stream) and the collectives built on
// it: ring allreduce (reduce-scatter then allgather, chunked, so receiving, reducing and sending
// overlap) and each of its halves, recursive doubling for small allreduces, ring allgatherv,
// pipelined chain broadcast, pairwise alltoallv. Each runs over a Group of ranks: every rank, a
// process set's members, or a part of the hierarchical allreduce, over their connections of the
// mesh.
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/reduce.h"
#include "transport/tcp_controller.h"

namespace perseus {
namespace {

constexpr size_t kReduceChunkBytes = 256 << 10;
// Allreduces up to this size over a power-of-two group run by recursive doubling: log2(n)
// exchanges of the whole buffer instead of the ring's 2(n - 1) steps. For a small buffer the
// steps' latency is the cost (each a wake-up on both sides and a trip across the link), not
// its bytes: on 8 ranks the ring takes 14 steps, doubling 3, which carry 1.7x the ring's bytes
// (log2(n) against 2(n - 1)/n times the buffer).
constexpr size_t kDoublingMaxBytes = 64 << 10;

bool PowerOfTwo(int n) { return n > 0 && (n & (n - 1)) == 0; }

}  // namespace

Status TcpController::Stream(int send_peer, const std::vector<Piece>& sends, int recv_peer,
                             const std::vector<Piece>& recvs, int lag,
                             const Reduction* reduction) {
  if (!failed_.ok()) return failed_;
  const size_t item = reduction ? DataTypeSize(reduction->dtype) : 1;
  if (item == 0) {
    return Fail(Status::Error("perseus_legacy: no element size for dtype " +
                              std::to_string(static_cast<int>(reduction->dtype))));
  }
  const size_t chunk = std::max(item, kReduceChunkBytes / item * item);
  if (reduction && scratch_.size() < chunk) scratch_.resize(chunk);
  const std::vector<int> control = ControlPeers();
  size_t send_step = 0, sent = 0;      // piece being sent, bytes of it sent
  size_t recv_step = 0, received = 0;  // piece being received, bytes of it received
  size_t landed = 0;                   // bytes of that piece reduced / in place
  size_t chunk_fill = 0;               // received bytes waiting in scratch_
  double last_progress = Now();

  // How far the current send piece may go: what it forwards must have arrived first.
  auto send_limit = [&]() -> size_t {
    const size_t bytes = sends[send_step].bytes;
    if (lag < 0 || send_step < static_cast<size_t>(lag)) return bytes;
    const size_t source = send_step - lag;
    if (source < recv_step) return bytes;
    if (source == recv_step) return std::min(bytes, landed);
    return 0;
  };

  while (true) {
    while (send_step < sends.size() && sent == sends[send_step].bytes) {
      ++send_step;
      sent = 0;
    }
    while (recv_step < recvs.size() && landed == recvs[recv_step].bytes) {
      ++recv_step;
      received = landed = 0;
    }
    const bool sending = send_step < sends.size();
    const bool receiving = recv_step < recvs.size();
    if (!sending && !receiving) return Status::OK();

    bool progressed = false;
    size_t limit = sending ? send_limit() : 0;
    if (sending && sent < limit) {
      const ssize_t n = send(peers_[send_peer].data.fd(), sends[send_step].data + sent,
                             limit - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        sent += static_cast<size_t>(n);
        progressed = true;
      } else if (n < 0 && !WouldBlock(errno)) {
        return Lost(send_peer, "connection failed: " + Errno(errno));
      }
    }
    if (receiving) {
      const Piece& piece = recvs[recv_step];
      const bool reduce = reduction && recv_step < reduction->steps;
      char* target = reduce ? scratch_.data() + chunk_fill : piece.data + received;
      const size_t want = reduce ? std::min(chunk - chunk_fill, piece.bytes - received)
                                 : piece.bytes - received;
      const ssize_t n = recv(peers_[recv_peer].data.fd(), target, want, MSG_DONTWAIT);
      if (n > 0) {
        received += static_cast<size_t>(n);
        progressed = true;
        if (!reduce) {
          landed = received;
        } else {
          chunk_fill += static_cast<size_t>(n);
          if (chunk_fill == chunk || received == piece.bytes) {
            char* place = piece.data + landed;
            Reduce(reduction->dtype, reduction->op, scratch_.data(),
                   reduction->in + (place - reduction->out), place,
                   static_cast<int64_t>(chunk_fill / item));
            landed += chunk_fill;
            chunk_fill = 0;
          }
        }
      } else if (n == 0) {
        return Lost(recv_peer, "closed its connection (the process exited or was killed)");
      } else if (!WouldBlock(errno)) {
        return Lost(recv_peer, "connection failed: " + Errno(errno));
      }
    }
    const double now = Now();
    if (progressed) {
      last_progress = now;
      continue;
    }
    if (now - last_progress > silence_secs_) {
      const int silent = receiving ? recv_peer : send_peer;
      return Lost(silent, "stopped responding: no data moved for " +
                              Seconds(silence_secs_) + " s");
    }
    std::vector<pollfd> fds;
    if (sending && sent < limit) fds.push_back({peers_[send_peer].data.fd(), POLLOUT, 0});
    if (receiving) fds.push_back({peers_[recv_peer].data.fd(), POLLIN, 0});
    for (int peer : control) {
      const Peer& p = peers_[peer];
      fds.push_back({p.closed.empty() ? p.control.fd() : -1, POLLIN, 0});  // ended: nothing new
    }
    const int wait_ms = static_cast<int>(
        std::min(1000.0, (silence_secs_ - (now - last_progress)) * 1000) + 1);
    if (poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) {
      return Fail(Status::Error("perseus_legacy: poll failed: " + Errno(errno)));
    }
    // An abort notice or a closed control connection during a transfer fails it at once.
    for (const pollfd& entry : fds) {
      if (entry.revents == 0) continue;
      for (int peer : control) {
        if (entry.fd != peers_[peer].control.fd()) continue;
        Status s = PumpAll({peer});
        if (!s.ok()) return s;
      }
    }
  }
}

TcpController::Group TcpController::Everyone() const {
  Group group;
  for (int r = 0; r < size_; ++r) group.ranks.push_back(r);
  group.me = options_.rank;
  return group;
}

Status TcpController::Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                                ReduceOp op) {
  return GroupAllreduce(Everyone(), in, out, count, dtype, op);
}

Status TcpController::Allgatherv(const void* in, void* out, const std::vector<int64_t>& counts,
                                 size_t unit_bytes) {
  return GroupAllgatherv(Everyone(), in, out, counts, unit_bytes);
}

Status TcpController::Broadcast(void* data, int64_t bytes, int root) {
  return GroupBroadcast(Everyone(), data, bytes, root);
}

Status TcpController::Alltoallv(const void* in, const std::vector<int64_t>& send_counts,
                                void* out, const std::vector<int64_t>& recv_counts,
                                size_t unit_bytes) {
  return GroupAlltoallv(Everyone(), in, send_counts, out, recv_counts, unit_bytes);
}

Status TcpController::ReduceScatter(const void* in, void* out, int64_t count, DataType dtype,
                                    ReduceOp op) {
  return GroupRing(Everyone(), in, out, count, dtype, op, true, false);
}

Status TcpController::AllgatherSegments(void* data, int64_t count, DataType dtype) {
  return GroupRing(Everyone(), data, data, count, dtype, ReduceOp::kSum, false, true);
}

Status TcpController::GroupAllreduce(const Group& group, const void* in, void* out,
                                     int64_t count, DataType dtype, ReduceOp op) {
  // The choice depends only on what every rank of the group has alike (size, count, dtype).
  if (group.size() > 1 && PowerOfTwo(group.size()) &&
      static_cast<size_t>(count) * DataTypeSize(dtype) <= kDoublingMaxBytes) {
    return GroupDoubling(group, in, out, count, dtype, op);
  }
  return GroupRing(group, in, out, count, dtype, op, true, true);
}

// Exchange k swaps the partial result with the rank whose position differs in bit k and
// combines the two. Both sides compute op(theirs, mine) and op(mine, theirs) over the same
// values; every op is commutative, so every rank ends with the same bits.
Status TcpController::GroupDoubling(const Group& group, const void* in, void* out, int64_t count,
                                    DataType dtype, ReduceOp op) {
  if (!failed_.ok()) return failed_;
  const size_t bytes = static_cast<size_t>(count) * DataTypeSize(dtype);
  char* data = static_cast<char*>(out);
  const char* mine = static_cast<const char*>(in);  // what this rank holds before exchange k
  for (int bit = 1; bit < group.size(); bit <<= 1) {
    if (mine == data) {  // received bytes land in `out`, which must not be what is being sent
      exchange_.assign(data, data + bytes);
      mine = exchange_.data();
    }
    const int partner = group.ranks[group.me ^ bit];
    const Reduction reduction{dtype, op, 1, mine, data};
    Status s = Stream(partner, {{const_cast<char*>(mine), bytes}}, partner, {{data, bytes}}, -1,
                      &reduction);
    if (!s.ok()) return s;
    mine = data;
  }
  return Status::OK();
}

Status TcpController::GroupRing(const Group& group, const void* in, void* out, int64_t count,
                                DataType dtype, ReduceOp op, bool reduce_scatter,
                                bool allgather) {
  if (!failed_.ok()) return failed_;
  const size_t item = DataTypeSize(dtype);
  char* data = static_cast<char*>(out);
  const char* source = static_cast<const char*>(in);
  const int n = group.size(), me = group.me;
  if (n == 1 || count == 0) {
    if (in != out && reduce_scatter) std::memcpy(data, in, count * item);
    return Status::OK();
  }
  // The ring's segment s is segment s - 1 (SegmentStart), so that the reduce-scatter leaves
  // this rank's own segment, me, complete (controller.h).
  auto segment = [&](int s) {
    s = ((s - 1) % n + n) % n;
    const int64_t first = SegmentStart(count, n, s), last = SegmentStart(count, n, s + 1);
    return Piece{data + first * item, static_cast<size_t>(last - first) * item};
  };
  // Reduce-scatter: step t sends the ring's segment me - t and reduces segment me - t - 1 into
  // place; afterwards this rank holds the sum of the ring's segment me + 1. Allgather: step t
  // sends segment me + 1 - t and receives segment me - t. Every send forwards the previous
  // step's receipt, except the first, which sends this rank's own input: `out` is written only
  // by receipts (each reduction combines a receipt with `in`), so the input is never copied to
  // it first.
  std::vector<Piece> sends, recvs;
  for (int t = 0; reduce_scatter && t < n - 1; ++t) {
    Piece send = segment(me - t);
    if (t == 0) send.data = const_cast<char*>(source) + (send.data - data);
    sends.push_back(send);
    recvs.push_back(segment(me - t - 1));
  }
  for (int t = 0; allgather && t < n - 1; ++t) {
    sends.push_back(segment(me + 1 - t));
    recvs.push_back(segment(me - t));
  }
  const Reduction reduction{dtype, op, static_cast<size_t>(n - 1), source, data};
  return Stream(group.at(me + 1), sends, group.at(me - 1), recvs, 1,
                reduce_scatter ? &reduction : nullptr);
}

Status TcpController::GroupAllgatherv(const Group& group, const void* in, void* out,
                                      const std::vector<int64_t>& counts, size_t unit_bytes) {
  if (!failed_.ok()) return failed_;
  const int n = group.size(), me = group.me;
  char* data = static_cast<char*>(out);
  std::vector<size_t> offset(n + 1, 0);
  for (int r = 0; r < n; ++r) offset[r + 1] = offset[r] + counts[r] * unit_bytes;
  auto block = [&](int r) {
    r = ((r % n) + n) % n;
    return Piece{data + offset[r], offset[r + 1] - offset[r]};
  };
  if (block(me).bytes > 0 && block(me).data != in) {
    std::memcpy(block(me).data, in, block(me).bytes);
  }
  if (n == 1) return Status::OK();
  std::vector<Piece> sends, recvs;
  for (int t = 0; t < n - 1; ++t) {
    sends.push_back(block(me - t));
    recvs.push_back(block(me - t - 1));
  }
  return Stream(group.at(me + 1), sends, group.at(me - 1), recvs, 1, nullptr);
}

// A chain from the root around the ring, forwarded chunk by chunk as it arrives.
Status TcpController::GroupBroadcast(const Group& group, void* data, int64_t bytes, int root) {
  if (!failed_.ok()) return failed_;
  const int n = group.size();
  if (n == 1 || bytes == 0) return Status::OK();
  const int position = (group.me - root + n) % n;
  const Piece all{static_cast<char*>(data), static_cast<size_t>(bytes)};
  const int next = group.at(group.me + 1), prev = group.at(group.me - 1);
  std::vector<Piece> sends, recvs;
  if (position != n - 1) sends.push_back(all);
  if (position != 0) recvs.push_back(all);
  // The root sends at once; every other rank forwards what it has received so far.
  return Stream(sends.empty() ? -1 : next, sends, recvs.empty() ? -1 : prev, recvs,
                position == 0 ? -1 : 0, nullptr);
}

Status TcpController::GroupAlltoallv(const Group& group, const void* in,
                                     const std::vector<int64_t>& send_counts, void* out,
                                     const std::vector<int64_t>& recv_counts, size_t unit_bytes) {
  if (!failed_.ok()) return failed_;
  const int n = group.size(), me = group.me;
  std::vector<size_t> send_offset(n + 1, 0), recv_offset(n + 1, 0);
  for (int r = 0; r < n; ++r) {
    send_offset[r + 1] = send_offset[r] + send_counts[r] * unit_bytes;
    recv_offset[r + 1] = recv_offset[r] + recv_counts[r] * unit_bytes;
  }
  char* source = const_cast<char*>(static_cast<const char*>(in));
  char* target = static_cast<char*>(out);
  if (send_offset[me + 1] > send_offset[me]) {
    std::memcpy(target + recv_offset[me], source + send_offset[me],
                send_offset[me + 1] - send_offset[me]);
  }
  // Step k: send to me + k while receiving from me - k; every pair meets exactly once.
  for (int k = 1; k < n; ++k) {
    const int to = (me + k) % n, from = (me + n - k) % n;
    const std::vector<Piece> sends{{source + send_offset[to], send_offset[to + 1] - send_offset[to]}};
    const std::vector<Piece> recvs{
        {target + recv_offset[from], recv_offset[from + 1] - recv_offset[from]}};
    Status s = Stream(group.ranks[to], sends, group.ranks[from], recvs, -1, nullptr);
    if (!s.ok()) return s;
  }
  return Status::OK();
}

}  // namespace perseus
