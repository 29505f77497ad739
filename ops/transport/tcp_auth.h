// Job-secret authentication for the TCP controller's rendezvous and control frames: SHA-256 and
// HMAC-SHA-256 (FIPS 180-4, RFC 2104), written here so the runtime needs no crypto library, plus
// nonces.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "common/common.h"

namespace perseus {

using Digest = std::array<uint8_t, 32>;

Digest Sha256(const std::string& message);
Digest HmacSha256(const std::string& key, const std::string& message);

// An HMAC-SHA-256 key whose two padded blocks are hashed once, so that each MAC costs only the
// message's blocks and two more (the control frames' MACs, one key per connection).
class HmacKey {
 public:
  HmacKey() = default;
  explicit HmacKey(const std::string& key);
  Digest Mac(const std::string& message) const;

 private:
  uint32_t inner_[8] = {}, outer_[8] = {};  // SHA-256 states after the padded key blocks
};

// Whether two digests are equal, in time that does not depend on where they differ.
bool DigestsEqual(const Digest& a, const Digest& b);

// `bytes` unpredictable bytes from the operating system (getrandom / /dev/urandom).
Status RandomBytes(size_t bytes, std::string* out);

}  // namespace perseus
