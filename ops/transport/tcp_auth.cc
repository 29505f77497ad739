// SHA-256, HMAC-SHA-256 and nonces for the TCP handshake (tcp_rendezvous.cc) and control frames
// (tcp_control.cc).
#include "transport/tcp_auth.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

namespace perseus {
namespace {

constexpr uint32_t kRoundConstants[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

uint32_t RotateRight(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void CompressBlock(const uint8_t* block, uint32_t state[8]) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = (uint32_t{block[4 * i]} << 24) | (uint32_t{block[4 * i + 1]} << 16) |
           (uint32_t{block[4 * i + 2]} << 8) | uint32_t{block[4 * i + 3]};
  }
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = RotateRight(w[i - 15], 7) ^ RotateRight(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = RotateRight(w[i - 2], 17) ^ RotateRight(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
  uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
  for (int i = 0; i < 64; ++i) {
    const uint32_t s1 = RotateRight(e, 6) ^ RotateRight(e, 11) ^ RotateRight(e, 25);
    const uint32_t choose = (e & f) ^ (~e & g);
    const uint32_t t1 = h + s1 + choose + kRoundConstants[i] + w[i];
    const uint32_t s0 = RotateRight(a, 2) ^ RotateRight(a, 13) ^ RotateRight(a, 22);
    const uint32_t majority = (a & b) ^ (a & c) ^ (b & c);
    const uint32_t t2 = s0 + majority;
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  state[0] += a;
  state[1] += b;
  state[2] += c;
  state[3] += d;
  state[4] += e;
  state[5] += f;
  state[6] += g;
  state[7] += h;
}

constexpr size_t kBlockBytes = 64;

constexpr uint32_t kInitialState[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                       0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

// The digest of `prefix_bytes` already compressed into `state` followed by `data`: its whole
// blocks, then the tail with a 1 bit, zeros and the total bit length (big-endian 64-bit).
Digest Finish(uint32_t state[8], uint64_t prefix_bytes, const char* data, size_t size) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(data);
  size_t offset = 0;
  for (; offset + kBlockBytes <= size; offset += kBlockBytes) CompressBlock(bytes + offset, state);
  uint8_t tail[2 * kBlockBytes] = {};
  const size_t rest = size - offset;
  std::memcpy(tail, bytes + offset, rest);
  tail[rest] = 0x80;
  const size_t tail_bytes = rest + 1 + 8 <= kBlockBytes ? kBlockBytes : 2 * kBlockBytes;
  const uint64_t bits = (prefix_bytes + size) * 8;
  for (int i = 0; i < 8; ++i) tail[tail_bytes - 1 - i] = static_cast<uint8_t>(bits >> (8 * i));
  for (size_t block = 0; block < tail_bytes; block += kBlockBytes) {
    CompressBlock(tail + block, state);
  }
  Digest digest;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j) digest[4 * i + j] = (state[i] >> (24 - 8 * j)) & 0xff;
  }
  return digest;
}

}  // namespace

Digest Sha256(const std::string& message) {
  uint32_t state[8];
  std::memcpy(state, kInitialState, sizeof(state));
  return Finish(state, 0, message.data(), message.size());
}

HmacKey::HmacKey(const std::string& key) {
  std::string block_key = key;
  if (block_key.size() > kBlockBytes) {
    const Digest hashed = Sha256(block_key);
    block_key.assign(hashed.begin(), hashed.end());
  }
  block_key.resize(kBlockBytes, '\0');
  uint8_t inner[kBlockBytes], outer[kBlockBytes];
  for (size_t i = 0; i < kBlockBytes; ++i) {
    inner[i] = static_cast<uint8_t>(block_key[i] ^ 0x36);
    outer[i] = static_cast<uint8_t>(block_key[i] ^ 0x5c);
  }
  std::memcpy(inner_, kInitialState, sizeof(inner_));
  std::memcpy(outer_, kInitialState, sizeof(outer_));
  CompressBlock(inner, inner_);
  CompressBlock(outer, outer_);
}

Digest HmacKey::Mac(const std::string& message) const {
  uint32_t state[8];
  std::memcpy(state, inner_, sizeof(state));
  const Digest inner = Finish(state, kBlockBytes, message.data(), message.size());
  std::memcpy(state, outer_, sizeof(state));
  return Finish(state, kBlockBytes, reinterpret_cast<const char*>(inner.data()), inner.size());
}

Digest HmacSha256(const std::string& key, const std::string& message) {
  return HmacKey(key).Mac(message);
}

bool DigestsEqual(const Digest& a, const Digest& b) {
  uint8_t difference = 0;
  for (size_t i = 0; i < a.size(); ++i) difference |= a[i] ^ b[i];
  return difference == 0;
}

Status RandomBytes(size_t bytes, std::string* out) {
  out->assign(bytes, '\0');
  size_t filled = 0;
  while (filled < bytes) {
    const ssize_t n = getrandom(&(*out)[filled], bytes - filled, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::Error(std::string("perseus_legacy: getrandom failed: ") +
                           std::strerror(errno));
    }
    filled += static_cast<size_t>(n);
  }
  return Status::OK();
}

}  // namespace perseus
