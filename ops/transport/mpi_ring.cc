// The MPI transport's ring of point-to-point messages (reduce-scatter, then allgather), each rank
// sending to the next and receiving from the previous: the allreduce of large tensors, and its
// two halves on their own for the hierarchical allreduce (response_executor.cc); the torus as
// three such rings over the rows and columns of the ranks; and the
// halving-doubling and recursive doubling schedules (allreduce_algorithms.h) over the same
// messages. Which one runs: AllreduceAlgorithmFor. Every link
// carries 2(n-1)/n of the tensor, so a ring reaches the link rate across hosts, where Open MPI's
// nonblocking allreduce picks a binomial tree (the whole tensor each way, half the rate) for 2
// or 3 ranks and for in-place buffers. Each segment is reduced on one rank and then copied to
// all, so every rank ends with the same bits. Waits are the controller's bounded ones.
#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include "common/reduce.h"
#include "transport/mpi_controller.h"

namespace perseus {
namespace {

constexpr int kRingTag = 21;  // the control plane's tags are 17-20, on another communicator
// Chunks must be whole elements: a multiple of every DataTypeSize. Across hosts they fit the
// eager limit of Open MPI's TCP transport (btl_tcp_eager_limit, 64 KiB with a header of a few
// dozen bytes), which sends such a message at once; a larger one waits for the receiver to
// answer a handshake and then moves a few fragments at a time, each step only inside an MPI call
// of both ranks, whose gentle polling (Wait) leaves the link idle in between: 256 KiB chunks
// reached 0.6-0.85 of a 1 Gbit/s link at 4 MiB, eager ones 0.8-0.9 on the same loaded host.
// Within a host (shared memory, Open MPI's single copy: the receiving rank's own CPU does the copy,
// so smaller chunks overlap nothing) larger chunks cost fewer waits: with 512 KiB chunks the TF
// op took ~174 us a 1 MiB allreduce on 2 ranks, ~191 with 256 KiB ones (docs/performance.md).
constexpr int64_t kCrossHostChunkBytes = int64_t{63} << 10;
constexpr int64_t kOneHostChunkBytes = int64_t{512} << 10;
// The largest reduce-scatter scratch kept between allreduces.
constexpr size_t kKeptScratchBytes = size_t{64} << 20;

Status CheckRing(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return Status::OK();
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  return Status::Error(std::string("MPI error in ") + what + ": " + std::string(text, length));
}

}  // namespace

bool MpiController::UseRing(int64_t count, DataType dtype) const {
  const int64_t bytes = count * static_cast<int64_t>(DataTypeSize(dtype));
  return size_ > 1 && count >= size_ && bytes >= ring_min_bytes_;
}

AllreduceAlgorithm MpiController::AllreduceAlgorithmFor(int64_t count, DataType dtype) const {
  if (size_ == 1 || count == 0) return AllreduceAlgorithm::kTransport;
  const size_t bytes = static_cast<size_t>(count) * DataTypeSize(dtype);
  switch (policy_.algorithm) {
    case AllreduceAlgorithm::kAuto: {
      // Open MPI's own below ring_min_bytes_, unless a step costs what a wide network's does
      // (the cost model's step latency, PERSEUS_ALLREDUCE_HOP_LATENCY_US, e.g. measured by
      // `auto`): its algorithms for those sizes take more steps than the model's choice.
      if (!UseRing(count, dtype) && policy_.hop_latency_secs < kWideHopSecs) {
        return AllreduceAlgorithm::kTransport;
      }
      const AllreduceAlgorithm chosen = ChooseAllreduce(size_, bytes, policy_);
      const bool rings =
          chosen == AllreduceAlgorithm::kRing || chosen == AllreduceAlgorithm::kTorus;
      return rings && count < size_ ? AllreduceAlgorithm::kRecursiveDoubling : chosen;
    }
    case AllreduceAlgorithm::kRing:  // a segment per rank, at least one element each
      return count >= size_ ? AllreduceAlgorithm::kRing : AllreduceAlgorithm::kTransport;
    default:
      return policy_.algorithm;
  }
}

Status MpiController::ScratchFor(size_t bytes, int64_t count, DataType dtype) {
  try {
    if (ring_scratch_.size() < bytes) ring_scratch_.resize(bytes);
  } catch (const std::bad_alloc&) {
    // Nothing is posted yet: the error names the size instead of a bad_alloc on the thread.
    return Failed(Status::Error("perseus_legacy: rank " + std::to_string(WorldRank(rank_)) +
                                " cannot allocate " + std::to_string(bytes) +
                                " bytes for the allreduce of " + std::to_string(count) + " " +
                                DataTypeName(dtype) + " elements"));
  }
  return Status::OK();
}

// Each step posts its receives and sends in chunks (the ring's sizes: eager across hosts) and
// combines each received chunk as it arrives.
Status MpiController::Schedule(AllreduceAlgorithm algorithm, const void* in, void* out,
                               int64_t count, DataType dtype, ReduceOp op) {
  if (!failed_.ok()) return failed_;
  const int64_t item = static_cast<int64_t>(DataTypeSize(dtype));
  const int64_t chunk = ring_crosses_hosts_ ? kCrossHostChunkBytes : kOneHostChunkBytes;
  char* data = static_cast<char*>(out);
  Status s;
  for (const AllreduceStep& step : AllreduceSchedule(algorithm, size_, rank_, count)) {
    const char* mine = step.from_input ? static_cast<const char*>(in) : data;
    const int64_t send_bytes = step.send_peer >= 0 ? step.send_count * item : 0;
    const int64_t recv_bytes = step.recv_peer >= 0 ? step.recv_count * item : 0;
    const char* from = mine + step.send_first * item;
    // Recursive doubling sends the values that its receipts replace: a copy is sent.
    if (send_bytes > 0 && from == data + step.send_first * item && step.combine &&
        step.send_first < step.recv_first + step.recv_count &&
        step.recv_first < step.send_first + step.send_count) {
      exchange_.assign(from, from + send_bytes);
      from = exchange_.data();
    }
    if (step.combine && recv_bytes > 0) {
      s = ScratchFor(static_cast<size_t>(recv_bytes), count, dtype);
      if (!s.ok()) return s;
    }
    char* into = step.combine ? ring_scratch_.data() : data + step.recv_first * item;
    const int64_t recv_chunks = (recv_bytes + chunk - 1) / chunk;
    const int64_t send_chunks = (send_bytes + chunk - 1) / chunk;
    std::vector<MPI_Request> receiving(static_cast<size_t>(recv_chunks), MPI_REQUEST_NULL);
    std::vector<MPI_Request> sending(static_cast<size_t>(send_chunks), MPI_REQUEST_NULL);
    const auto piece = [&](int64_t total, int64_t k) {
      return static_cast<int>(std::min(chunk, total - k * chunk));
    };
    for (int64_t k = 0; s.ok() && k < recv_chunks; ++k) {
      s = CheckRing(MPI_Irecv(into + k * chunk, piece(recv_bytes, k), MPI_BYTE, step.recv_peer,
                              kRingTag, data_, &receiving[static_cast<size_t>(k)]),
                    "MPI_Irecv");
    }
    for (int64_t k = 0; s.ok() && k < send_chunks; ++k) {
      s = CheckRing(MPI_Isend(from + k * chunk, piece(send_bytes, k), MPI_BYTE, step.send_peer,
                              kRingTag, data_, &sending[static_cast<size_t>(k)]),
                    "MPI_Isend");
    }
    for (int64_t k = 0; s.ok() && k < recv_chunks; ++k) {
      std::vector<MPI_Request> one{receiving[static_cast<size_t>(k)]};
      receiving[static_cast<size_t>(k)] = MPI_REQUEST_NULL;
      s = Wait(&one, {WorldRank(step.recv_peer)}, "allreduce", WaitFor::kRing);
      if (s.ok() && step.combine) {
        const int64_t at = step.recv_first * item + k * chunk;
        const char* theirs = ring_scratch_.data() + k * chunk;
        Reduce(dtype, op, step.mine_first ? mine + at : theirs,
               step.mine_first ? theirs : mine + at, data + at, piece(recv_bytes, k) / item);
      }
    }
    if (s.ok() && !sending.empty()) {
      s = Wait(&sending, std::vector<int>(sending.size(), WorldRank(step.send_peer)), "allreduce",
               WaitFor::kRing);
    }
    if (!s.ok()) break;
  }
  if (!s.ok() && failed_.ok()) failed_ = s;
  if (s.ok() && ring_scratch_.size() > kKeptScratchBytes) std::vector<char>().swap(ring_scratch_);
  return s;
}

Status MpiController::Ring(const void* in, void* out, int64_t count, DataType dtype,
                           ReduceOp op, RingPart part) {
  std::vector<int> everyone(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) everyone[static_cast<size_t>(r)] = r;
  return RingOver(everyone, rank_, in, out, count, dtype, op, part);
}

// The same segments as TcpController::GroupTorus (allreduce_algorithms.h).
Status MpiController::Torus(const void* in, void* out, int64_t count, DataType dtype,
                            ReduceOp op) {
  int x = 1, y = 1;
  TorusShape(size_, &x, &y);
  const int row = rank_ / x, column = rank_ % x;
  std::vector<int> along, down;
  TorusLines(size_, x, rank_, &along, &down);
  Status s = RingOver(along, column, in, out, count, dtype, op, RingPart::kReduceScatter);
  const int64_t first = SegmentStart(count, x, column);
  char* part = static_cast<char*>(out) + first * static_cast<int64_t>(DataTypeSize(dtype));
  const int64_t part_count = SegmentStart(count, x, column + 1) - first;
  if (s.ok()) s = RingOver(down, row, part, part, part_count, dtype, op, RingPart::kAllreduce);
  if (s.ok()) s = RingOver(along, column, out, out, count, dtype, op, RingPart::kAllgather);
  return s;
}

Status MpiController::RingOver(const std::vector<int>& members, int at, const void* in,
                               void* out, int64_t count, DataType dtype, ReduceOp op,
                               RingPart part) {
  if (!failed_.ok()) return failed_;
  const int n = static_cast<int>(members.size()), me = at;
  if (n == 1) {
    if (part != RingPart::kAllgather && in != out) {
      std::memcpy(out, in, static_cast<size_t>(count) * DataTypeSize(dtype));
    }
    return Status::OK();
  }
  const int64_t item = static_cast<int64_t>(DataTypeSize(dtype));
  char* data = static_cast<char*>(out);
  const char* source = part == RingPart::kAllgather ? data : static_cast<const char*>(in);
  // Segment s (SegmentStart) is the ring's s + 1: this rank ends the reduce-scatter holding
  // the ring's segment me + 1, which is then its own segment me (controller.h).
  const auto segment = [&](int s) { return ((s - 1) % n + n) % n; };
  const auto first = [&](int seg) { return SegmentStart(count, n, seg); };
  const int next = members[static_cast<size_t>((me + 1) % n)];
  const int prev = members[static_cast<size_t>((me + n - 1) % n)];
  const std::vector<int> peers{WorldRank(prev), WorldRank(next)};
  // The same on every rank of the ring: the sizes of the chunks sent and received must agree.
  const int64_t chunk = ring_crosses_hosts_ ? kCrossHostChunkBytes : kOneHostChunkBytes;
  // A reduce-scatter step receives into scratch only when the output is the input: otherwise
  // straight into the output's segment, reduced there (one buffer fewer through the caches and
  // none kept: 2 ranks on one host, 64 MiB out of place took 10-15 ms instead of 15-18).
  const bool into_scratch = part != RingPart::kAllgather && source == data;
  if (into_scratch) {
    Status s = ScratchFor(static_cast<size_t>((count / n + 1) * item), count, dtype);
    if (!s.ok()) return s;
  }

  // Steps [begin, end) of 2(n - 1): step j sends segment sent(j) to the next rank and receives
  // segment received(j) from the previous one. The first n - 1 (reduce-scatter) receive into
  // the output (scratch when in place) and reduce with this rank's input there; after them this
  // rank holds its segment complete, and the last n - 1 (allgather) receive complete segments
  // straight into place. The input is read where it lies (the first step sends from it),
  // never copied to the output first. Each step sends what the one before received, so the
  // steps overlap chunk by chunk: chunk k of step j + 1 leaves as soon as chunk k of step j has
  // arrived (and been reduced), and the link never waits for a whole step. One large message
  // would also move at about half the rate of the same bytes in chunks over Open MPI's TCP
  // transport.
  const int begin = part == RingPart::kAllgather ? n - 1 : 0;
  const int end = part == RingPart::kReduceScatter ? n - 1 : 2 * (n - 1);
  const auto reduces = [&](int j) { return j < n - 1; };
  const auto received = [&](int j) {
    return reduces(j) ? segment(me - j - 1) : segment(me - j + n - 1);
  };
  const auto sent = [&](int j) { return j == 0 ? segment(me) : received(j - 1); };
  const auto chunks = [&](int seg) {
    return ((first(seg + 1) - first(seg)) * item + chunk - 1) / chunk;
  };
  const auto chunk_bytes = [&](int seg, int64_t k) {
    return static_cast<int>(std::min(chunk, (first(seg + 1) - first(seg)) * item - k * chunk));
  };
  const int64_t max_chunks = (count / n + 1) * item / chunk + 1;
  // The send still reading chunk k of segment s, by s * max_chunks + k: a receive into that
  // chunk waits for it first.
  std::vector<MPI_Request> sending(static_cast<size_t>(n * max_chunks), MPI_REQUEST_NULL);
  std::vector<MPI_Request> receiving(static_cast<size_t>(max_chunks), MPI_REQUEST_NULL);
  const auto wait_one = [&](MPI_Request* request, int peer) {
    if (*request == MPI_REQUEST_NULL) return Status::OK();
    std::vector<MPI_Request> one{*request};
    *request = MPI_REQUEST_NULL;
    return Wait(&one, {peer}, "ring allreduce", WaitFor::kRing);
  };
  // Where chunk k of step j arrives: its place in the output, or scratch for a reduce-scatter
  // step in place.
  const auto receipt = [&](int j, int64_t k) {
    const bool scratch = into_scratch && reduces(j);
    return (scratch ? ring_scratch_.data() : data + first(received(j)) * item) + k * chunk;
  };
  const auto post_receive = [&](int j, int64_t k) {
    const int seg = received(j);
    if (!reduces(j)) {
      Status s = wait_one(&sending[static_cast<size_t>(seg * max_chunks + k)], peers[1]);
      if (!s.ok()) return s;
    }
    return CheckRing(MPI_Irecv(receipt(j, k), chunk_bytes(seg, k), MPI_BYTE, prev,
                               kRingTag, data_, &receiving[static_cast<size_t>(k)]),
                     "MPI_Irecv");
  };
  const auto post_send = [&](int j, int64_t k) {
    const int seg = sent(j);
    const char* from = j == 0 ? source : data;
    Status s = wait_one(&sending[static_cast<size_t>(seg * max_chunks + k)], peers[1]);
    if (!s.ok()) return s;
    return CheckRing(MPI_Isend(from + first(seg) * item + k * chunk,
                               chunk_bytes(seg, k), MPI_BYTE, next, kRingTag, data_,
                               &sending[static_cast<size_t>(seg * max_chunks + k)]),
                     "MPI_Isend");
  };

  Status s;
  for (int64_t k = 0; s.ok() && k < chunks(received(begin)); ++k) s = post_receive(begin, k);
  for (int64_t k = 0; s.ok() && k < chunks(sent(begin)); ++k) s = post_send(begin, k);
  for (int j = begin; s.ok() && j < end; ++j) {
    const int seg = received(j);
    const int64_t here = chunks(seg), then = j + 1 < end ? chunks(received(j + 1)) : 0;
    for (int64_t k = 0; s.ok() && k < here; ++k) {
      s = wait_one(&receiving[static_cast<size_t>(k)], peers[0]);
      if (!s.ok()) break;
      if (reduces(j)) {
        const int64_t at = first(seg) * item + k * chunk;
        Reduce(dtype, op, receipt(j, k), source + at, data + at, chunk_bytes(seg, k) / item);
      }
      if (k < then) s = post_receive(j + 1, k);
      if (s.ok() && j + 1 < end) s = post_send(j + 1, k);
    }
    for (int64_t k = here; s.ok() && k < then; ++k) s = post_receive(j + 1, k);
  }
  for (MPI_Request& request : sending) {
    if (s.ok()) s = wait_one(&request, peers[1]);
  }
  if (!s.ok() && failed_.ok()) failed_ = s;
  // A segment of a large tensor is not held until the next allreduce (a tensor of 2 GiB on two
  // ranks: 1 GiB). After a failure receives may still be posted into it: kept.
  if (s.ok() && ring_scratch_.size() > kKeptScratchBytes) std::vector<char>().swap(ring_scratch_);
  return s;
}

}  // namespace perseus
