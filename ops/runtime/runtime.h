// The public face of the runtime: what framework glue (ops/tensorflow, ops/python) may call.
// Everything here is thread safe. Built into libperseus_common.so, shared by every glue module
// loaded in the process, so there is exactly one runtime state per process.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/common.h"
#include "transport/options.h"

namespace perseus {

// Starts the background thread and the controller. `mpi_comm_handle` is an MPI_Comm (as an
// integer, e.g. from mpi4py's MPI._handleof(comm)) or 0 for MPI_COMM_WORLD. Calling Init again
// while initialized is a no-op returning OK. Blocks until every rank has initialized.
// Reads the PERSEUS_* settings (FUSION_THRESHOLD bytes, default 64 MiB; CYCLE_TIME ms, 1.0;
// STALL_WARNING_SECS, 60; STALL_SHUTDOWN_SECS, 0 = never; CACHE_CAPACITY, 1024, 0 = no response
// cache; TIMELINE, a path, unset = no timeline) on each call that initializes.
// Init after Shutdown works when MPI was initialized by someone else (e.g. mpi4py imported
// first); when Init started MPI itself, Shutdown finalized it and a second Init returns an error.
Status Init(intptr_t mpi_comm_handle);

// Init over TCP instead of MPI: MPI is never initialized. Same rules as Init otherwise.
Status InitTcp(const TcpOptions& options);

// Stops the background thread; pending and later requests fail with a shutdown error on every
// rank. Safe to call more than once, and when never initialized.
void Shutdown();

bool IsInitialized();

// Each of these returns -1 when not initialized.
int Rank();
int Size();
int LocalRank();
int LocalSize();
int CrossRank();
int CrossSize();

bool MpiThreadsSupported();
bool MpiBuilt();  // always true today
bool TcpBuilt();  // always true today
std::string ControllerName();  // "mpi" or "tcp" while initialized

// Hands a request to the background thread; never blocks on communication.
// Returns an error (and does not call done) if the runtime is not initialized or has shut down,
// or if a request with the same name is already pending on this rank.
Status Enqueue(CollectiveRequest request);

// Tells the other ranks that this rank has no more data, then blocks until every rank has called
// Join. Meanwhile this rank takes part in the other ranks' collectives with a neutral
// contribution (see the README). On success every rank gets the same `last_joined_rank`: the
// rank whose Join arrived last. Fails, naming the rank, when a rank shuts down or the
// transport fails, and when a Join is already in progress on this rank.
Status Join(int* last_joined_rank);

// This process's counters since it started (see stats.h), by name: "tensors_submitted.allreduce",
// "collectives_executed.allreduce", "fused_groups", "cache_hits", "coordinator_rounds", ...
std::vector<std::pair<std::string, int64_t>> RuntimeStatsSnapshot();

// Starts writing this rank's timeline (timeline.h) to `path` with ".rank<r>" inserted before the
// extension. An error when not initialized, when a timeline runs, or when the file cannot be
// opened. PERSEUS_TIMELINE=path at Init does the same.
Status StartTimeline(const std::string& path);
// Writes out what is queued and closes the file; a no-op when no timeline runs. Shutdown stops
// the timeline too.
void StopTimeline();

// Whether a collective of this rank ran while another rank had joined (its data was missing),
// since the previous call; the call resets it. A rank learns this way, without a collective of
// its own, that another rank has stopped.
bool TakePeerJoined();

// Process sets (request.process_set_id): subsets of the ranks that run collectives among
// themselves, negotiated through the same coordinator as every other collective. The global set,
// id 0, holds every rank. AddProcessSet and RemoveProcessSet are collective over every rank, in
// the same order everywhere, and block until every rank has called them; they fail on every rank,
// naming the ranks, when the ranks' calls disagree or a rank has joined. Ids are never reused.
Status AddProcessSet(const std::vector<int>& ranks, int32_t* id);
Status RemoveProcessSet(int32_t id);
// Every registered process set (id, its ranks in order), the global set first; empty when not
// initialized.
std::vector<std::pair<int32_t, std::vector<int>>> ProcessSets();

// Enqueue for several requests with a single wake-up of the background thread (grouped ops).
// Element i is what Enqueue would have returned for requests[i].
std::vector<Status> EnqueueAll(std::vector<CollectiveRequest> requests);

}  // namespace perseus
