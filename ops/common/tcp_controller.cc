#include "tcp_controller.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "reduce.h"
#include "tcp_auth.h"

namespace perseus {
namespace {

constexpr int kDataChannel = 0;
constexpr int kControlChannel = 1;
constexpr char kMagic[8] = {'P', 'E', 'R', 'S', 'E', 'U', 'S', '1'};
constexpr size_t kNonceBytes = 32;
constexpr double kHandshakeSecs = 10.0;  // one connection's handshake, once it is accepted
// A peer that moves no byte for this long while we wait on it is taken for dead (a frozen
// process or a vanished host; a closed socket is noticed at once).
constexpr double kPeerSilenceSecs = 30.0;
// How long a rank that lost a peer waits for an abort notice naming the original failure.
constexpr double kNoticeWaitSecs = 2.0;
constexpr size_t kReduceChunkBytes = 256 << 10;
constexpr uint32_t kFrameMessage = 1;
constexpr uint32_t kFrameAbort = 2;
constexpr size_t kFrameHeaderBytes = 16;  // kind (u32), reserved (u32), length (u64)
constexpr uint64_t kMaxFrameBytes = uint64_t{1} << 31;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string Errno(int error) {
  std::string text = std::strerror(error);
  if (error == ECONNRESET || error == EPIPE) text += " (the process exited or was killed)";
  return text;
}

bool WouldBlock(int error) {
  return error == EAGAIN || error == EWOULDBLOCK || error == EINTR;
}

std::string U32(uint32_t value) {
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return out;
}

uint32_t ReadU32(const char* p) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= uint32_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return value;
}

std::string Frame(uint32_t kind, const std::string& payload) {
  std::string out = U32(kind) + U32(0);
  const uint64_t length = payload.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((length >> (8 * i)) & 0xff));
  return out + payload;
}

std::string AsString(const Digest& digest) { return std::string(digest.begin(), digest.end()); }

// "host:port" or "[v6]:port" -> host, port.
bool SplitAddress(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() > 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  return true;
}

Status Resolve(const std::string& address, sockaddr_storage* out, socklen_t* length) {
  std::string host, port;
  if (!SplitAddress(address, &host, &port)) {
    return Status::Error("perseus_legacy: \"" + address + "\" is not a host:port address");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0) {
    return Status::Error("perseus_legacy: cannot resolve \"" + address + "\": " +
                         gai_strerror(rc));
  }
  std::memcpy(out, found->ai_addr, found->ai_addrlen);
  *length = found->ai_addrlen;
  freeaddrinfo(found);
  return Status::OK();
}

std::string PeerName(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (address.ss_family == AF_INET) {
    auto* v4 = reinterpret_cast<sockaddr_in*>(&address);
    inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
    port = ntohs(v4->sin_port);
  } else if (address.ss_family == AF_INET6) {
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&address);
    inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof(host));
    port = ntohs(v6->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

void SetTimeouts(int fd, double seconds) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(seconds);
  tv.tv_usec = static_cast<suseconds_t>((seconds - tv.tv_sec) * 1e6);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// Blocking I/O for the handshake (bounded by SetTimeouts).
Status WriteFully(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::Error(n < 0 ? Errno(errno) : "connection closed");
    done += static_cast<size_t>(n);
  }
  return Status::OK();
}

Status ReadFully(int fd, size_t bytes, std::string* out) {
  out->assign(bytes, '\0');
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = recv(fd, &(*out)[done], bytes - done, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return Status::Error(WouldBlock(errno) ? "timed out" : Errno(errno));
    }
    if (n == 0) return Status::Error("connection closed");
    done += static_cast<size_t>(n);
  }
  return Status::OK();
}

// Steady-state socket settings: nonblocking, no Nagle delay, and keepalive probes plus a user
// timeout so that a vanished host is noticed even when no byte is in flight.
void Tune(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  const int idle = 10, interval = 5, probes = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  const unsigned int user_timeout_ms = static_cast<unsigned int>(kPeerSilenceSecs * 1000);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
  SetTimeouts(fd, 0);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

std::string RankList(const std::vector<int>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out + "]";
}

std::string Seconds(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

void Log(int rank, const std::string& text) {
  std::fprintf(stderr, "perseus_legacy[rank %d]: %s\n", rank, text.c_str());
  std::fflush(stderr);
}

}  // namespace

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    Close();
    fd_ = other.Release();
  }
  return *this;
}

int Socket::Release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void Socket::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

TcpController::TcpController(const TcpOptions& options)
    : options_(options),
      size_(static_cast<int>(options.addresses.size())),
      peers_(options.addresses.size()) {}

// A socket closed with unread bytes in it sends a reset, and a reset can make the peer drop
// what it has received but not read yet (such as the coordinator's last answer, announcing a
// shutdown). So: send our end-of-stream, read and discard until the peer's (bounded), then close.
TcpController::~TcpController() {
  std::vector<pollfd> open;
  for (Peer& p : peers_) {
    for (Socket* socket : {&p.control, &p.data}) {
      if (!socket->valid()) continue;
      shutdown(socket->fd(), SHUT_WR);
      open.push_back({socket->fd(), POLLIN, 0});
    }
  }
  const double until = Now() + kNoticeWaitSecs;
  char sink[4096];
  while (!open.empty() && Now() < until) {
    poll(open.data(), open.size(), 50);
    for (size_t i = 0; i < open.size();) {
      const ssize_t n = open[i].revents ? recv(open[i].fd, sink, sizeof sink, MSG_DONTWAIT) : -1;
      if (open[i].revents && (n == 0 || (n < 0 && !WouldBlock(errno)))) {
        open.erase(open.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      open[i].revents = 0;
      ++i;
    }
  }
}

Status TcpController::Create(const TcpOptions& options, std::unique_ptr<Controller>* out) {
  const int size = static_cast<int>(options.addresses.size());
  if (size < 1 || options.rank < 0 || options.rank >= size) {
    return Status::Error("perseus_legacy: TCP rank " + std::to_string(options.rank) +
                         " is outside a job of " + std::to_string(size) + " addresses");
  }
  if (options.secret.empty()) {
    return Status::Error("perseus_legacy: the TCP controller needs a job secret "
                         "(PERSEUS_SECRET), the same on every rank");
  }
  auto controller = std::make_unique<TcpController>(options);
  Status s = controller->Rendezvous();
  if (s.ok()) *out = std::move(controller);
  return s;
}

std::string TcpController::Describe(int peer) const {
  return "rank " + std::to_string(peer) + " (" + options_.addresses[peer] + ")";
}

// ---------------------------------------------------------------------------------------------
// Start-up

Status TcpController::Rendezvous() {
  const int me = options_.rank;
  const double deadline = Now() + options_.start_timeout_secs;
  const std::string limit = "PERSEUS_START_TIMEOUT=" + Seconds(options_.start_timeout_secs) +
                            " s";
  sockaddr_storage address{};
  socklen_t length = 0;
  Status s = Resolve(options_.addresses[me], &address, &length);
  if (!s.ok()) return s;
  Socket listener(socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const int one = 1;
  if (listener.valid()) setsockopt(listener.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (!listener.valid() ||
      bind(listener.fd(), reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      listen(listener.fd(), 2 * size_ + 8) != 0) {
    return Status::Error("perseus_legacy: rank " + std::to_string(me) + " cannot listen on " +
                         "its address " + options_.addresses[me] + ": " + Errno(errno) +
                         " (each task's address must belong to the machine it runs on)");
  }

  // Higher ranks dial us while we dial the lower ones.
  std::atomic<bool> stop{false};
  std::string accept_error;
  std::thread acceptor(&TcpController::AcceptLoop, this, listener.fd(), deadline, &stop,
                       &accept_error);
  if (me != 0) s = Dial(0, kControlChannel, deadline);
  for (int peer = 0; peer < me && s.ok(); ++peer) s = Dial(peer, kDataChannel, deadline);
  if (!s.ok()) stop = true;  // the acceptor polls `stop` between waits of at most 200 ms
  acceptor.join();
  listener.Close();  // nobody joins after start-up
  if (!s.ok()) return Fail(s);

  std::vector<int> missing;
  for (int peer = me + 1; peer < size_; ++peer) {
    if (!peers_[peer].data.valid() || (me == 0 && !peers_[peer].control.valid())) {
      missing.push_back(peer);
    }
  }
  if (!missing.empty()) {
    std::string expected;
    for (int peer : missing) expected += "; rank " + std::to_string(peer) + " at " +
                                         options_.addresses[peer];
    return Fail(Status::Error(
        "perseus_legacy: ranks " + RankList(missing) + " never arrived at rank " +
        std::to_string(me) + " (" + options_.addresses[me] + ") within " + limit +
        expected + (accept_error.empty() ? "" : "; last refused connection: " + accept_error)));
  }
  for (Peer& peer : peers_) {
    if (peer.control.valid()) Tune(peer.control.fd());
    if (peer.data.valid()) Tune(peer.data.fd());
  }
  return StartupBarrier(deadline);
}

// Every rank is connected to its peers; wait until all of them are (rank 0 knows).
Status TcpController::StartupBarrier(double deadline) {
  const double limit = std::max(1.0, deadline - Now()) + kPeerSilenceSecs;
  Status s;
  if (options_.rank != 0) {
    peers_[0].outbox += Frame(kFrameMessage, "ready");
    s = ControlExchange({0}, limit);
  } else {
    std::vector<int> everyone;
    for (int peer = 1; peer < size_; ++peer) everyone.push_back(peer);
    s = ControlExchange(everyone, limit);
    for (int peer = 1; peer < size_ && s.ok(); ++peer) {
      peers_[peer].messages.clear();
      peers_[peer].outbox += Frame(kFrameMessage, "go");
    }
    if (s.ok()) s = ControlExchange({}, limit);
  }
  if (s.ok() && options_.rank != 0) peers_[0].messages.clear();
  return s;
}

void TcpController::AcceptLoop(int listener, double deadline, const std::atomic<bool>* stop,
                               std::string* last_error) {
  auto all_arrived = [&] {
    for (int peer = options_.rank + 1; peer < size_; ++peer) {
      if (!peers_[peer].data.valid()) return false;
      if (options_.rank == 0 && !peers_[peer].control.valid()) return false;
    }
    return true;
  };
  while (!all_arrived() && !*stop && Now() < deadline) {
    pollfd entry{listener, POLLIN, 0};
    const int wait_ms = static_cast<int>(std::min(200.0, (deadline - Now()) * 1000) + 1);
    if (poll(&entry, 1, wait_ms) <= 0) continue;
    Socket fd(accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd.valid()) continue;
    SetTimeouts(fd.fd(), kHandshakeSecs);
    const std::string from = PeerName(fd.fd());
    const int raw = fd.fd();
    Status s = AcceptOne(raw, from);
    if (s.ok()) {
      static_cast<void>(fd.Release());  // AcceptOne stored it with its peer
    } else {
      *last_error = "from " + from + ": " + s.message();
      Log(options_.rank, "refused a connection from " + from + ": " + s.message());
    }
  }
}

// The listening side of one connection's handshake; on success the socket belongs to its peer.
Status TcpController::AcceptOne(int fd, const std::string& from) {
  std::string nonce;
  Status s = RandomBytes(kNonceBytes, &nonce);
  if (s.ok()) s = WriteFully(fd, std::string(kMagic, sizeof(kMagic)) + U32(options_.rank) + nonce);
  std::string claim;
  if (s.ok()) s = ReadFully(fd, 12 + kNonceBytes + 32, &claim);
  if (!s.ok()) return Status::Error("handshake failed: " + s.message());
  const uint32_t peer = ReadU32(claim.data());
  const uint32_t channel = ReadU32(claim.data() + 4);
  const uint32_t claimed_size = ReadU32(claim.data() + 8);
  const std::string peer_nonce = claim.substr(12, kNonceBytes);
  Digest mac;
  std::memcpy(mac.data(), claim.data() + 12 + kNonceBytes, mac.size());
  const Digest expected = HmacSha256(options_.secret, "perseus-claim" + nonce + peer_nonce +
                                                         claim.substr(0, 12) + U32(options_.rank));
  auto refuse = [&](const std::string& why) {
    static_cast<void>(WriteFully(fd, std::string(1, '\0')));
    return Status::Error(why);
  };
  if (!DigestsEqual(mac, expected)) {
    return refuse("authentication failed: it does not know this job's secret "
                  "(PERSEUS_SECRET differs)");
  }
  if (static_cast<int>(claimed_size) != size_) {
    return refuse("it belongs to a job of " + std::to_string(claimed_size) + " ranks, this one "
                  "has " + std::to_string(size_));
  }
  const bool valid_peer = static_cast<int>(peer) > options_.rank && static_cast<int>(peer) < size_;
  const bool valid_channel =
      channel == kDataChannel || (channel == kControlChannel && options_.rank == 0);
  if (!valid_peer || !valid_channel) {
    return refuse("it claims to be rank " + std::to_string(peer) + " on channel " +
                  std::to_string(channel) + ", which does not dial rank " +
                  std::to_string(options_.rank));
  }
  Socket& slot = channel == kDataChannel ? peers_[peer].data : peers_[peer].control;
  if (slot.valid()) return refuse("rank " + std::to_string(peer) + " is already connected");
  const Digest answer = HmacSha256(options_.secret, "perseus-accept" + peer_nonce + nonce +
                                                        U32(options_.rank) + U32(peer) +
                                                        U32(channel));
  s = WriteFully(fd, std::string(1, '\1') + AsString(answer));
  if (!s.ok()) return Status::Error("handshake failed: " + s.message());
  slot = Socket(fd);
  return Status::OK();
}

// Dials `peer` until it answers or the start deadline passes; then both sides prove the secret.
Status TcpController::Dial(int peer, int channel, double deadline) {
  sockaddr_storage address{};
  socklen_t length = 0;
  Status s = Resolve(options_.addresses[peer], &address, &length);
  if (!s.ok()) return s;
  std::string last_error = "no attempt";
  double backoff = 0.05;
  while (true) {
    Socket fd(socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return Status::Error("perseus_legacy: socket(): " + Errno(errno));
    SetTimeouts(fd.fd(), kHandshakeSecs);
    if (connect(fd.fd(), reinterpret_cast<sockaddr*>(&address), length) != 0) {
      last_error = Errno(errno);
    } else {
      std::string hello;
      s = ReadFully(fd.fd(), sizeof(kMagic) + 4 + kNonceBytes, &hello);
      if (!s.ok()) {
        last_error = "handshake: " + s.message();
      } else if (hello.compare(0, sizeof(kMagic), kMagic, sizeof(kMagic)) != 0 ||
                 static_cast<int>(ReadU32(hello.data() + sizeof(kMagic))) != peer) {
        return Status::Error("perseus_legacy: rank " + std::to_string(options_.rank) +
                             ": the process at " + options_.addresses[peer] + " is not rank " +
                             std::to_string(peer) + " of this job");
      } else {
        const std::string peer_nonce = hello.substr(sizeof(kMagic) + 4);
        std::string nonce;
        s = RandomBytes(kNonceBytes, &nonce);
        if (!s.ok()) return s;
        const std::string claimed = U32(options_.rank) + U32(channel) + U32(size_);
        const Digest mac = HmacSha256(options_.secret, "perseus-claim" + peer_nonce + nonce +
                                                           claimed + U32(peer));
        s = WriteFully(fd.fd(), claimed + nonce + AsString(mac));
        std::string verdict;
        if (s.ok()) s = ReadFully(fd.fd(), 1, &verdict);
        if (s.ok() && verdict[0] != '\1') {
          return Status::Error(
              "perseus_legacy: " + Describe(peer) + " refused the connection of rank " +
              std::to_string(options_.rank) + ": authentication failed (PERSEUS_SECRET must be "
              "the same on every rank, and every rank must agree on the job's " +
              std::to_string(size_) + " addresses); the refusal is logged on rank " +
              std::to_string(peer));
        }
        std::string answer;
        if (s.ok()) s = ReadFully(fd.fd(), 32, &answer);
        if (s.ok()) {
          Digest got;
          std::memcpy(got.data(), answer.data(), got.size());
          const Digest expected = HmacSha256(options_.secret, "perseus-accept" + nonce +
                                                                  peer_nonce + U32(peer) +
                                                                  U32(options_.rank) +
                                                                  U32(channel));
          if (!DigestsEqual(got, expected)) {
            return Status::Error("perseus_legacy: the process at " + options_.addresses[peer] +
                                 " does not know this job's secret: it is not rank " +
                                 std::to_string(peer) + " of this job");
          }
          (channel == kDataChannel ? peers_[peer].data : peers_[peer].control) = std::move(fd);
          return Status::OK();
        }
        last_error = "handshake: " + s.message();
      }
    }
    if (Now() + backoff >= deadline) break;
    std::this_thread::sleep_for(std::chrono::duration<double>(backoff));
    backoff = std::min(backoff * 2, 0.5);
  }
  return Status::Error("perseus_legacy: rank " + std::to_string(peer) + " never arrived: rank " +
                       std::to_string(options_.rank) + " could not reach it at " +
                       options_.addresses[peer] + " within PERSEUS_START_TIMEOUT=" +
                       Seconds(options_.start_timeout_secs) + " s (last error: " + last_error +
                       ")");
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

// Reads what `peer`'s control socket has; parses complete frames. An abort notice or a closed
// socket ends the pumping (`text` gets the notice).
TcpController::Pumped TcpController::Pump(int peer, std::string* text) {
  Peer& p = peers_[peer];
  char buffer[64 << 10];
  bool closed = false;
  while (true) {
    const ssize_t n = recv(p.control.fd(), buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n > 0) {
      p.inbox.append(buffer, static_cast<size_t>(n));
      control_received_ += static_cast<uint64_t>(n);
      continue;
    }
    if (n < 0 && WouldBlock(errno) && errno != EINTR) break;
    if (n < 0 && errno == EINTR) continue;
    closed = true;
    *text = n == 0 ? "closed its connection (the process exited or was killed)"
                   : "connection failed: " + Errno(errno);
    break;
  }
  while (p.inbox.size() >= kFrameHeaderBytes) {
    const uint32_t kind = ReadU32(p.inbox.data());
    uint64_t length = 0;
    for (int i = 0; i < 8; ++i) {
      length |= uint64_t{static_cast<uint8_t>(p.inbox[8 + i])} << (8 * i);
    }
    if (length > kMaxFrameBytes || (kind != kFrameMessage && kind != kFrameAbort)) {
      *text = "sent a malformed control frame";
      return Pumped::kClosed;
    }
    if (p.inbox.size() < kFrameHeaderBytes + length) break;
    std::string payload = p.inbox.substr(kFrameHeaderBytes, length);
    p.inbox.erase(0, kFrameHeaderBytes + length);
    if (kind == kFrameAbort) {
      *text = std::move(payload);
      return Pumped::kAbort;
    }
    p.messages.push_back(std::move(payload));
  }
  return closed ? Pumped::kClosed : Pumped::kOk;
}

Status TcpController::PumpAll(const std::vector<int>& peers) {
  for (int peer : peers) {
    std::string text;
    switch (Pump(peer, &text)) {
      case Pumped::kOk: break;
      case Pumped::kAbort: return Fail(Status::Error(text));
      case Pumped::kClosed: return Lost(peer, text);
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
  const std::string notice = Frame(kFrameAbort, status.message());
  for (int peer : ControlPeers()) peers_[peer].outbox += notice;
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
      fds.push_back({p.control.fd(), events, 0});
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
  if (options_.rank != 0) {
    peers_[0].outbox += Frame(kFrameMessage, mine);
    return ControlExchange({}, kPeerSilenceSecs);
  }
  std::vector<int> others;
  for (int peer = 1; peer < size_; ++peer) others.push_back(peer);
  Status s = ControlExchange(others, kPeerSilenceSecs);
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
    const std::string frame = Frame(kFrameMessage, *bytes);
    for (int peer = 1; peer < size_; ++peer) peers_[peer].outbox += frame;
    return ControlExchange({}, kPeerSilenceSecs);
  }
  Status s = ControlExchange({0}, kPeerSilenceSecs);
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

// ---------------------------------------------------------------------------------------------
// Data plane

Status TcpController::Stream(int send_peer, const std::vector<Piece>& sends, int recv_peer,
                             const std::vector<Piece>& recvs, int lag,
                             const Reduction* reduction) {
  if (!failed_.ok()) return failed_;
  const size_t item = reduction ? DataTypeSize(reduction->dtype) : 1;
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
    if (now - last_progress > kPeerSilenceSecs) {
      const int silent = receiving ? recv_peer : send_peer;
      return Lost(silent, "stopped responding: no data moved for " +
                              Seconds(kPeerSilenceSecs) + " s");
    }
    std::vector<pollfd> fds;
    if (sending && sent < limit) fds.push_back({peers_[send_peer].data.fd(), POLLOUT, 0});
    if (receiving) fds.push_back({peers_[recv_peer].data.fd(), POLLIN, 0});
    for (int peer : control) fds.push_back({peers_[peer].control.fd(), POLLIN, 0});
    const int wait_ms = static_cast<int>(
        std::min(1000.0, (kPeerSilenceSecs - (now - last_progress)) * 1000) + 1);
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

Status TcpController::Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                                ReduceOp op) {
  if (!failed_.ok()) return failed_;
  const size_t item = DataTypeSize(dtype);
  char* data = static_cast<char*>(out);
  const char* source = static_cast<const char*>(in);
  const int n = size_, me = options_.rank;
  if (n == 1 || count == 0) {
    if (in != out) std::memcpy(data, in, count * item);
    return Status::OK();
  }
  // Segment s: elements [offset[s], offset[s + 1]).
  std::vector<int64_t> offset(n + 1, 0);
  for (int s = 0; s < n; ++s) offset[s + 1] = offset[s] + count / n + (s < count % n ? 1 : 0);
  auto segment = [&](int s) {
    s = ((s % n) + n) % n;
    return Piece{data + offset[s] * item, static_cast<size_t>(offset[s + 1] - offset[s]) * item};
  };
  // Reduce-scatter: step t sends segment me - t and reduces segment me - t - 1 into place;
  // afterwards this rank holds the sum of segment me + 1. Allgather: step t sends segment
  // me + 1 - t and receives segment me - t. Every send forwards the previous step's receipt,
  // except the first, which sends this rank's own input: `out` is written only by receipts
  // (each reduction combines a receipt with `in`), so the input is never copied to it first.
  std::vector<Piece> sends, recvs;
  for (int t = 0; t < n - 1; ++t) {
    Piece send = segment(me - t);
    if (t == 0) send.data = const_cast<char*>(source) + (send.data - data);
    sends.push_back(send);
    recvs.push_back(segment(me - t - 1));
  }
  for (int t = 0; t < n - 1; ++t) {
    sends.push_back(segment(me + 1 - t));
    recvs.push_back(segment(me - t));
  }
  const Reduction reduction{dtype, op, static_cast<size_t>(n - 1), source, data};
  return Stream((me + 1) % n, sends, (me + n - 1) % n, recvs, 1, &reduction);
}

Status TcpController::Allgatherv(const void* in, void* out, const std::vector<int64_t>& counts,
                                 size_t unit_bytes) {
  if (!failed_.ok()) return failed_;
  const int n = size_, me = options_.rank;
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
  return Stream((me + 1) % n, sends, (me + n - 1) % n, recvs, 1, nullptr);
}

// A chain from the root around the ring, forwarded chunk by chunk as it arrives.
Status TcpController::Broadcast(void* data, int64_t bytes, int root) {
  if (!failed_.ok()) return failed_;
  const int n = size_;
  if (n == 1 || bytes == 0) return Status::OK();
  const int position = (options_.rank - root + n) % n;
  const Piece all{static_cast<char*>(data), static_cast<size_t>(bytes)};
  const int next = (options_.rank + 1) % n, prev = (options_.rank + n - 1) % n;
  std::vector<Piece> sends, recvs;
  if (position != n - 1) sends.push_back(all);
  if (position != 0) recvs.push_back(all);
  // The root sends at once; every other rank forwards what it has received so far.
  return Stream(sends.empty() ? -1 : next, sends, recvs.empty() ? -1 : prev, recvs,
                position == 0 ? -1 : 0, nullptr);
}

Status TcpController::Alltoallv(const void* in, const std::vector<int64_t>& send_counts,
                                void* out, const std::vector<int64_t>& recv_counts,
                                size_t unit_bytes) {
  if (!failed_.ok()) return failed_;
  const int n = size_, me = options_.rank;
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
    Status s = Stream(to, sends, from, recvs, -1, nullptr);
    if (!s.ok()) return s;
  }
  return Status::OK();
}

}  // namespace perseus
