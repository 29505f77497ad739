// The TCP transport's data plane: one nonblocking engine (Streams) and the collectives built on
// it: ring allreduce (reduce-scatter then allgather, chunked, so receiving, reducing and sending
// overlap) and each of its halves, halving-doubling, recursive doubling and the torus
// (allreduce_algorithms.h), the hierarchical allreduce with its phases overlapped, ring
// allgatherv, pipelined chain broadcast, pairwise alltoallv. Each runs over a Group of ranks:
// every rank, a process set's members, or a part of the hierarchical allreduce or of the torus,
// over their connections of the mesh.
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/reduce.h"
#include "transport/tcp_controller.h"

namespace perseus {

Status TcpController::Streams(const std::vector<Lane>& lanes) {
  if (!failed_.ok()) return failed_;
  // Where each lane stands: the piece being sent and the bytes of it sent, the piece being
  // received, the bytes of it received and those reduced / in place, and the received bytes
  // waiting in the lane's scratch.
  struct Progress {
    size_t send_step = 0, sent = 0;
    size_t recv_step = 0, received = 0, landed = 0;
    size_t chunk_fill = 0;
    size_t item = 1, chunk = 0;
  };
  std::vector<Progress> at(lanes.size());
  if (scratch_.size() < lanes.size()) scratch_.resize(lanes.size());
  for (size_t i = 0; i < lanes.size(); ++i) {
    if (lanes[i].reduction.steps == 0) continue;
    const size_t item = DataTypeSize(lanes[i].reduction.dtype);
    if (item == 0) {
      return Fail(Status::Error("perseus_legacy: no element size for dtype " +
                                std::to_string(static_cast<int>(lanes[i].reduction.dtype))));
    }
    at[i].item = item;
    at[i].chunk = std::max(item, kRingReduceChunkBytes / item * item);
    if (scratch_[i].size() < at[i].chunk) scratch_[i].resize(at[i].chunk);
  }
  const std::vector<int> control = ControlPeers();
  double last_progress = Now();

  // How far lane i's current send piece may go: what it forwards must have arrived first.
  auto send_limit = [&](size_t i) -> size_t {
    const Lane& lane = lanes[i];
    const Progress& p = at[i];
    const size_t bytes = lane.sends[p.send_step].bytes;
    if (lane.lag < 0 || p.send_step < static_cast<size_t>(lane.lag)) return bytes;
    const size_t source = p.send_step - lane.lag;
    if (source < p.recv_step) return bytes;
    if (source == p.recv_step) return std::min(bytes, p.landed);
    return 0;
  };

  std::vector<pollfd> fds;
  while (true) {
    bool active = false, progressed = false;
    int silent = -1;  // whom a lane still waits on, should nothing move for too long
    fds.clear();
    for (size_t i = 0; i < lanes.size(); ++i) {
      const Lane& lane = lanes[i];
      Progress& p = at[i];
      while (p.send_step < lane.sends.size() && p.sent == lane.sends[p.send_step].bytes) {
        ++p.send_step;
        p.sent = 0;
      }
      while (p.recv_step < lane.recvs.size() && p.landed == lane.recvs[p.recv_step].bytes) {
        ++p.recv_step;
        p.received = p.landed = 0;
      }
      const bool sending = p.send_step < lane.sends.size();
      const bool receiving = p.recv_step < lane.recvs.size();
      if (!sending && !receiving) continue;
      active = true;
      if (silent < 0) silent = receiving ? lane.recv_peer : lane.send_peer;

      const size_t limit = sending ? send_limit(i) : 0;
      if (sending && p.sent < limit) {
        const ssize_t n = send(peers_[lane.send_peer].data.fd(),
                               lane.sends[p.send_step].data + p.sent, limit - p.sent,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
          p.sent += static_cast<size_t>(n);
          progressed = true;
        } else if (n < 0 && !WouldBlock(errno)) {
          return Lost(lane.send_peer, "connection failed: " + Errno(errno));
        }
      }
      if (receiving) {
        const Piece& piece = lane.recvs[p.recv_step];
        const bool reduce = p.recv_step < lane.reduction.steps;
        char* target = reduce ? scratch_[i].data() + p.chunk_fill : piece.data + p.received;
        const size_t want = reduce ? std::min(p.chunk - p.chunk_fill, piece.bytes - p.received)
                                   : piece.bytes - p.received;
        const ssize_t n = recv(peers_[lane.recv_peer].data.fd(), target, want, MSG_DONTWAIT);
        if (n > 0) {
          p.received += static_cast<size_t>(n);
          progressed = true;
          if (!reduce) {
            p.landed = p.received;
          } else {
            p.chunk_fill += static_cast<size_t>(n);
            if (p.chunk_fill == p.chunk || p.received == piece.bytes) {
              char* place = piece.data + p.landed;
              const Reduction& r = lane.reduction;
              const char* mine = r.in + (place - r.out);
              const char* theirs = scratch_[i].data();
              Reduce(r.dtype, r.op, r.mine_first ? mine : theirs, r.mine_first ? theirs : mine,
                     place, static_cast<int64_t>(p.chunk_fill / p.item));
              p.landed += p.chunk_fill;
              p.chunk_fill = 0;
            }
          }
        } else if (n == 0) {
          return Lost(lane.recv_peer, "closed its connection (the process exited or was killed)");
        } else if (!WouldBlock(errno)) {
          return Lost(lane.recv_peer, "connection failed: " + Errno(errno));
        }
      }
      // What to wait for should no lane move: recomputed on the next pass when one did.
      if (sending && p.sent < limit) fds.push_back({peers_[lane.send_peer].data.fd(), POLLOUT, 0});
      if (receiving) fds.push_back({peers_[lane.recv_peer].data.fd(), POLLIN, 0});
    }
    if (!active) return Status::OK();
    const double now = Now();
    if (progressed) {
      last_progress = now;
      continue;
    }
    if (now - last_progress > silence_secs_) {
      return Lost(silent, "stopped responding: no data moved for " + Seconds(silence_secs_) +
                              " s");
    }
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

AllreduceAlgorithm TcpController::GroupAlgorithm(const Group& group, int64_t count,
                                                 DataType dtype) const {
  if (group.size() == 1 || count == 0) return AllreduceAlgorithm::kRing;  // nothing moves
  return ChooseAllreduce(group.size(), static_cast<size_t>(count) * DataTypeSize(dtype), policy_);
}

Status TcpController::GroupAllreduce(const Group& group, const void* in, void* out,
                                     int64_t count, DataType dtype, ReduceOp op) {
  // The choice depends only on what every rank of the group has alike (size, count, dtype, the
  // policy).
  const AllreduceAlgorithm algorithm = GroupAlgorithm(group, count, dtype);
  if (algorithm == AllreduceAlgorithm::kTorus) {
    return GroupTorus(group, in, out, count, dtype, op);
  }
  if (algorithm == AllreduceAlgorithm::kHalvingDoubling ||
      algorithm == AllreduceAlgorithm::kRecursiveDoubling) {
    return GroupSchedule(group, algorithm, in, out, count, dtype, op);
  }
  return GroupRing(group, in, out, count, dtype, op, true, true);
}

// Each step is one lane of the engine: what it receives is combined as it arrives, chunk by
// chunk, with this rank's current values (its input until the first combination, then `out`).
Status TcpController::GroupSchedule(const Group& group, AllreduceAlgorithm algorithm,
                                    const void* in, void* out, int64_t count, DataType dtype,
                                    ReduceOp op) {
  if (!failed_.ok()) return failed_;
  const size_t item = DataTypeSize(dtype);
  char* data = static_cast<char*>(out);
  for (const AllreduceStep& step : AllreduceSchedule(algorithm, group.size(), group.me, count)) {
    const char* mine = step.from_input ? static_cast<const char*>(in) : data;
    Lane lane;
    lane.reduction = Reduction{dtype, op, step.combine ? size_t{1} : 0, mine, data,
                               step.mine_first};
    if (step.send_peer >= 0 && step.send_count > 0) {
      const char* from = mine + step.send_first * static_cast<int64_t>(item);
      const size_t bytes = static_cast<size_t>(step.send_count) * item;
      // Recursive doubling sends the values that its receipts replace: a copy is sent.
      if (from == data + step.send_first * static_cast<int64_t>(item) && step.combine &&
          step.recv_count > 0 && step.send_first < step.recv_first + step.recv_count &&
          step.recv_first < step.send_first + step.send_count) {
        exchange_.assign(from, from + bytes);
        from = exchange_.data();
      }
      lane.send_peer = group.ranks[step.send_peer];
      lane.sends.push_back({const_cast<char*>(from), bytes});
    }
    if (step.recv_peer >= 0 && step.recv_count > 0) {
      lane.recv_peer = group.ranks[step.recv_peer];
      lane.recvs.push_back({data + step.recv_first * static_cast<int64_t>(item),
                            static_cast<size_t>(step.recv_count) * item});
    } else {
      lane.reduction.steps = 0;
    }
    Status s = Streams({lane});
    if (!s.ok()) return s;
  }
  return Status::OK();
}

void TcpController::TorusLines(const Group& group, int x, Group* along, Group* down) {
  perseus::TorusLines(group.size(), x, group.me, &along->ranks, &down->ranks);
  for (int& position : along->ranks) position = group.ranks[position];
  for (int& position : down->ranks) position = group.ranks[position];
  along->me = group.me % x;
  down->me = group.me / x;
}

// Three rings, each streamed like GroupRing; from kPipelineMinBytes, where the cost model says it
// pays (TorusOverlapPays), the rows' phases and the columns' overlap on slices of the tensor
// (Pipelined), so that no connection idles between them.
Status TcpController::GroupTorus(const Group& group, const void* in, void* out, int64_t count,
                                 DataType dtype, ReduceOp op) {
  int x = 1, y = 1;
  TorusShape(group.size(), &x, &y);
  if (x == 1) return GroupRing(group, in, out, count, dtype, op, true, true);  // one column
  Group along, down;
  TorusLines(group, x, &along, &down);
  const size_t item = DataTypeSize(dtype);
  const size_t bytes = static_cast<size_t>(count) * item;
  const int slices = PipelineSlices(bytes);
  if (bytes >= kPipelineMinBytes &&
      TorusOverlapPays(group.size(), static_cast<double>(bytes), slices, policy_)) {
    return Pipelined(along, down, false, slices, in, out, count, dtype, op);
  }
  // After the reduce-scatter along the row, this rank's part (segment `column`) is in `out`.
  Status s = GroupRing(along, in, out, count, dtype, op, true, false);
  const int64_t first = SegmentStart(count, x, along.me);
  void* part = static_cast<char*>(out) + first * static_cast<int64_t>(item);
  const int64_t part_count = SegmentStart(count, x, along.me + 1) - first;
  if (s.ok()) s = GroupRing(down, part, part, part_count, dtype, op, true, true);
  if (s.ok()) s = GroupRing(along, out, out, count, dtype, op, false, true);
  return s;
}

Status TcpController::GroupRing(const Group& group, const void* in, void* out, int64_t count,
                                DataType dtype, ReduceOp op, bool reduce_scatter,
                                bool allgather) {
  if (!failed_.ok()) return failed_;
  if (group.size() == 1 || count == 0) {
    if (in != out && reduce_scatter) std::memcpy(out, in, count * DataTypeSize(dtype));
    return Status::OK();
  }
  return Streams({RingLane(group, in, out, count, dtype, op, reduce_scatter, allgather)});
}

TcpController::Lane TcpController::RingLane(const Group& group, const void* in, void* out,
                                            int64_t count, DataType dtype, ReduceOp op,
                                            bool reduce_scatter, bool allgather) const {
  const size_t item = DataTypeSize(dtype);
  char* data = static_cast<char*>(out);
  const char* source = static_cast<const char*>(in);
  const int n = group.size(), me = group.me;
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
  Lane lane;
  lane.send_peer = group.at(me + 1);
  lane.recv_peer = group.at(me - 1);
  lane.lag = 1;
  for (int t = 0; reduce_scatter && t < n - 1; ++t) {
    Piece send = segment(me - t);
    if (t == 0) send.data = const_cast<char*>(source) + (send.data - data);
    lane.sends.push_back(send);
    lane.recvs.push_back(segment(me - t - 1));
  }
  for (int t = 0; allgather && t < n - 1; ++t) {
    lane.sends.push_back(segment(me + 1 - t));
    lane.recvs.push_back(segment(me - t));
  }
  lane.reduction = Reduction{dtype, op, reduce_scatter ? static_cast<size_t>(n - 1) : 0, source,
                             data};
  return lane;
}

Status TcpController::HierarchicalAllreduce(const void* in, void* out, int64_t count,
                                            DataType dtype, ReduceOp op, const char** how,
                                            AllreduceAlgorithm* across) {
  // The plan depends only on what every rank of the job has alike (the count, the dtype, the
  // layout and the policy), so all of them take the same path.
  const size_t bytes = static_cast<size_t>(count) * DataTypeSize(dtype);
  const HierarchicalPlan plan =
      ChooseHierarchical(local_group_.size(), cross_group_.size(), bytes, policy_);
  if (plan.slices == 0) {
    return Controller::HierarchicalAllreduce(in, out, count, dtype, op, how, across);
  }
  *how = kHierarchicalPipelined;
  *across = plan.across;
  return Pipelined(local_group_, cross_group_, plan.across == AllreduceAlgorithm::kTorus,
                   plan.slices, in, out, count, dtype, op);
}

// The tensor is cut into slices that go through the phases one stage apart. With a ring over
// `outer`, in stage k the inner group reduce-scatters slice k and allgathers slice k - 2 (one
// lane: they share its connections) while the outer ring allreduces this rank's segment of slice
// k - 1. With a torus over `outer` (rows of x > 1), a slice's outer part takes three stages: in
// stage k the torus's row reduce-scatters slice k - 1 and allgathers slice k - 3 (one lane), its
// column allreduces its part of slice k - 2, and the inner group reduce-scatters slice k and
// allgathers slice k - 4. The lanes of a stage use different connections: the inner group, the
// row and the column have only this rank in common. A link then idles only while the pipeline
// fills and drains, where phases one after another left each group's links idle during the
// others' phases (and TCP's window closed again on a connection idle for long). Every rank runs
// the same stages; a connection carries each stage's bytes in the same order on both of its
// ends, so a rank a stage ahead only waits.
Status TcpController::Pipelined(const Group& inner, const Group& outer, bool torus, int slices,
                                const void* in, void* out, int64_t count, DataType dtype,
                                ReduceOp op) {
  if (!failed_.ok()) return failed_;
  const size_t item = DataTypeSize(dtype);
  const int local_size = inner.size(), me = inner.me;
  int x = 1, y = outer.size();
  if (torus) TorusShape(outer.size(), &x, &y);
  Group along, down;
  TorusLines(outer, x, &along, &down);
  const int column = along.me;
  const int depth = x > 1 ? 4 : 2;  // stages from a slice's inner reduce-scatter to its allgather
  auto first = [&](int k) { return SegmentStart(count, slices, k); };
  auto at = [&](const void* base, int64_t element) {
    return const_cast<char*>(static_cast<const char*>(base)) + element * static_cast<int64_t>(item);
  };
  // This rank's segment of slice k (the inner reduce-scatter leaves it there), and its part of
  // that segment along the outer torus's row: {first element, count}.
  auto segment_of = [&](int k) {
    const int64_t n = first(k + 1) - first(k);
    const int64_t offset = SegmentStart(n, local_size, me);
    return std::make_pair(first(k) + offset, SegmentStart(n, local_size, me + 1) - offset);
  };
  auto part_of = [&](int k) {
    const auto [start, n] = segment_of(k);
    const int64_t offset = SegmentStart(n, x, column);
    return std::make_pair(start + offset, SegmentStart(n, x, column + 1) - offset);
  };
  // A reduce-scatter of slice `scatter` then an allgather of slice `gather` over `group` (each
  // when in [0, slices)) on `range`'s elements, as one lane.
  auto both = [&](const Group& group, int scatter, int gather, auto range, bool whole) {
    Lane lane;
    if (scatter >= 0 && scatter < slices) {
      const auto [start, n] = range(scatter);
      lane = RingLane(group, at(whole ? in : out, start), at(out, start), n, dtype, op, true,
                      false);
    }
    if (gather >= 0 && gather < slices) {
      const auto [start, n] = range(gather);
      Lane g = RingLane(group, at(out, start), at(out, start), n, dtype, op, false, true);
      if (lane.sends.empty() && lane.recvs.empty()) {
        lane = g;
      } else {  // after the reduce-scatter's pieces: its reduced receipts stay the first ones
        lane.sends.insert(lane.sends.end(), g.sends.begin(), g.sends.end());
        lane.recvs.insert(lane.recvs.end(), g.recvs.begin(), g.recvs.end());
      }
    }
    return lane;
  };
  auto whole_slice = [&](int k) { return std::make_pair(first(k), first(k + 1) - first(k)); };
  for (int stage = 0; stage < slices + depth; ++stage) {
    std::vector<Lane> lanes;
    lanes.push_back(both(inner, stage, stage - depth, whole_slice, true));
    if (x > 1) {
      lanes.push_back(both(along, stage - 1, stage - 3, segment_of, false));
      if (stage >= 2 && stage < slices + 2) {
        const auto [start, n] = part_of(stage - 2);
        lanes.push_back(RingLane(down, at(out, start), at(out, start), n, dtype, op, true, true));
      }
    } else if (stage >= 1 && stage <= slices) {
      const auto [start, n] = segment_of(stage - 1);
      lanes.push_back(RingLane(down, at(out, start), at(out, start), n, dtype, op, true, true));
    }
    Status s = Streams(lanes);
    if (!s.ok()) return s;
  }
  return Status::OK();
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
  return Streams({{group.at(me + 1), std::move(sends), group.at(me - 1), std::move(recvs), 1}});
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
  return Streams({{sends.empty() ? -1 : next, std::move(sends), recvs.empty() ? -1 : prev,
                   std::move(recvs), position == 0 ? -1 : 0}});
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
    Status s = Streams(
        {{group.ranks[to],
          {{source + send_offset[to], send_offset[to + 1] - send_offset[to]}},
          group.ranks[from],
          {{target + recv_offset[from], recv_offset[from + 1] - recv_offset[from]}}}});
    if (!s.ok()) return s;
  }
  return Status::OK();
}

}  // namespace perseus
