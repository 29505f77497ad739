// The public face of the runtime: what framework glue (ops/tensorflow, ops/python) may call.
// Everything here is thread safe. Built into libperseus_common.so, shared by every glue module
// loaded in the process, so there is exactly one runtime state per process.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/common.h"
#include "transport/options.h"

namespace perseus {

// Starts the controller of the registered transport `transport` ("mpi", "tcp": see
// transport/registry.h) with `options`, and the background thread. Calling Init again while
// initialized is a no-op returning OK. Blocks until every rank has initialized. An error naming
// the registered transports when `transport` is none of them, and saying so when this build
// left it out. Reads the PERSEUS_* settings (docs/settings.md) on each call that initializes.
// MPI: Init after Shutdown works when MPI was initialized by someone else (e.g. mpi4py imported
// first); when Init started MPI itself, Shutdown finalized it and a second Init returns an error.
// TCP: MPI is never initialized.
Status Init(const std::string& transport, const TransportOptions& options);

// Stops the background thread; pending and later requests fail with a shutdown error on every
// rank. Safe to call more than once, and when never initialized.
void Shutdown();

// This rank's program failed with `reason` (a full text naming the rank): the same path as a
// failure of the runtime's own. Every other rank is told it at once, and this rank's pending and
// later requests fail with it. Returns once the other ranks are told (at most a few seconds). A
// no-op when not initialized, after a shutdown, and once this rank's runtime has stopped for
// any reason (a lost peer, an earlier failure: every rank knows that one already).
void Abort(const std::string& reason);

bool IsInitialized();

// Each of these returns -1 when not initialized.
int Rank();
int Size();
int LocalRank();
int LocalSize();
int CrossRank();
int CrossSize();

bool MpiThreadsSupported();
// The transport of the current (or, after Shutdown, the last) Init; "" before the first.
std::string ControllerName();

// Hands a request to the background thread; never blocks on communication. In a job of one
// rank an allreduce, or a broadcast from rank 0, of the global set completes at once instead:
// its `done` runs on the calling thread before Enqueue returns (not while a timeline runs).
// Returns an error (and does not call done) if the runtime is not initialized or has shut down,
// or if a request with the same name is already pending on this rank.
Status Enqueue(CollectiveRequest request);

// Tells the other ranks that this rank has no more data, then blocks until every rank has called
// Join. Meanwhile this rank takes part in the other ranks' collectives with a neutral
// contribution (docs/design.md, "join()"). On success every rank gets the same
// `last_joined_rank`: the rank whose Join arrived last. Fails, naming the rank, when a rank shuts
// down or the transport fails, and when a Join is already in progress on this rank.
// `interrupted` (optional) is called every 100 ms while Join waits, without any runtime lock;
// when it returns true Join returns an error at once (the join stays announced: the caller is
// expected to shut down). AddProcessSet and RemoveProcessSet take it alike.
using Interrupted = std::function<bool()>;
Status Join(int* last_joined_rank, const Interrupted& interrupted = nullptr);

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
Status AddProcessSet(const std::vector<int>& ranks, int32_t* id,
                     const Interrupted& interrupted = nullptr);
Status RemoveProcessSet(int32_t id, const Interrupted& interrupted = nullptr);
// Every registered process set (id, its ranks in order), the global set first; empty when not
// initialized.
std::vector<std::pair<int32_t, std::vector<int>>> ProcessSets();

// Enqueue for several requests with a single wake-up of the background thread (grouped ops).
// Element i is what Enqueue would have returned for requests[i].
std::vector<Status> EnqueueAll(std::vector<CollectiveRequest> requests);

}  // namespace perseus
