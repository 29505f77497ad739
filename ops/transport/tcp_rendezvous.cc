// Start-up of the TCP transport: every rank listens on its address, accepts the higher ranks and
// dials the lower ones (the data mesh) and rank 0 (the control star), each connection proving
// the job secret and the job's address list both ways (HMAC-SHA-256 challenge / response,
// tcp_auth.h) and deriving the key of its control frames, then a barrier.
//
// The handshake: the listener sends a hello (magic, its rank, the job digest, a nonce); the dialer
// checks the digest and answers with a claim (its rank, channel, the job size, its nonce, an HMAC
// over both nonces, the claim, the listener's rank and the job digest); the listener answers
// with a verdict byte and, on success, its own HMAC.
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
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "transport/tcp_auth.h"
#include "transport/registry.h"
#include "transport/tcp_controller.h"

namespace perseus {
namespace {

constexpr int kDataChannel = 0;
constexpr int kControlChannel = 1;
constexpr char kMagic[8] = {'P', 'E', 'R', 'S', 'E', 'U', 'S', '1'};
constexpr size_t kNonceBytes = 32;
constexpr size_t kDigestBytes = 32;
constexpr double kHandshakeSecs = 10.0;  // one connection's handshake, once it is accepted
// magic, rank, job digest, nonce
constexpr size_t kHelloBytes = sizeof(kMagic) + 4 + kDigestBytes + kNonceBytes;
constexpr size_t kClaimHeaderBytes = 12;                                // rank, channel, size
constexpr size_t kClaimBytes = kClaimHeaderBytes + kNonceBytes + 32;    // + nonce, HMAC
// Accepted connections whose handshake may be under way at once from one source: the host of a
// rank that dials this one gets this many beyond the connections it is expected to make, every
// other address shares this many; a newer connection drops the oldest of its own source only.
constexpr size_t kPendingPerSource = 32;
// The shortest job secret accepted (perseus_legacy/common/tf_config.py checks it first).
constexpr size_t kMinSecretBytes = 16;
// Refused connections of each kind logged one line each; the rest are only counted.
constexpr int kLoggedRefusals = 4;
constexpr char kAuthFailed[] = "authentication failed";
// How long a rank that was not joined looks up the missing ranks' names, to tell why.
constexpr double kUnresolvedCheckSecs = 1.0;
// How long the accept loop looks up the higher ranks' names (each distinct name once, all at
// once) to count their handshakes by source.
constexpr double kSourceLookupSecs = 1.0;
// A handshake accepted less than this long ago is never dropped for a newer connection: a rank
// answers the hello at once, so a burst of connections from its own address (every rank of a
// job on one host shares 127.0.0.1) cannot push its handshake out before its claim is read.
// A newer connection that finds its source's slots full of younger ones is refused instead (the
// dialer of a real rank tries again).
constexpr double kAnswerGraceSecs = 1.0;

// Why the listening side dropped a connection, as counted in the start-up summary.
enum class Refusal { kIdle, kDropped, kBusy, kGarbage, kWrongSecret, kOther, kCount };
constexpr const char* kRefusalNames[] = {"idle or closed before finishing the handshake",
                                         "dropped for newer connections from the same address",
                                         "refused while the handshakes from the same address "
                                         "were all younger than 1 s",
                                         "sent bytes that are not a handshake of this job",
                                         "did not prove the job secret",
                                         "claimed a rank that was already connected"};

// The listening rank's log of refused connections: one line each for the first
// kLoggedRefusals of each kind, then a count by kind when start-up ends.
class RefusalLog {
 public:
  explicit RefusalLog(int rank) : rank_(rank) {}
  void Add(const std::string& from, Refusal kind, const std::string& why) {
    if (counts_[static_cast<int>(kind)]++ < kLoggedRefusals) {
      Log("refused a connection from " + from + ": " + why);
    }
    ++total_;
  }
  void Summarize() const {
    if (total_ == 0) return;
    std::string kinds;
    bool cut = false;
    for (int kind = 0; kind < static_cast<int>(Refusal::kCount); ++kind) {
      if (counts_[kind] == 0) continue;
      kinds += (kinds.empty() ? "" : ", ") + std::to_string(counts_[kind]) + " " +
               kRefusalNames[kind];
      cut = cut || counts_[kind] > kLoggedRefusals;
    }
    Log("start-up refused " + std::to_string(total_) + " connection" +
        (total_ == 1 ? "" : "s") + " (" + kinds + ")" +
        (cut ? "; only the first " + std::to_string(kLoggedRefusals) +
                   " of each kind were logged one by one"
             : ""));
  }

 private:
  void Log(const std::string& text) const {
    std::fprintf(stderr, "perseus_legacy[rank %d]: %s\n", rank_, text.c_str());
    std::fflush(stderr);
  }
  int rank_;
  int total_ = 0;
  int counts_[static_cast<int>(Refusal::kCount)] = {};
};

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

// One address of a name, as getaddrinfo gives it.
struct Endpoint {
  sockaddr_storage address{};
  socklen_t length = 0;
};

// One getaddrinfo call, shared by the thread that makes it and the one that waits for it.
struct Lookup {
  std::mutex mutex;
  std::condition_variable finished;
  bool done = false;
  int rc = 0;
  std::vector<Endpoint> endpoints;
};

// For tests only: PERSEUS_DEBUG_RESOLVE_SECS=S makes every lookup answer S seconds late, as a
// slow resolver would (tests/test_tcp_rendezvous.py).
double DebugResolveDelaySecs() {
  const char* text = std::getenv("PERSEUS_DEBUG_RESOLVE_SECS");
  return text == nullptr ? 0.0 : std::max(0.0, std::atof(text));
}

// getaddrinfo(host, port) on a helper thread, which owns its result: the call cannot be
// interrupted and can block for the resolver's whole timeout (resolv.conf's attempts x
// timeout), so whoever waits for it may stop waiting (WaitLookup) and leave it running.
std::shared_ptr<Lookup> StartLookup(const std::string& host, const std::string& port) {
  auto lookup = std::make_shared<Lookup>();
  std::thread([lookup, host, port] {
    const double delay = DebugResolveDelaySecs();
    if (delay > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay));
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int code = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
    std::vector<Endpoint> endpoints;
    for (const addrinfo* a = code == 0 ? found : nullptr; a != nullptr; a = a->ai_next) {
      if (a->ai_addrlen > sizeof(sockaddr_storage)) continue;
      Endpoint endpoint;
      std::memcpy(&endpoint.address, a->ai_addr, a->ai_addrlen);
      endpoint.length = a->ai_addrlen;
      endpoints.push_back(endpoint);
    }
    if (found != nullptr) freeaddrinfo(found);
    std::lock_guard<std::mutex> lock(lookup->mutex);
    lookup->rc = code;
    lookup->endpoints = std::move(endpoints);
    lookup->done = true;
    lookup->finished.notify_all();
  }).detach();
  return lookup;
}

// Waits for `lookup` until `until`: false when it has not answered by then; else its `rc` and
// every address found.
bool WaitLookup(Lookup& lookup, double until, int* rc, std::vector<Endpoint>* out) {
  std::unique_lock<std::mutex> lock(lookup.mutex);
  const std::chrono::duration<double> wait(std::max(0.0, until - Now()));
  if (!lookup.finished.wait_for(lock, wait, [&] { return lookup.done; })) return false;
  *rc = lookup.rc;
  *out = lookup.endpoints;
  return true;
}

// The addresses of the names this process has resolved for one job (`job`: its digest), so
// that a name shared by many ranks (every slot of a host) is looked up once, not once per rank
// by the dialer and again by the accept loop. Only answers with addresses are kept: a name not
// published yet is looked up again. Another job (an elastic regroup: a new address list) looks
// its names up afresh.
class ResolvedNames {
 public:
  static ResolvedNames& Get() {
    static ResolvedNames names;
    return names;
  }
  bool Find(const std::string& job, const std::string& host, std::vector<Endpoint>* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (job != job_) return false;
    const auto found = found_.find(host);
    if (found == found_.end()) return false;
    *out = found->second;
    return true;
  }
  void Keep(const std::string& job, const std::string& host,
            const std::vector<Endpoint>& endpoints) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (job != job_) {
      job_ = job;
      found_.clear();
    }
    found_[host] = endpoints;
  }

 private:
  std::mutex mutex_;
  std::string job_;
  std::map<std::string, std::vector<Endpoint>> found_;
};

// `endpoints` with their port set to `port` (a cached name's addresses serve every rank on it).
void SetPort(std::vector<Endpoint>* endpoints, const std::string& port) {
  const auto number = htons(static_cast<uint16_t>(std::atoi(port.c_str())));
  for (Endpoint& endpoint : *endpoints) {
    if (endpoint.address.ss_family == AF_INET) {
      reinterpret_cast<sockaddr_in*>(&endpoint.address)->sin_port = number;
    } else if (endpoint.address.ss_family == AF_INET6) {
      reinterpret_cast<sockaddr_in6*>(&endpoint.address)->sin6_port = number;
    }
  }
}

// One bounded lookup: StartLookup then WaitLookup until `until`; an answer with addresses is
// kept for `job`.
bool LookupUntil(const std::string& job, const std::string& host, const std::string& port,
                 double until, int* rc, std::vector<Endpoint>* out) {
  if (ResolvedNames::Get().Find(job, host, out)) {
    SetPort(out, port);
    *rc = 0;
    return true;
  }
  const auto lookup = StartLookup(host, port);
  if (!WaitLookup(*lookup, until, rc, out)) return false;
  if (*rc == 0 && !out->empty()) ResolvedNames::Get().Keep(job, host, *out);
  return true;
}

// Answers that may change once the name is published (no such name yet, resolver busy).
bool MayResolveLater(int rc) {
  switch (rc) {
    case EAI_NONAME:
    case EAI_AGAIN:
    case EAI_FAIL:
#ifdef EAI_NODATA
    case EAI_NODATA:
#endif
#ifdef EAI_ADDRFAMILY
    case EAI_ADDRFAMILY:
#endif
      return true;
    default:
      return false;
  }
}

void LogRank(int rank, const std::string& text) {
  std::fprintf(stderr, "perseus_legacy[rank %d]: %s\n", rank, text.c_str());
  std::fflush(stderr);
}

// Every address of `address` ("host:port", rank `owner`'s), for rank `me`. A name that does not
// resolve yet is looked up again until `deadline` (Kubernetes publishes the name of a pod's
// headless service only after the pod starts), logging once that it waits; each lookup is
// bounded by the deadline as well. `limit` names the start timeout for the error.
Status Resolve(const std::string& job, const std::string& address, int me, int owner,
               double deadline, const std::string& limit, std::vector<Endpoint>* out) {
  std::string host, port;
  if (!SplitAddress(address, &host, &port)) {
    return Status::Error("perseus_legacy: \"" + address + "\" is not a host:port address");
  }
  const std::string whose = owner == me ? "its own address" : "the address of rank " +
                                                                  std::to_string(owner);
  const std::string what = "the name \"" + host + "\" (" + whose + ", " + address + ")";
  const double start = Now();
  bool waiting = false;
  double backoff = 0.1;
  std::string last;
  while (true) {
    int rc = 0;
    if (!LookupUntil(job, host, port, deadline, &rc, out)) {
      last = "the last lookup had no answer when the time was up";
    } else if (rc == 0 && !out->empty()) {
      if (waiting) LogRank(me, what + " resolved after " + Seconds(Now() - start) + " s");
      return Status::OK();
    } else if (rc != 0 && !MayResolveLater(rc)) {
      return Status::Error("perseus_legacy: rank " + std::to_string(me) + " cannot resolve " +
                           what + ": " + gai_strerror(rc));
    } else {
      last = rc == 0 ? "no address" : gai_strerror(rc);
      if (!waiting) {
        LogRank(me, "waiting for " + what + " to resolve (" + last + "); looking it up again "
                    "until " + limit);
        waiting = true;
      }
    }
    if (Now() + backoff >= deadline) break;
    std::this_thread::sleep_for(std::chrono::duration<double>(backoff));
    backoff = std::min(backoff * 2, 1.0);
  }
  return Status::Error("perseus_legacy: rank " + std::to_string(me) + ": " + what +
                       " did not resolve within " + limit + " (" + last + ")");
}

// The numeric host of `address` ("10.0.0.1", "::1"; an IPv4-mapped IPv6 address as IPv4) and
// its port.
std::string NumericHost(const sockaddr_storage& address, int* port) {
  char host[INET6_ADDRSTRLEN] = "?";
  *port = 0;
  if (address.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&address);
    inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
    *port = ntohs(v4->sin_port);
  } else if (address.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&address);
    if (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr)) {
      inet_ntop(AF_INET, &v6->sin6_addr.s6_addr[12], host, sizeof(host));
    } else {
      inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof(host));
    }
    *port = ntohs(v6->sin6_port);
  }
  return host;
}

// A numeric form of an endpoint, for errors.
std::string EndpointName(const Endpoint& endpoint) {
  int port = 0;
  return NumericHost(endpoint.address, &port);
}

// The numeric host of the other end of `fd`.
std::string PeerHost(int fd, int* port) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  *port = 0;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return "?";
  return NumericHost(address, port);
}

void SetTimeouts(int fd, double seconds) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(seconds);
  tv.tv_usec = static_cast<suseconds_t>((seconds - tv.tv_sec) * 1e6);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// Blocking I/O for the dialer's handshake, all of it done by `deadline`: each call waits at most
// what is left, so a peer that trickles bytes cannot hold the dialer past it.
Status WriteFully(int fd, const std::string& bytes, double deadline) {
  size_t done = 0;
  while (done < bytes.size()) {
    if (Now() >= deadline) return Status::Error("timed out");
    SetTimeouts(fd, deadline - Now());
    const ssize_t n = send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n < 0 && WouldBlock(errno)) continue;
    if (n <= 0) return Status::Error(n < 0 ? Errno(errno) : "connection closed");
    done += static_cast<size_t>(n);
  }
  return Status::OK();
}

Status ReadFully(int fd, size_t bytes, std::string* out, double deadline) {
  out->assign(bytes, '\0');
  size_t done = 0;
  while (done < bytes) {
    if (Now() >= deadline) return Status::Error("timed out");
    SetTimeouts(fd, deadline - Now());
    const ssize_t n = recv(fd, &(*out)[done], bytes - done, 0);
    if (n < 0 && WouldBlock(errno)) continue;
    if (n < 0) return Status::Error(Errno(errno));
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

}  // namespace

// Listens on options.tcp.addresses[options.tcp.rank] and meets every other rank within
// options.tcp.start_timeout_secs.
Status CreateTcpController(const TransportOptions& transport_options,
                           std::unique_ptr<Controller>* out) {
  const TcpOptions& options = transport_options.tcp;
  const int size = static_cast<int>(options.addresses.size());
  if (size < 1 || options.rank < 0 || options.rank >= size) {
    return Status::Error("perseus_legacy: TCP rank " + std::to_string(options.rank) +
                         " is outside a job of " + std::to_string(size) + " addresses");
  }
  if (options.secret.size() < kMinSecretBytes) {
    return Status::Error("perseus_legacy: the TCP controller needs a job secret "
                         "(PERSEUS_SECRET) of at least " + std::to_string(kMinSecretBytes) +
                         " bytes, the same on every rank; this one has " +
                         std::to_string(options.secret.size()));
  }
  auto controller = std::make_unique<TcpController>(options);
  Status s = controller->Rendezvous();
  if (s.ok()) controller->SetupHierarchy();
  if (s.ok()) *out = std::move(controller);
  return s;
}

const TransportRegistration kTcp({"tcp", "TCP", /*built=*/true, &CreateTcpController});

Status TcpController::Rendezvous() {
  const int me = options_.rank;
  const double deadline = Now() + options_.start_timeout_secs;
  const std::string limit = "PERSEUS_START_TIMEOUT=" + Seconds(options_.start_timeout_secs) +
                            " s";
  std::string job;
  for (const std::string& address : options_.addresses) job += address + "\n";
  job_digest_ = AsString(Sha256("perseus-job\n" + job));
  std::vector<Endpoint> own;
  Status s = Resolve(job_digest_, options_.addresses[me], me, me, deadline, limit, &own);
  if (!s.ok()) return s;
  Socket listener;  // on the first of the name's addresses that this machine can listen on
  std::string why;
  for (const Endpoint& endpoint : own) {
    Socket candidate(socket(endpoint.address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    const int one = 1;
    if (candidate.valid()) {
      setsockopt(candidate.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    }
    if (candidate.valid() &&
        bind(candidate.fd(), reinterpret_cast<const sockaddr*>(&endpoint.address),
             endpoint.length) == 0 &&
        listen(candidate.fd(), SOMAXCONN) == 0) {
      listener = std::move(candidate);
      own_address_ = endpoint.address;
      own_address_length_ = endpoint.length;
      break;
    }
    why += (why.empty() ? "" : "; ") + EndpointName(endpoint) + ": " + Errno(errno);
  }
  if (!listener.valid()) {
    return Status::Error("perseus_legacy: rank " + std::to_string(me) + " cannot listen on " +
                         "its address " + options_.addresses[me] + " (" + why + ")" +
                         " (each task's address must belong to the machine it runs on)");
  }

  // Higher ranks dial us while we dial the lower ones.
  std::atomic<bool> stop{false};
  std::vector<std::string> unproven(size_);  // per claimed rank: a refused proof of the secret
  std::thread acceptor(&TcpController::AcceptLoop, this, listener.fd(), deadline, &stop,
                       &unproven);
  // A rank refused for its secret still dials the other lower ranks (and fails after), so that
  // every one of them can name it when the job fails.
  bool refused = false;
  if (me != 0) s = Dial(0, kControlChannel, deadline, &refused);
  for (int peer = 0; peer < me && (s.ok() || refused); ++peer) {
    Status dialed = Dial(peer, kDataChannel, deadline, &refused);
    if (s.ok()) s = dialed;
  }
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
    // A missing rank whose name does not resolve here likely waits for it too: say so, after
    // one quick lookup of each (all of them within kUnresolvedCheckSecs).
    const double check_until = Now() + kUnresolvedCheckSecs;
    for (int peer : missing) {
      std::string host, port;
      int rc = 0;
      std::vector<Endpoint> found;
      std::string unresolved;
      if (SplitAddress(options_.addresses[peer], &host, &port) &&
          LookupUntil(job_digest_, host, port, check_until, &rc, &found) && rc != 0) {
        unresolved = " (its name \"" + host + "\" does not resolve here either: " +
                     gai_strerror(rc) + ")";
      }
      expected += "; rank " + std::to_string(peer) + " at " + options_.addresses[peer] +
                  unresolved + (unproven[peer].empty() ? "" : ": " + unproven[peer]);
    }
    return Fail(Status::Error(
        "perseus_legacy: ranks " + RankList(missing) + " never arrived at rank " +
        std::to_string(me) + " (" + options_.addresses[me] + ") within " + limit + expected));
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

// One accepted connection whose handshake is under way (AcceptLoop).
struct TcpController::Pending {
  Socket socket;
  std::string from;    // its address, for the log
  size_t source;       // whose slots it takes (AcceptLoop's `slots`)
  double accepted;     // when it was accepted
  double deadline;     // when it is dropped if it has not finished
  std::string nonce;   // our challenge
  std::string claim;   // what it has sent so far
};

// All handshakes run at once in one thread: poll() over the listener and every pending
// connection, each with its own deadline. Pending connections are counted per source address:
// each host of a rank that dials this one has slots of its own (kPendingPerSource beyond the
// connections its ranks make), all other addresses share kPendingPerSource; a new connection
// drops the oldest pending one of its own source when those are full, unless that one was
// accepted less than kAnswerGraceSecs ago: then the new connection is refused. A flood from
// elsewhere thus never touches a real rank's handshake however long its claim takes to arrive,
// a flood from a rank's own address (127.0.0.1 for every rank of a one-host job) cannot push
// out a handshake before the rank had its time to answer, and either costs at most
// kPendingPerSource descriptors.
void TcpController::AcceptLoop(int listener, double deadline, const std::atomic<bool>* stop,
                               std::vector<std::string>* unproven) {
  auto all_arrived = [&] {
    for (int peer = options_.rank + 1; peer < size_; ++peer) {
      if (!peers_[peer].data.valid()) return false;
      if (options_.rank == 0 && !peers_[peer].control.valid()) return false;
    }
    return true;
  };
  // The numeric hosts of the ranks that dial this one, and the slots of each; then the
  // strangers' slots (the last).
  std::vector<std::string> hosts;
  std::vector<size_t> slots;
  std::vector<size_t> source_of_rank(size_, SIZE_MAX);
  // Each distinct name once, all of them at once, within kSourceLookupSecs: a job of hundreds of
  // ranks on a few hosts behind a slow resolver costs one lookup's time, not one per rank. A
  // name not published yet (Dial waits for it and reports it) leaves that rank's handshakes
  // among the strangers', as before this accounting.
  std::map<std::string, std::pair<std::string, std::shared_ptr<Lookup>>> lookups;  // by name
  std::vector<Endpoint> cached;
  for (int peer = options_.rank + 1; peer < size_; ++peer) {
    std::string name, port_text;
    if (SplitAddress(options_.addresses[peer], &name, &port_text) && !lookups.count(name)) {
      lookups[name] = {port_text, ResolvedNames::Get().Find(job_digest_, name, &cached)
                                      ? nullptr
                                      : StartLookup(name, port_text)};
    }
  }
  const double lookups_until = std::min(deadline, Now() + kSourceLookupSecs);
  std::map<std::string, std::vector<Endpoint>> found_by_name;
  for (auto& [name, started] : lookups) {
    int rc = 0;
    std::vector<Endpoint> found;
    if (started.second == nullptr) {
      ResolvedNames::Get().Find(job_digest_, name, &found);
    } else if (!WaitLookup(*started.second, lookups_until, &rc, &found) || rc != 0) {
      continue;
    } else if (!found.empty()) {
      ResolvedNames::Get().Keep(job_digest_, name, found);
    }
    found_by_name[name] = std::move(found);
  }
  for (int peer = options_.rank + 1; peer < size_; ++peer) {
    std::string name, port_text;
    if (!SplitAddress(options_.addresses[peer], &name, &port_text)) continue;
    const auto found = found_by_name.find(name);
    if (found == found_by_name.end()) continue;
    for (const Endpoint& endpoint : found->second) {  // the rank dials from one of these
      int port = 0;
      const std::string host = NumericHost(endpoint.address, &port);
      const size_t index = std::find(hosts.begin(), hosts.end(), host) - hosts.begin();
      if (index == hosts.size()) {
        hosts.push_back(host);
        slots.push_back(kPendingPerSource);
      }
      slots[index] += options_.rank == 0 ? 2 : 1;  // rank 0 is dialed twice by each rank
      if (source_of_rank[peer] == SIZE_MAX) source_of_rank[peer] = index;
    }
  }
  const size_t strangers = hosts.size();
  slots.push_back(kPendingPerSource);

  RefusalLog log(options_.rank);
  std::vector<Pending> pending;  // oldest first
  std::vector<size_t> pending_of(slots.size(), 0);
  auto refuse = [&](Pending& p, Refusal kind, const std::string& why) {
    static_cast<void>(send(p.socket.fd(), "\0", 1, MSG_NOSIGNAL | MSG_DONTWAIT));
    log.Add(p.from, kind, why);
    p.socket.Close();
  };
  fcntl(listener, F_SETFL, fcntl(listener, F_GETFL) | O_NONBLOCK);
  std::vector<pollfd> fds;
  while (!all_arrived() && !*stop && Now() < deadline) {
    double wake = std::min(deadline, Now() + 0.2);  // `stop` is checked at least this often
    fds.assign(1, pollfd{listener, POLLIN, 0});
    for (const Pending& p : pending) {
      fds.push_back({p.socket.fd(), POLLIN, 0});
      wake = std::min(wake, p.deadline);
    }
    poll(fds.data(), fds.size(), static_cast<int>(std::max(0.0, wake - Now()) * 1000) + 1);
    const double now = Now();
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      if (fds[i + 1].revents != 0) {
        char buffer[kClaimBytes + 1];
        const size_t want = kClaimBytes + 1 - p.claim.size();  // one more shows excess
        const ssize_t n = recv(p.socket.fd(), buffer, want, MSG_DONTWAIT);
        if (n == 0) {
          log.Add(p.from, Refusal::kIdle, "it closed the connection before finishing the "
                                           "handshake");
          p.socket.Close();
          continue;
        }
        if (n < 0 && !WouldBlock(errno)) {
          log.Add(p.from, Refusal::kIdle, "handshake failed: " + Errno(errno));
          p.socket.Close();
          continue;
        }
        if (n > 0) p.claim.append(buffer, static_cast<size_t>(n));
      }
      std::string why;
      if (p.claim.size() > kClaimBytes) {
        refuse(p, Refusal::kGarbage, "it sent more than a handshake (" +
                                         std::to_string(kClaimBytes) + " bytes)");
      } else if (p.claim.size() >= kClaimHeaderBytes && !ClaimFits(p.claim, &why)) {
        refuse(p, Refusal::kGarbage, "it sent bytes that are not a handshake of this job (" +
                                         why + ")");
      } else if (p.claim.size() == kClaimBytes) {
        const int claimed = static_cast<int>(ReadU32(p.claim.data()));
        Status s = AcceptOne(p.socket.fd(), p.nonce, p.claim);
        if (s.ok()) {
          static_cast<void>(p.socket.Release());  // AcceptOne stored it with its peer
        } else if (s.message().rfind(kAuthFailed, 0) == 0) {
          // Only a connection from the claimed rank's own host may explain why that rank never
          // arrived; a stranger's claim is logged, never taken for the job's failure.
          if (p.source == source_of_rank[claimed]) {
            (*unproven)[claimed] = "a connection from " + p.from + " claiming to be rank " +
                                   std::to_string(claimed) + " did not prove the job secret "
                                   "(PERSEUS_SECRET differs)";
          }
          refuse(p, Refusal::kWrongSecret,
                 s.message() + " (it claims to be rank " + std::to_string(claimed) + ")");
        } else {
          refuse(p, Refusal::kOther, s.message());
        }
      } else if (now >= p.deadline) {
        log.Add(p.from, Refusal::kIdle, "it stayed idle past the handshake deadline (" +
                                            Seconds(kHandshakeSecs) + " s)");
        p.socket.Close();
      }
    }
    for (const Pending& p : pending) {
      if (!p.socket.valid()) --pending_of[p.source];
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [](const Pending& p) { return !p.socket.valid(); }),
                  pending.end());
    if (fds[0].revents == 0) continue;
    while (true) {  // everything the listener holds
      Socket fd(accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!fd.valid()) break;
      int port = 0;
      const std::string host = PeerHost(fd.fd(), &port);
      const size_t source = std::find(hosts.begin(), hosts.end(), host) - hosts.begin();
      Pending p{std::move(fd), host + ":" + std::to_string(port),
                source < strangers ? source : strangers, now, now + kHandshakeSecs, "", ""};
      if (pending_of[p.source] >= slots[p.source]) {  // the oldest is the likeliest idle one
        const auto oldest = std::find_if(pending.begin(), pending.end(),
                                         [&](const Pending& q) { return q.source == p.source; });
        if (now - oldest->accepted < kAnswerGraceSecs) {  // none has had its time to answer
          log.Add(p.from, Refusal::kBusy,
                  "refused: " + std::to_string(slots[p.source]) + " handshakes from " +
                      (p.source == strangers ? "addresses of no rank" : host) +
                      " are under way, none for " + Seconds(kAnswerGraceSecs) + " s yet");
          continue;  // closing it: a real rank dials again
        }
        log.Add(oldest->from, Refusal::kDropped,
                "dropped to make room for a newer connection from the same address (at most " +
                    std::to_string(slots[p.source]) + " handshakes wait at once from " +
                    (p.source == strangers ? "addresses of no rank" : host) + ")");
        pending.erase(oldest);
        --pending_of[p.source];
      }
      Status s = RandomBytes(kNonceBytes, &p.nonce);
      const std::string hello = std::string(kMagic, sizeof(kMagic)) + U32(options_.rank) +
                                job_digest_ + p.nonce;
      // A new connection's send buffer is empty: the hello goes out whole or not at all.
      if (s.ok() && send(p.socket.fd(), hello.data(), hello.size(), MSG_NOSIGNAL) !=
                        static_cast<ssize_t>(hello.size())) {
        s = Status::Error("handshake failed: " + Errno(errno));
      }
      if (!s.ok()) {
        log.Add(p.from, Refusal::kIdle, s.message());
        continue;
      }
      ++pending_of[p.source];
      pending.push_back(std::move(p));
    }
  }
  for (const Pending& p : pending) {
    log.Add(p.from, Refusal::kIdle, "it had not finished its handshake when start-up ended");
  }
  log.Summarize();
}

// Whether a claim's header (rank, channel, job size) is one this rank expects; `why` if not.
bool TcpController::ClaimFits(const std::string& claim, std::string* why) const {
  const uint32_t peer = ReadU32(claim.data());
  const uint32_t channel = ReadU32(claim.data() + 4);
  const uint32_t claimed_size = ReadU32(claim.data() + 8);
  if (static_cast<int>(claimed_size) != size_) {
    *why = "a job of " + std::to_string(claimed_size) + " ranks; this one has " +
           std::to_string(size_);
  } else if (static_cast<int>(peer) <= options_.rank || static_cast<int>(peer) >= size_ ||
             !(channel == kDataChannel || (channel == kControlChannel && options_.rank == 0))) {
    *why = "rank " + std::to_string(peer) + " on channel " + std::to_string(channel) +
           ", which does not dial rank " + std::to_string(options_.rank);
  } else {
    return true;
  }
  return false;
}

// The listening side's verdict on a whole claim (its header fits, ClaimFits); on success the
// answer is sent and the socket belongs to its peer. Refusals are sent by the caller.
Status TcpController::AcceptOne(int fd, const std::string& nonce, const std::string& claim) {
  const uint32_t peer = ReadU32(claim.data());
  const uint32_t channel = ReadU32(claim.data() + 4);
  const std::string peer_nonce = claim.substr(kClaimHeaderBytes, kNonceBytes);
  Digest mac;
  std::memcpy(mac.data(), claim.data() + kClaimHeaderBytes + kNonceBytes, mac.size());
  const Digest expected = HmacSha256(options_.secret, "perseus-claim" + nonce + peer_nonce +
                                                         claim.substr(0, kClaimHeaderBytes) +
                                                         U32(options_.rank) + job_digest_);
  if (!DigestsEqual(mac, expected)) {
    return Status::Error(std::string(kAuthFailed) + ": it does not know this job's secret "
                         "(PERSEUS_SECRET differs)");
  }
  Socket& slot = channel == kDataChannel ? peers_[peer].data : peers_[peer].control;
  if (slot.valid()) return Status::Error("rank " + std::to_string(peer) + " is already connected");
  const Digest answer = HmacSha256(options_.secret, "perseus-accept" + peer_nonce + nonce +
                                                        U32(options_.rank) + U32(peer) +
                                                        U32(channel) + job_digest_);
  const std::string verdict = std::string(1, '\1') + AsString(answer);
  if (send(fd, verdict.data(), verdict.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(verdict.size())) {
    return Status::Error("handshake failed: " + Errno(errno));
  }
  slot = Socket(fd);
  if (channel == kControlChannel) {
    peers_[peer].control_key = ControlKey(nonce, peer_nonce, options_.rank,
                                          static_cast<int>(peer));
  }
  return Status::OK();
}

HmacKey TcpController::ControlKey(const std::string& listener_nonce,
                                  const std::string& dialer_nonce, int listener,
                                  int dialer) const {
  return HmacKey(AsString(HmacSha256(options_.secret, "perseus-frames" + listener_nonce +
                                                          dialer_nonce + U32(listener) +
                                                          U32(dialer) + job_digest_)));
}

// Dials `peer` from this rank's own address until it answers or the start deadline passes; then
// both sides prove the secret. Every step is bounded by the start deadline.
Status TcpController::Dial(int peer, int channel, double deadline, bool* refused) {
  std::vector<Endpoint> endpoints;
  Status s = Resolve(job_digest_, options_.addresses[peer], options_.rank, peer, deadline,
                     "PERSEUS_START_TIMEOUT=" + Seconds(options_.start_timeout_secs) + " s",
                     &endpoints);
  if (!s.ok()) return s;
  std::string last_error = "no attempt";
  double backoff = 0.05;
  while (true) {
    Socket fd;  // connected to the first of the name's addresses that answers
    const double until = std::min(deadline, Now() + kHandshakeSecs);
    for (const Endpoint& endpoint : endpoints) {
      Socket candidate(socket(endpoint.address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
      if (!candidate.valid()) return Status::Error("perseus_legacy: socket(): " + Errno(errno));
      // From this rank's address, so that the peer counts its handshake among this host's
      // (AcceptLoop); on failure the kernel picks the source.
      if (own_address_.ss_family == endpoint.address.ss_family) {
        const int one = 1;
        setsockopt(candidate.fd(), IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
        sockaddr_storage source = own_address_;
        if (source.ss_family == AF_INET) {
          reinterpret_cast<sockaddr_in*>(&source)->sin_port = 0;
        } else {
          reinterpret_cast<sockaddr_in6*>(&source)->sin6_port = 0;
        }
        static_cast<void>(
            bind(candidate.fd(), reinterpret_cast<sockaddr*>(&source), own_address_length_));
      }
      SetTimeouts(candidate.fd(), std::max(0.001, until - Now()));
      if (connect(candidate.fd(), reinterpret_cast<const sockaddr*>(&endpoint.address),
                  endpoint.length) == 0) {
        fd = std::move(candidate);
        break;
      }
      last_error = (endpoints.size() > 1 ? EndpointName(endpoint) + ": " : "") + Errno(errno);
    }
    if (fd.valid()) {
      std::string hello;
      s = ReadFully(fd.fd(), kHelloBytes, &hello, until);
      if (!s.ok()) {
        last_error = "handshake: " + s.message();
      } else if (hello.compare(0, sizeof(kMagic), kMagic, sizeof(kMagic)) != 0 ||
                 static_cast<int>(ReadU32(hello.data() + sizeof(kMagic))) != peer) {
        return Status::Error("perseus_legacy: rank " + std::to_string(options_.rank) +
                             ": the process at " + options_.addresses[peer] + " is not rank " +
                             std::to_string(peer) + " of this job");
      } else if (hello.compare(sizeof(kMagic) + 4, kDigestBytes, job_digest_) != 0) {
        return Status::Error(
            "perseus_legacy: rank " + std::to_string(options_.rank) + ": the process at " +
            options_.addresses[peer] + " is rank " + std::to_string(peer) + " of another job: "
            "its list of the ranks' addresses differs from this rank's (every rank of a job must "
            "be given the same TF_CONFIG cluster or PERSEUS_TCP_ADDRESSES; two jobs never share "
            "an address)");
      } else {
        const std::string peer_nonce = hello.substr(sizeof(kMagic) + 4 + kDigestBytes);
        std::string nonce;
        s = RandomBytes(kNonceBytes, &nonce);
        if (!s.ok()) return s;
        const std::string claimed = U32(options_.rank) + U32(channel) + U32(size_);
        const Digest mac = HmacSha256(options_.secret, "perseus-claim" + peer_nonce + nonce +
                                                           claimed + U32(peer) + job_digest_);
        s = WriteFully(fd.fd(), claimed + nonce + AsString(mac), until);
        std::string verdict;
        if (s.ok()) s = ReadFully(fd.fd(), 1, &verdict, until);
        if (s.ok() && verdict[0] != '\1') {
          *refused = true;
          return Status::Error(
              "perseus_legacy: " + Describe(peer) + " refused the connection of rank " +
              std::to_string(options_.rank) + ": authentication failed (PERSEUS_SECRET must be "
              "the same on every rank, and every rank must agree on the job's " +
              std::to_string(size_) + " addresses); the refusal is logged on rank " +
              std::to_string(peer));
        }
        std::string answer;
        if (s.ok()) s = ReadFully(fd.fd(), 32, &answer, until);
        if (s.ok()) {
          Digest got;
          std::memcpy(got.data(), answer.data(), got.size());
          const Digest expected = HmacSha256(options_.secret, "perseus-accept" + nonce +
                                                                  peer_nonce + U32(peer) +
                                                                  U32(options_.rank) +
                                                                  U32(channel) + job_digest_);
          if (!DigestsEqual(got, expected)) {
            return Status::Error("perseus_legacy: the process at " + options_.addresses[peer] +
                                 " does not know this job's secret: it is not rank " +
                                 std::to_string(peer) + " of this job");
          }
          if (channel == kControlChannel) {
            peers_[peer].control_key = ControlKey(peer_nonce, nonce, peer, options_.rank);
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
