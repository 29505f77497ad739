// The TCP transport's control plane: authenticated, length-prefixed frames between rank 0 and
// every other rank (negotiation messages, and abort notices that carry the first failure to every
// rank), and what happens when a peer is lost.
//
// A frame: kind (u32), reserved (u32), payload length (u64), payload, then an HMAC-SHA-256 of the
// sender's and receiver's ranks, the frame's sequence number on its connection, the header and the
// payload, keyed by that connection's handshake (TcpController::ControlKey). The length is checked
// against kMaxControlMessageBytes before anything waits for the payload.
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "transport/tcp_auth.h"
#include "transport/tcp_controller.h"

namespace perseus {
namespace {

constexpr uint32_t kFrameMessage = 1;
constexpr uint32_t kFrameAbort = 2;
constexpr size_t kFrameHeaderBytes = 16;  // kind (u32), reserved (u32), length (u64)
constexpr size_t kFrameMacBytes = 32;
// Messages a peer may have sent ahead of this rank's reading them; the protocol needs two.
constexpr size_t kMaxQueuedMessages = 16;
// A rank waiting for the coordinator's answer allows it this much more than the silence limit.
// When another rank is the silent one, the coordinator, which waits on it directly, reaches the
// limit first and its abort notice names that rank; without the margin the waiting ranks, whose
// waits began a little earlier, would name rank 0 instead.
constexpr double kCoordinatorGraceSecs = 2.0;

std::string U64(uint64_t value) { return U32(value & 0xffffffffu) + U32(value >> 32); }

Digest FrameMac(const HmacKey& key, int sender, int receiver, uint64_t sequence,
                const char* frame, size_t bytes) {
  return key.Mac(U32(sender) + U32(receiver) + U64(sequence) + std::string(frame, bytes));
}

// A message this rank may not send (kMaxControlMessageBytes), named before anything is sent.
Status TooLarge(const char* what, size_t bytes) {
  return Status::Error(std::string("perseus_legacy: ") + what + " of " + std::to_string(bytes) +
                       " bytes exceeds the control plane's limit of " +
                       std::to_string(kMaxControlMessageBytes) + " bytes (too many tensors "
                       "negotiated at once?)");
}

}  // namespace

std::string TcpController::Seal(int peer, uint32_t kind, const std::string& payload) {
  Peer& p = peers_[peer];
  std::string frame = U32(kind) + U32(0) + U64(payload.size()) + payload;
  const Digest mac = FrameMac(p.control_key, options_.rank, peer, p.frames_sent++, frame.data(),
                              frame.size());
  return frame.append(mac.begin(), mac.end());
}

void TcpController::QueueMessage(int peer, const std::string& message) {
  peers_[peer].outbox += Seal(peer, kFrameMessage, message);
}

// The complete frames at the front of `peer`'s inbox: messages are queued, an abort notice ends
// the taking (kAbort, `text`: the notice). A frame whose MAC does not match (altered, injected,
// replayed or out of order), an unknown kind or a length beyond the limit: kBad, `text` says
// which; nothing of it is acted on.
TcpController::Pumped TcpController::TakeFrames(int peer, std::string* text) {
  Peer& p = peers_[peer];
  size_t taken = 0;
  Pumped result = Pumped::kOk;
  while (p.inbox.size() - taken >= kFrameHeaderBytes) {
    const char* frame = p.inbox.data() + taken;
    const uint32_t kind = ReadU32(frame);
    const uint64_t length = ReadU32(frame + 8) | (uint64_t{ReadU32(frame + 12)} << 32);
    if (kind != kFrameMessage && kind != kFrameAbort) {
      *text = "sent a malformed control frame (kind " + std::to_string(kind) + ")";
      return Pumped::kBad;
    }
    if (length > kMaxControlMessageBytes) {
      *text = "sent a control frame of " + std::to_string(length) + " bytes, beyond the limit of " +
              std::to_string(kMaxControlMessageBytes) + " bytes";
      return Pumped::kBad;
    }
    const size_t whole = kFrameHeaderBytes + length + kFrameMacBytes;
    if (p.inbox.size() - taken < whole) break;
    Digest got;
    std::copy(frame + whole - kFrameMacBytes, frame + whole, got.begin());
    const Digest expected = FrameMac(p.control_key, peer, options_.rank, p.frames_received,
                                     frame, whole - kFrameMacBytes);
    if (!DigestsEqual(got, expected)) {
      *text = "sent control frame " + std::to_string(p.frames_received) + " with a MAC that " +
              "does not match its connection's key: the frame was altered or injected on the " +
              "way, and nothing of it was used";
      return Pumped::kBad;
    }
    ++p.frames_received;
    std::string payload(frame + kFrameHeaderBytes, length);
    taken += whole;
    if (kind == kFrameAbort) {
      *text = std::move(payload);
      result = Pumped::kAbort;
      break;
    }
    if (p.messages.size() >= kMaxQueuedMessages) {
      *text = "sent more than " + std::to_string(kMaxQueuedMessages) +
              " control messages ahead of this rank";
      return Pumped::kBad;
    }
    p.messages.push_back(std::move(payload));
  }
  p.inbox.erase(0, taken);
  return result;
}

// ---------------------------------------------------------------------------------------------
// Failures

std::vector<int> TcpController::ControlPeers() const {
  std::vector<int> out;
  for (int peer = 0; peer < size_; ++peer) {
    if (peers_[peer].control.valid()) out.push_back(peer);
  }
  return out;
}

// Reads what `peer`'s control socket has; parses complete frames. An abort notice ends the
// pumping (`text` gets the notice). A closed socket does too (`text`: why), but only once every
// complete message that came before the end has been taken: one read may bring a final answer
// together with the end of the stream, and the answer is what the rank must act on.
// Frames are taken after every read, so the inbox never holds more than one frame in progress and
// one read.
TcpController::Pumped TcpController::Pump(int peer, std::string* text) {
  Peer& p = peers_[peer];
  char buffer[64 << 10];
  while (true) {
    const Pumped taken = TakeFrames(peer, text);
    if (taken != Pumped::kOk) return taken;
    if (!p.closed.empty()) break;
    const ssize_t n = recv(p.control.fd(), buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n > 0) {
      p.inbox.append(buffer, static_cast<size_t>(n));
      control_received_ += static_cast<uint64_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && WouldBlock(errno)) break;
    p.closed = n == 0 ? "closed its connection (the process exited or was killed)"
                      : "connection failed: " + Errno(errno);
  }
  if (p.closed.empty() || !p.messages.empty()) return Pumped::kOk;
  *text = p.closed;
  return Pumped::kClosed;
}

Status TcpController::PumpAll(const std::vector<int>& peers) {
  for (int peer : peers) {
    std::string text;
    switch (Pump(peer, &text)) {
      case Pumped::kOk: break;
      case Pumped::kAbort: return Fail(Status::Error(text));
      case Pumped::kClosed: return Lost(peer, text);
      case Pumped::kBad:
        return Fail(Status::Error("perseus_legacy: " + Describe(peer) + " " + text));
    }
  }
  return Status::OK();
}

// `peer` is gone. Another rank may have failed first (and `peer` only left because of it):
// wait briefly for an abort notice that names the original failure.
Status TcpController::Lost(int peer, const std::string& what) {
  if (!failed_.ok()) return failed_;
  const double until = Now() + kNoticeWaitSecs;
  std::vector<int> watched = ControlPeers();
  while (!watched.empty() && Now() < until) {
    std::vector<pollfd> fds;
    for (int p : watched) fds.push_back({peers_[p].control.fd(), POLLIN, 0});
    poll(fds.data(), fds.size(), 100);
    for (size_t i = 0; i < watched.size();) {
      std::string text;
      const Pumped pumped = Pump(watched[i], &text);
      if (pumped == Pumped::kAbort) return Fail(Status::Error(text));
      if (pumped == Pumped::kBad) {
        return Fail(Status::Error("perseus_legacy: " + Describe(watched[i]) + " " + text));
      }
      if (pumped == Pumped::kClosed) {
        watched.erase(watched.begin() + i);
      } else {
        ++i;
      }
    }
  }
  return Fail(Status::Error("perseus_legacy: " + Describe(peer) + " " + what));
}

// Records the first failure, tells the other ranks (through rank 0) and stops sending.
Status TcpController::Fail(const Status& status) {
  if (!failed_.ok()) return failed_;
  failed_ = status;
  for (int peer : ControlPeers()) peers_[peer].outbox += Seal(peer, kFrameAbort, status.message());
  // Best effort and bounded: a peer that reads nothing must not hold this rank.
  const double until = Now() + kNoticeWaitSecs;
  while (Now() < until) {
    std::vector<pollfd> fds;
    for (int peer : ControlPeers()) {
      Peer& p = peers_[peer];
      while (!p.outbox.empty()) {
        const ssize_t n = send(p.control.fd(), p.outbox.data(), p.outbox.size(),
                               MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
          p.outbox.erase(0, static_cast<size_t>(n));
        } else if (n < 0 && WouldBlock(errno)) {
          fds.push_back({p.control.fd(), POLLOUT, 0});
          break;
        } else {
          p.outbox.clear();
        }
      }
    }
    if (fds.empty()) break;
    poll(fds.data(), fds.size(), 100);
  }
  for (Peer& p : peers_) {
    for (Socket* socket : {&p.control, &p.data}) {
      if (socket->valid()) shutdown(socket->fd(), SHUT_WR);
    }
  }
  return failed_;
}

// ---------------------------------------------------------------------------------------------
// Control plane

Status TcpController::ControlExchange(const std::vector<int>& await_from, double limit_secs) {
  const std::vector<int> control = ControlPeers();
  double last_progress = Now();
  while (true) {
    bool progressed = false, pending = false;
    std::vector<pollfd> fds;
    for (int peer : control) {
      Peer& p = peers_[peer];
      short events = POLLIN;
      if (!p.outbox.empty()) {
        const ssize_t n = send(p.control.fd(), p.outbox.data(), p.outbox.size(),
                               MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
          p.outbox.erase(0, static_cast<size_t>(n));
          progressed = true;
        } else if (n < 0 && !WouldBlock(errno)) {
          return Lost(peer, "connection failed: " + Errno(errno));
        }
        if (!p.outbox.empty()) {
          pending = true;
          events |= POLLOUT;
        }
      }
      // A stream that has ended stays readable: poll it no more (its messages are queued).
      fds.push_back({p.closed.empty() ? p.control.fd() : -1, events, 0});
    }
    const uint64_t before = control_received_;
    Status s = PumpAll(control);
    if (!s.ok()) return s;
    progressed = progressed || control_received_ != before;
    std::vector<int> silent;
    for (int peer : await_from) {
      if (peers_[peer].messages.empty()) silent.push_back(peer);
    }
    if (!pending && silent.empty()) return Status::OK();
    const double now = Now();
    if (progressed) {
      last_progress = now;
      continue;
    }
    if (now - last_progress > limit_secs) {
      if (silent.empty()) silent = control;
      return Lost(silent.front(), "stopped responding: nothing from ranks " + RankList(silent) +
                                      " for " + Seconds(limit_secs) + " s");
    }
    const int wait_ms = static_cast<int>(std::min(1000.0, (limit_secs - (now - last_progress)) *
                                                               1000) + 1);
    if (poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) {
      return Fail(Status::Error("perseus_legacy: poll failed: " + Errno(errno)));
    }
  }
}

Status TcpController::GatherToCoordinator(const std::string& mine,
                                          std::vector<std::string>* all) {
  if (!failed_.ok()) return failed_;
  if (mine.size() > kMaxControlMessageBytes) {
    return Fail(TooLarge("this rank's requests", mine.size()));
  }
  if (options_.rank != 0) {
    QueueMessage(0, mine);
    return ControlExchange({}, silence_secs_);
  }
  std::vector<int> others;
  for (int peer = 1; peer < size_; ++peer) others.push_back(peer);
  Status s = ControlExchange(others, silence_secs_);
  if (!s.ok()) return s;
  all->assign(size_, std::string());
  (*all)[0] = mine;
  for (int peer : others) {
    (*all)[peer] = std::move(peers_[peer].messages.front());
    peers_[peer].messages.pop_front();
  }
  return Status::OK();
}

Status TcpController::BroadcastFromCoordinator(std::string* bytes) {
  if (!failed_.ok()) return failed_;
  if (options_.rank == 0) {
    if (bytes->size() > kMaxControlMessageBytes) {
      return Fail(TooLarge("the coordinator's answer", bytes->size()));
    }
    for (int peer = 1; peer < size_; ++peer) QueueMessage(peer, *bytes);
    return ControlExchange({}, silence_secs_);
  }
  Status s = ControlExchange({0}, silence_secs_ + kCoordinatorGraceSecs);
  if (!s.ok()) return s;
  *bytes = std::move(peers_[0].messages.front());
  peers_[0].messages.pop_front();
  return Status::OK();
}

Status TcpController::Barrier() {
  std::vector<std::string> ignored;
  Status s = GatherToCoordinator(std::string(), &ignored);
  std::string nothing;
  return s.ok() ? BroadcastFromCoordinator(&nothing) : s;
}

}  // namespace perseus
