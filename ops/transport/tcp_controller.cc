// The TCP transport's lifetime: construction, and the graceful close of every connection.
// Start-up is in tcp_rendezvous.cc, the control plane in tcp_control.cc, the data plane in
// tcp_ring.cc.
#include "transport/tcp_controller.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>

namespace perseus {

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

void TcpController::SetWaitLimits(double /*warning_secs*/, double shutdown_secs) {
  // Never below kMinSilenceSecs: idle ranks speak once a second (the runtime's heartbeat).
  silence_secs_ = shutdown_secs > 0
                      ? std::clamp(shutdown_secs, kMinSilenceSecs, kPeerSilenceSecs)
                      : kPeerSilenceSecs;
}

std::string TcpController::Describe(int peer) const {
  return "rank " + std::to_string(peer) + " (" + options_.addresses[peer] + ")";
}

}  // namespace perseus
