// Built in place of the MPI transport's sources (transport/mpi_*.cc) when the package is built
// with PERSEUS_WITHOUT_MPI=1: registers "mpi" as not built, so that mpi_built() is False and an
// init() over MPI fails saying why, and nothing links an MPI library.
#include <memory>

#include "transport/registry.h"

namespace perseus {
namespace {

Status NoMpi(const TransportOptions& /*options*/, std::unique_ptr<Controller>* /*out*/) {
  return Status::Error(
      "perseus_legacy: this build has no MPI (it was built with PERSEUS_WITHOUT_MPI=1); use the "
      "TCP controller (perseusrun --tcp, a TF_CONFIG launch, or PERSEUS_CONTROLLER=tcp), or "
      "rebuild without PERSEUS_WITHOUT_MPI to run over MPI");
}

const TransportRegistration kMpi({"mpi", "MPI", "init_mpi", /*built=*/false, &NoMpi});

}  // namespace
}  // namespace perseus
