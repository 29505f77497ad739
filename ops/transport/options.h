// What a transport needs to connect this rank to the others, filled in by the framework glue
// from the launcher's environment. Shared by the runtime's Init and the transports' factories
// (registry.h), so neither includes the other for it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace perseus {

// Where the TCP controller's ranks meet (see transport/tcp_controller.h); the launcher side
// computes it.
struct TcpOptions {
  int rank = 0;
  std::vector<std::string> addresses;  // "host:port" of every rank, in rank order
  int local_rank = 0, local_size = 1, cross_rank = 0, cross_size = 1;
  std::string secret;                  // the job secret every rank must prove it knows
  double start_timeout_secs = 120.0;   // how long ranks wait for each other at start-up
  double debug_resolve_secs = 0.0;     // tests only: every name lookup answers this late
};

// Every transport's options; each factory reads its own part.
struct TransportOptions {
  // MPI: the communicator (an MPI_Comm as an integer, e.g. mpi4py's MPI._handleof(comm)) whose
  // ranks form the group; 0: MPI_COMM_WORLD.
  intptr_t mpi_comm_handle = 0;
  // MPI: how long each step of the set-up waits for the other ranks (PERSEUS_START_TIMEOUT).
  double mpi_start_timeout_secs = 120.0;
  TcpOptions tcp;
};

}  // namespace perseus
