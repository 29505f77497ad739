// The small pieces every file of the TCP transport shares: Socket (an owned file descriptor),
// the clock its deadlines use, errno text, little-endian u32 fields, and the limits on waiting
// for a peer.
#pragma once

#include <cstdint>
#include <string>

namespace perseus {

// A peer that moves no byte for this long while we wait on it is taken for dead (a frozen
// process or a vanished host; a closed socket is noticed at once).
constexpr double kPeerSilenceSecs = 30.0;
// The shortest silence bound PERSEUS_STALL_SHUTDOWN_SECS can set (TcpController::SetWaitLimits).
constexpr double kMinSilenceSecs = 3.0;
// How long a rank that lost a peer waits for an abort notice naming the original failure.
constexpr double kNoticeWaitSecs = 2.0;

// Owns one file descriptor; closes it on destruction.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { Close(); }
  Socket(Socket&& other) noexcept : fd_(other.Release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release();
  void Close();

 private:
  int fd_ = -1;
};

double Now();  // seconds on the steady clock
std::string Errno(int error);
bool WouldBlock(int error);  // EAGAIN, EWOULDBLOCK or EINTR: try again
std::string U32(uint32_t value);
uint32_t ReadU32(const char* p);
std::string Seconds(double value);  // "%g"

}  // namespace perseus
