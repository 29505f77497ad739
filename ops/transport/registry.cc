// The table behind registry.h: filled by the transports' registrations while the runtime
// library loads, read-only afterwards.
#include "transport/registry.h"

#include <map>
#include <utility>

namespace perseus {
namespace {

// A function-local static: registrations in other files may run before this file's statics.
std::map<std::string, Transport>& Table() {
  static std::map<std::string, Transport> table;
  return table;
}

}  // namespace

TransportRegistration::TransportRegistration(Transport transport) {
  auto [it, inserted] = Table().emplace(transport.name, transport);
  if (!inserted && transport.built && !it->second.built) it->second = std::move(transport);
}

std::vector<Transport> RegisteredTransports() {
  std::vector<Transport> all;
  for (const auto& [name, transport] : Table()) all.push_back(transport);
  return all;
}

const Transport* FindTransport(const std::string& name) {
  auto it = Table().find(name);
  return it == Table().end() ? nullptr : &it->second;
}

}  // namespace perseus
