// link_emulator: the user-space Ethernet of perseusrun's emulated hosts when their links have a
// delay, jitter or loss (perseusrun/emulate.py starts it; the kernel here has no netem).
//
// Each emulated host's eth0 is a TAP device that this process creates inside the host's network
// namespace (setns, then TUNSETIFF); the launch machine gets one more TAP here. Frames move
// between the TAPs through a learning switch. A frame leaving a host passes its link's uplink:
// dropped with probability `loss`, passed at `rate` bytes/s by a token bucket of `burst` bytes
// (tail-dropped when more than `queue` bytes wait: tc tbf's shaping), then held for `delay` +- `jitter` (never
// overtaking the frame before it). At the switch it is sent on to its destination's downlink,
// serialised at `rate` again (the switch port's queue) and written into that host's TAP. The
// delay is applied once per frame, so host to host takes one delay and a round trip two.
//
// The vnet header (IFF_VNET_HDR) with TSO offloads lets the hosts' kernels hand over 64 KB TCP
// segments instead of MTU-sized frames; the rate counts the bytes of the frames they stand for.
// With loss, offloads stay off so that every frame on the wire can be lost on its own.
//
// The process ends when its standard input reaches end of file or its parent dies (the
// launcher, even killed by SIGKILL); its TAPs go with it.
//
//   link_emulator --rate B --burst-bytes U --queue-bytes Q --delay-us D --jitter-us J
//                 --loss P --seed S --launch-tap NAME /run/netns/HOST0 /run/netns/HOST1 ...

#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

volatile sig_atomic_t report_asked = 0;
void ask_report(int) { report_asked = 1; }

// The kernel's struct virtio_net_hdr (linux/virtio_net.h does not compile as C++).
struct VnetHeader {
  uint8_t flags, gso_type;
  uint16_t hdr_len, gso_size, csum_start, csum_offset;
};
static_assert(sizeof(VnetHeader) == 10, "the vnet header is 10 bytes");
constexpr uint8_t kNeedsChecksum = 1;  // VIRTIO_NET_HDR_F_NEEDS_CSUM
constexpr uint8_t kNoSegmentation = 0;  // VIRTIO_NET_HDR_GSO_NONE
constexpr size_t kVnetHeader = sizeof(VnetHeader);
constexpr size_t kMaxFrame = 65536 + 1024;  // a 64 KB TSO segment, its headers
constexpr int kReadBurst = 64;  // frames read from one TAP before the others get their turn

using Frame = std::vector<uint8_t>;
using Mac = std::array<uint8_t, 6>;

struct Options {
  double rate = 0;  // bytes per second; 0: unlimited
  int64_t delay_ns = 0, jitter_ns = 0, queue_bytes = 0, burst_bytes = 0;
  double loss = 0;
  uint64_t seed = 1;
  std::string launch_tap;
  std::vector<std::string> namespaces;
};

class Fd {  // one owned file descriptor
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// A TAP named `name` in the current network namespace, non-blocking, with a vnet header.
Fd open_tap(const std::string& name, bool offload) {
  Fd fd(open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) fail("open /dev/net/tun");
  ifreq ifr{};
  ifr.ifr_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
  std::snprintf(ifr.ifr_name, IFNAMSIZ, "%s", name.c_str());
  if (ioctl(fd.get(), TUNSETIFF, &ifr) < 0) fail("TUNSETIFF " + name);
  unsigned offloads = offload ? TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 : 0;
  if (ioctl(fd.get(), TUNSETOFFLOAD, offloads) < 0) fail("TUNSETOFFLOAD " + name);
  return fd;
}

// The bytes on the wire of a frame (vnet header first): a TSO segment stands for several frames,
// each with the segment's headers.
int64_t wire_bytes(const Frame& frame) {
  VnetHeader header_copy;
  std::memcpy(&header_copy, frame.data(), sizeof(header_copy));
  const VnetHeader* header = &header_copy;
  int64_t bytes = int64_t(frame.size()) - int64_t(kVnetHeader);
  if (header->gso_type == kNoSegmentation || header->gso_size == 0 ||
      !(header->flags & kNeedsChecksum)) {
    return bytes;
  }
  size_t l4 = kVnetHeader + header->csum_start;
  size_t headers = header->csum_start + 20;
  if (l4 + 13 < frame.size()) headers = header->csum_start + (frame[l4 + 12] >> 4) * 4;
  int64_t payload = bytes - int64_t(headers);
  if (payload <= 0) return bytes;
  int64_t segments = (payload + header->gso_size - 1) / header->gso_size;
  return bytes + (segments - 1) * int64_t(headers);
}

// One direction of a link: a token bucket of `burst` bytes filled at `rate` (tc tbf's), behind
// a tail-drop queue of `queue` bytes.
struct Serialiser {
  int64_t free_at = 0;  // when the frames accepted so far have used the tokens up
  // When a frame of `bytes` offered at `t` has left; -1 when the queue is full (dropped).
  uint64_t dropped = 0;
  int64_t pass(int64_t t, int64_t bytes, const Options& options) {
    if (options.rate <= 0) return t;
    auto seconds = [&](double b) { return int64_t(b * 1e9 / options.rate); };
    if (free_at - t > seconds(double(options.queue_bytes))) {
      ++dropped;
      return -1;
    }
    free_at = std::max(free_at, t - seconds(double(options.burst_bytes))) +
              seconds(double(bytes));
    return std::max(free_at, t);
  }
};

struct Event {
  int64_t at;
  uint64_t order;
  bool arrived;  // true: at the switch from port `port`; false: to be written to port `port`
  size_t port;
  std::shared_ptr<Frame> frame;
  int64_t bytes;
  bool operator>(const Event& other) const {
    return at != other.at ? at > other.at : order > other.order;
  }
};

class Switch {
 public:
  Switch(Options options, std::vector<Fd> taps, std::vector<bool> shaped)
      : options_(std::move(options)), taps_(std::move(taps)), shaped_(std::move(shaped)),
        uplinks_(taps_.size()), downlinks_(taps_.size()), last_arrival_(taps_.size(), 0),
        random_(options_.seed) {}

  // Until standard input closes.
  void run() {
    std::vector<pollfd> fds(taps_.size() + 1);
    fds[0] = {STDIN_FILENO, POLLIN, 0};
    for (size_t i = 0; i < taps_.size(); ++i) fds[i + 1] = {taps_[i].get(), POLLIN, 0};
    for (;;) {
      run_due(now_ns());
      timespec wait{};
      timespec* timeout = nullptr;
      if (!events_.empty()) {
        int64_t left = std::max<int64_t>(0, events_.front().at - now_ns());
        wait = {time_t(left / 1000000000), long(left % 1000000000)};
        timeout = &wait;
      }
      if (ppoll(fds.data(), fds.size(), timeout, nullptr) < 0) {
        if (errno != EINTR) fail("ppoll");
        if (report_asked) report();
        continue;
      }
      if (fds[0].revents) {
        char byte;
        ssize_t n = read(STDIN_FILENO, &byte, 1);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
          report();
          return;
        }
      }
      for (size_t i = 0; i < taps_.size(); ++i) {
        if (fds[i + 1].revents & POLLIN) receive(i);
      }
    }
  }

 private:
  // SIGUSR1: what became of the frames so far, on standard error.
  void report() {
    report_asked = 0;
    uint64_t up = 0, down = 0;
    for (const auto& link : uplinks_) up += link.dropped;
    for (const auto& link : downlinks_) down += link.dropped;
    std::fprintf(stderr,
                 "link_emulator: %llu frames read, %llu lost at random, %llu dropped by full "
                 "uplink queues, %llu by full downlink queues, %llu refused by a TAP\n",
                 (unsigned long long)read_, (unsigned long long)lost_, (unsigned long long)up,
                 (unsigned long long)down, (unsigned long long)refused_);
  }

  void push(Event event) {
    event.order = order_++;
    events_.push_back(std::move(event));
    std::push_heap(events_.begin(), events_.end(), std::greater<>());
  }

  void run_due(int64_t now) {
    while (!events_.empty() && events_.front().at <= now) {
      std::pop_heap(events_.begin(), events_.end(), std::greater<>());
      Event event = std::move(events_.back());
      events_.pop_back();
      if (event.arrived) {
        forward(event);
      } else {
        send(event.port, *event.frame);
      }
    }
  }

  // Frames that left host `port`, through its uplink.
  void receive(size_t port) {
    for (int k = 0; k < kReadBurst; ++k) {
      ssize_t n = read(taps_[port].get(), buffer_.data(), buffer_.size());
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) return;
        fail("read from a TAP");
      }
      if (size_t(n) < kVnetHeader + 14) continue;
      ++read_;
      if (options_.loss > 0 && uniform_(random_) < options_.loss) {
        ++lost_;
        continue;
      }
      auto frame = std::make_shared<Frame>(buffer_.begin(), buffer_.begin() + n);
      int64_t now = now_ns();
      int64_t bytes = wire_bytes(*frame);
      int64_t left = shaped_[port] ? uplinks_[port].pass(now, bytes, options_) : now;
      if (left < 0) continue;
      int64_t delay = options_.delay_ns;
      if (options_.jitter_ns > 0) {
        delay += int64_t((uniform_(random_) * 2 - 1) * double(options_.jitter_ns));
      }
      int64_t at = std::max(left + std::max<int64_t>(delay, 0), last_arrival_[port]);
      last_arrival_[port] = at;
      push(Event{at, 0, true, port, std::move(frame), bytes});
    }
  }

  // A frame at the switch: learn where its source is, send it on towards its destination.
  void forward(Event& event) {
    const uint8_t* ethernet = event.frame->data() + kVnetHeader;
    Mac destination, source;
    std::copy(ethernet, ethernet + 6, destination.begin());
    std::copy(ethernet + 6, ethernet + 12, source.begin());
    if (!(source[0] & 1)) ports_[source] = event.port;
    auto known = ports_.find(destination);
    if (!(destination[0] & 1) && known != ports_.end()) {
      if (known->second != event.port) down(known->second, event.at, event.frame, event.bytes);
      return;
    }
    for (size_t port = 0; port < taps_.size(); ++port) {  // broadcast, multicast, unknown
      if (port != event.port) down(port, event.at, event.frame, event.bytes);
    }
  }

  void down(size_t port, int64_t at, const std::shared_ptr<Frame>& frame, int64_t bytes) {
    int64_t done = shaped_[port] ? downlinks_[port].pass(at, bytes, options_) : at;
    if (done < 0) return;
    if (done <= now_ns()) {
      send(port, *frame);
    } else {
      push(Event{done, 0, false, port, frame, bytes});
    }
  }

  void send(size_t port, const Frame& frame) {
    // A frame that its TAP refuses (EIO while the interface is down) is lost, as on a wire.
    if (write(taps_[port].get(), frame.data(), frame.size()) < 0) ++refused_;
  }

  Options options_;
  std::vector<Fd> taps_;
  std::vector<bool> shaped_;
  std::vector<Serialiser> uplinks_, downlinks_;
  std::vector<int64_t> last_arrival_;
  Frame buffer_ = Frame(kMaxFrame);  // what a read from a TAP lands in first
  std::vector<Event> events_;  // a min-heap on (at, order)
  uint64_t order_ = 0;
  uint64_t read_ = 0, lost_ = 0, refused_ = 0;
  std::map<Mac, size_t> ports_;
  std::mt19937_64 random_;
  std::uniform_real_distribution<double> uniform_{0.0, 1.0};
};

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--rate") {
      options.rate = std::stod(value());
    } else if (arg == "--delay-us") {
      options.delay_ns = std::stoll(value()) * 1000;
    } else if (arg == "--jitter-us") {
      options.jitter_ns = std::stoll(value()) * 1000;
    } else if (arg == "--loss") {
      options.loss = std::stod(value());
    } else if (arg == "--burst-bytes") {
      options.burst_bytes = std::stoll(value());
    } else if (arg == "--queue-bytes") {
      options.queue_bytes = std::stoll(value());
    } else if (arg == "--seed") {
      options.seed = std::stoull(value());
    } else if (arg == "--launch-tap") {
      options.launch_tap = value();
    } else if (!arg.empty() && arg[0] == '-') {
      throw std::runtime_error("unknown option " + arg);
    } else {
      options.namespaces.push_back(arg);
    }
  }
  if (options.launch_tap.empty() || options.namespaces.empty()) {
    throw std::runtime_error("usage: link_emulator [options] --launch-tap NAME NETNS...");
  }
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    pid_t parent = getppid();
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0) fail("PR_SET_PDEATHSIG");
    if (getppid() != parent) return 1;  // the launcher died before the line above
    prctl(PR_SET_TIMERSLACK, 1000UL);  // wake-ups within a microsecond of a frame's time
    // The frames' timing must not wait for the ranks' turns on the cores: the lowest real-time
    // priority, as the kernel's own forwarding of a veth runs before any process (it sleeps
    // between frames, and the kernel caps real-time tasks at 95% of a core anyway).
    sched_param priority{};
    priority.sched_priority = 1;
    sched_setscheduler(0, SCHED_FIFO, &priority);  // without the right: the default policy
    struct sigaction action {};
    action.sa_handler = ask_report;  // no SA_RESTART: ppoll returns EINTR
    sigaction(SIGUSR1, &action, nullptr);
    Options options = parse(argc, argv);
    bool offload = options.loss <= 0;
    Fd home(open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC));
    if (home.get() < 0) fail("open /proc/self/ns/net");
    std::vector<Fd> taps;
    std::vector<bool> shaped;
    for (const auto& path : options.namespaces) {
      Fd ns(open(path.c_str(), O_RDONLY | O_CLOEXEC));
      if (ns.get() < 0) fail("open " + path);
      if (setns(ns.get(), CLONE_NEWNET) < 0) fail("setns " + path);
      taps.push_back(open_tap("eth0", offload));
      shaped.push_back(true);
      if (setns(home.get(), CLONE_NEWNET) < 0) fail("setns back");
    }
    taps.push_back(open_tap(options.launch_tap, offload));  // the launch machine: no rate limit
    shaped.push_back(false);
    std::printf("ready\n");
    std::fflush(stdout);
    Switch(std::move(options), std::move(taps), std::move(shaped)).run();
    return 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "link_emulator: %s\n", error.what());
    return 1;
  }
}
