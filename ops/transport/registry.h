// The transports of this build, each registered once by its own source file: its name, whether
// this build has it, the factory that connects a rank, the words for the group it forms and the
// pybind11 core's function that joins over it. The runtime's Init, the pybind11 core's listing
// (`_core.transports()`, `build_info()`) and the timeline ask here; nothing else names a
// transport. Adding one: a Controller subclass and one TransportRegistration next to its
// factory (docs/design.md, "Adding a transport").
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/common.h"
#include "transport/controller.h"
#include "transport/options.h"

namespace perseus {

// Connects this rank to every other one and waits for all of them (collective), then hands
// over the ready controller; an error naming what failed otherwise.
using TransportFactory = Status (*)(const TransportOptions& options,
                                    std::unique_ptr<Controller>* out);

// The group that connecting with `options` forms, in words for init()'s errors:
// "MPI_COMM_WORLD", "tcp rank 0 of host-a:1234,host-b:1234".
using GroupNamer = std::string (*)(const TransportOptions& options);

struct Transport {
  std::string name;   // lower case, as init() and PERSEUS_CONTROLLER name it: "mpi", "tcp"
  std::string label;  // how the timeline prefixes its events: "MPI", "TCP"
  // The pybind11 core's function that fills TransportOptions and joins: "init_mpi", "init_tcp"
  // (perseus_legacy.common.basics calls it; a test checks that every one exists).
  std::string binding;
  bool built = false;  // false: this build left it out, and `create` says so
  TransportFactory create = nullptr;
  GroupNamer group = nullptr;  // null: the group is named by the transport's name
};

// A file-scope constant of this type registers a transport when the runtime library loads:
//   const TransportRegistration kTcp(
//       {"tcp", "TCP", "init_tcp", true, &CreateTcpController, &TcpGroupName});
// A name registered twice keeps the registration that is built (the first if both are).
class TransportRegistration {
 public:
  explicit TransportRegistration(Transport transport);
};

// Every registered transport, in name order. Registration ends before main() (and before the
// runtime library's dlopen returns), so after that the list never changes.
std::vector<Transport> RegisteredTransports();

// The registered transport `name`, or null.
const Transport* FindTransport(const std::string& name);

}  // namespace perseus
