// Start-up of the TCP transport: every rank listens on its address, accepts the higher ranks and
// dials the lower ones (the data mesh) and rank 0 (the control star), each connection proving
// the job secret both ways (HMAC-SHA-256 challenge / response, tcp_auth.h), then a barrier.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "transport/tcp_auth.h"
#include "transport/tcp_controller.h"

namespace perseus {
namespace {

constexpr int kDataChannel = 0;
constexpr int kControlChannel = 1;
constexpr char kMagic[8] = {'P', 'E', 'R', 'S', 'E', 'U', 'S', '1'};
constexpr size_t kNonceBytes = 32;
constexpr double kHandshakeSecs = 10.0;  // one connection's handshake, once it is accepted

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

void Log(int rank, const std::string& text) {
  std::fprintf(stderr, "perseus_legacy[rank %d]: %s\n", rank, text.c_str());
  std::fflush(stderr);
}

}  // namespace

Status CreateTcpController(const TcpOptions& options, std::unique_ptr<Controller>* out) {
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
    QueueMessage(0, "ready");
    s = ControlExchange({0}, limit);
  } else {
    std::vector<int> everyone;
    for (int peer = 1; peer < size_; ++peer) everyone.push_back(peer);
    s = ControlExchange(everyone, limit);
    for (int peer = 1; peer < size_ && s.ok(); ++peer) {
      peers_[peer].messages.clear();
      QueueMessage(peer, "go");
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

}  // namespace perseus
