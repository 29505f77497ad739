// pybind11 module perseus_legacy._core: the runtime's process-group calls and numpy collectives.
// Collectives release the GIL while they wait, so other Python threads (and other ranks'
// submission orders) are never blocked by one waiting call; Ctrl-C interrupts the wait.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/common.h"
#include "runtime/message.h"
#include "runtime/runtime.h"
#include "transport/allreduce_algorithms.h"
#include "transport/registry.h"

namespace py = pybind11;

namespace perseus {
namespace {

// Completed by the runtime's thread, request by request; waited on by the calling thread, which
// wakes once, when all are done.
class Completion {
 public:
  explicit Completion(size_t count) : remaining_(count), statuses_(count) {}
  void Set(size_t index, const Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    statuses_[index] = status;
    if (--remaining_ == 0) cv_.notify_all();
  }
  // The first error in request order, or OK. Called without the GIL. Every kSignalCheck it
  // takes the GIL to run Python's signal handlers: when one raises (Ctrl-C: KeyboardInterrupt),
  // this rank shuts its runtime down, so that nothing writes into the buffers any more (the
  // other ranks fail naming it), and `*interrupted` is set with the exception pending.
  Status Wait(bool* interrupted) {
    // No spinning here: with ranks sharing cores, a polling waiter measurably slowed 1 MiB
    // allreduces (it competes with the MPI progress of its own and the other ranks).
    constexpr auto kSignalCheck = std::chrono::milliseconds(100);
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, kSignalCheck, [this] { return remaining_ == 0; })) {
      lock.unlock();
      bool raised;
      {
        py::gil_scoped_acquire acquire;
        raised = PyErr_CheckSignals() != 0;
      }
      if (raised) {
        *interrupted = true;
        Shutdown();  // fails what is pending: the wait below ends at once
      }
      lock.lock();
      if (raised) cv_.wait(lock, [this] { return remaining_ == 0; });
    }
    for (const Status& s : statuses_) {
      if (!s.ok()) return s;
    }
    return Status::OK();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t remaining_;  // guarded by mu_
  std::vector<Status> statuses_;
};

// Output of an allgather/alltoall, sized by the runtime's thread, which must not touch Python.
struct GrownOutput {
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

const std::pair<const char*, DataType> kDtypes[] = {
    {"float16", DataType::kFloat16}, {"bfloat16", DataType::kBFloat16},
    {"float32", DataType::kFloat32}, {"float64", DataType::kFloat64},
    {"int32", DataType::kInt32},     {"int64", DataType::kInt64},
    {"uint8", DataType::kUInt8},     {"int8", DataType::kInt8},
    {"int16", DataType::kInt16},     {"uint16", DataType::kUInt16},
    {"bool", DataType::kBool},
};

void RequireInitialized(const char* what) {
  if (!IsInitialized()) {
    throw py::value_error(std::string("perseus_legacy has not been initialized: call "
                                      "perseus_legacy.init() before ") + what + "().");
  }
}

py::array Contiguous(const py::object& value) {
  auto array = py::array::ensure(value, py::array::c_style);
  if (!array) throw py::error_already_set();
  return array;
}

DataType DtypeOf(const py::array& array, const char* what) {
  const std::string name = py::str(array.dtype().attr("name"));
  for (const auto& [known, dtype] : kDtypes) {
    if (name == known) return dtype;
  }
  throw py::type_error(std::string("perseus_legacy.") + what + ": unsupported dtype " + name +
                       "; supported: float16, bfloat16, float32, float64, int32, int64, uint8, "
                       "int8, int16, uint16, bool");
}

std::vector<int64_t> ShapeOf(const py::array& array) {
  return std::vector<int64_t>(array.shape(), array.shape() + array.ndim());
}

CollectiveRequest MakeRequest(const py::array& input, const std::string& name,
                              CollectiveType type, const char* what) {
  CollectiveRequest request;
  request.name = name;
  request.type = type;
  request.dtype = DtypeOf(input, what);
  request.shape = ShapeOf(input);
  request.input = input.data();
  return request;
}

void ExpectOutput(CollectiveRequest* request, const std::shared_ptr<GrownOutput>& out) {
  const size_t item = DataTypeSize(request->dtype);
  request->allocate_output = [out, item](const std::vector<int64_t>& shape, void** data) {
    const size_t bytes = static_cast<size_t>(NumElements(shape)) * item;
    try {
      out->bytes.resize(bytes);
    } catch (const std::bad_alloc&) {  // runs on the runtime's thread: report, do not throw
      return Status::Error("perseus_legacy: cannot allocate " + std::to_string(bytes) +
                           " bytes for the output");
    }
    out->shape = shape;
    *data = out->bytes.data();
    return Status::OK();
  };
}

// Hands the bytes to numpy without a copy: the array's base owns them.
py::array ToArray(const py::dtype& dtype, GrownOutput& out) {
  auto owner = std::make_unique<std::vector<uint8_t>>(std::move(out.bytes));
  void* data = owner->data();
  py::capsule base(owner.get(), [](void* p) { delete static_cast<std::vector<uint8_t>*>(p); });
  owner.release();
  return py::array(dtype, out.shape, data, base);
}

// Submits every request at once, then waits for all that were accepted (their buffers must
// outlive them); raises the first error in request order.
void SubmitAndWait(std::vector<CollectiveRequest> requests) {
  Status status;
  bool interrupted = false;
  {
    py::gil_scoped_release release;
    auto completion = std::make_shared<Completion>(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      requests[i].done = [completion, i](const Status& s) { completion->Set(i, s); };
    }
    std::vector<Status> admitted = EnqueueAll(std::move(requests));
    for (size_t i = 0; i < admitted.size(); ++i) {
      if (!admitted[i].ok()) completion->Set(i, admitted[i]);  // refused: done never runs
    }
    status = completion->Wait(&interrupted);
  }
  if (interrupted) throw py::error_already_set();
  if (!status.ok()) throw std::runtime_error(status.message());
}

ReduceOp CheckedOp(int op) {
  if (op < 0 || op > static_cast<int>(kLastReduceOp)) {
    throw py::value_error("perseus_legacy: op must be Average(0), Sum(1), Min(2), Max(3) or "
                          "Product(4), got " + std::to_string(op));
  }
  return static_cast<ReduceOp>(op);
}

CollectiveRequest AllreduceRequest(const py::array& input, py::array& output,
                                   const std::string& name, ReduceOp op, double prescale,
                                   double postscale) {
  CollectiveRequest request = MakeRequest(input, name, CollectiveType::kAllreduce, "allreduce");
  if (request.dtype == DataType::kBool) {
    throw py::value_error("perseus_legacy.allreduce: bool arrays cannot be reduced (\"" + name +
                          "\"); cast to an integer dtype first");
  }
  request.reduce_op = op;
  request.prescale_factor = prescale;
  request.postscale_factor = postscale;
  request.output = output.mutable_data();
  return request;
}

// `out`: None, or a C-contiguous writable array of the input's dtype and shape (it may be the
// input itself) that receives the result.
py::array OutputFor(const py::array& input, const py::object& out, const std::string& name) {
  if (out.is_none()) return py::array(input.dtype(), ShapeOf(input));
  const std::string where = "perseus_legacy.allreduce(\"" + name + "\"): out ";
  if (!py::isinstance<py::array>(out)) throw py::type_error(where + "must be a numpy array");
  py::array output = py::reinterpret_borrow<py::array>(out);
  if (!(output.flags() & py::array::c_style) || !output.writeable()) {
    throw py::value_error(where + "must be C-contiguous and writable");
  }
  if (!output.dtype().is(input.dtype()) || ShapeOf(output) != ShapeOf(input)) {
    throw py::value_error(where + "has dtype " + std::string(py::str(output.dtype())) +
                          " and shape " + std::string(py::str(output.attr("shape"))) +
                          ", the input " + std::string(py::str(input.dtype())) + " and " +
                          std::string(py::str(input.attr("shape"))));
  }
  return output;
}

py::array Allreduce(const py::object& value, const std::string& name, int op, double prescale,
                    double postscale, const py::object& out, int32_t process_set_id) {
  RequireInitialized("allreduce");
  py::array input = Contiguous(value);
  py::array output = OutputFor(input, out, name);
  std::vector<CollectiveRequest> requests;
  requests.push_back(AllreduceRequest(input, output, name, CheckedOp(op), prescale, postscale));
  requests.back().process_set_id = process_set_id;
  SubmitAndWait(std::move(requests));
  return output;
}

py::list GroupedAllreduce(const py::list& values, const std::vector<std::string>& names, int op,
                          double prescale, double postscale, int32_t process_set_id) {
  RequireInitialized("grouped_allreduce");
  if (values.size() != names.size()) {
    throw py::value_error("perseus_legacy.grouped_allreduce: " + std::to_string(values.size()) +
                          " arrays but " + std::to_string(names.size()) + " names");
  }
  const ReduceOp reduce_op = CheckedOp(op);
  std::vector<py::array> inputs, outputs;
  std::vector<CollectiveRequest> requests;
  for (size_t i = 0; i < names.size(); ++i) {
    inputs.push_back(Contiguous(values[i]));
    outputs.emplace_back(inputs.back().dtype(), ShapeOf(inputs.back()));
    requests.push_back(
        AllreduceRequest(inputs.back(), outputs.back(), names[i], reduce_op, prescale, postscale));
    requests.back().process_set_id = process_set_id;
  }
  SubmitAndWait(std::move(requests));
  py::list result;
  for (py::array& out : outputs) result.append(out);
  return result;
}

py::array Allgather(const py::object& value, const std::string& name, int32_t process_set_id) {
  RequireInitialized("allgather");
  py::array input = Contiguous(value);
  CollectiveRequest request = MakeRequest(input, name, CollectiveType::kAllgather, "allgather");
  request.process_set_id = process_set_id;
  auto out = std::make_shared<GrownOutput>();
  ExpectOutput(&request, out);
  std::vector<CollectiveRequest> requests;
  requests.push_back(std::move(request));
  SubmitAndWait(std::move(requests));
  return ToArray(input.dtype(), *out);
}

py::array Broadcast(const py::object& value, int root_rank, const std::string& name,
                    int32_t process_set_id) {
  RequireInitialized("broadcast");
  py::array input = Contiguous(value);
  py::array output(input.dtype(), ShapeOf(input));
  CollectiveRequest request = MakeRequest(input, name, CollectiveType::kBroadcast, "broadcast");
  request.root_rank = root_rank;
  request.process_set_id = process_set_id;
  request.output = output.mutable_data();
  std::vector<CollectiveRequest> requests;
  requests.push_back(std::move(request));
  SubmitAndWait(std::move(requests));
  return output;
}

py::tuple Alltoall(const py::object& value, const std::string& name,
                   const std::optional<std::vector<int64_t>>& splits, int32_t process_set_id) {
  RequireInitialized("alltoall");
  py::array input = Contiguous(value);
  CollectiveRequest request = MakeRequest(input, name, CollectiveType::kAlltoall, "alltoall");
  if (splits) request.splits = *splits;
  request.process_set_id = process_set_id;
  auto out = std::make_shared<GrownOutput>();
  ExpectOutput(&request, out);
  auto received = std::make_shared<std::vector<int64_t>>();
  request.received_splits = received.get();
  std::vector<CollectiveRequest> requests;
  requests.push_back(std::move(request));
  SubmitAndWait(std::move(requests));
  py::array_t<int64_t> received_splits(static_cast<py::ssize_t>(received->size()));
  std::copy(received->begin(), received->end(), received_splits.mutable_data());
  return py::make_tuple(ToArray(input.dtype(), *out), received_splits);
}

// Runs `call` (given an Interrupted, runtime.h) without the GIL, letting Python's signal
// handlers run every 100 ms meanwhile. When one raises (Ctrl-C), this rank shuts its runtime
// down (the other ranks fail naming it) and the exception propagates.
template <typename Call>
Status WaitInterruptibly(Call call) {
  bool raised = false;
  Status s;
  {
    py::gil_scoped_release release;
    s = call([&raised] {
      py::gil_scoped_acquire acquire;
      raised = PyErr_CheckSignals() != 0;
      return raised;
    });
    if (raised) Shutdown();
  }
  if (raised) throw py::error_already_set();
  return s;
}

// Init of the transport `name`, without the GIL (it waits for every rank); raises its error.
void InitOrRaise(const std::string& name, const TransportOptions& options) {
  Status s;
  {
    py::gil_scoped_release release;
    s = Init(name, options);
  }
  if (!s.ok()) throw std::runtime_error(s.message());
}

// The counters as a dict; "kind.type" names become {"kind": {"type": n}}.
py::dict StatsDict() {
  py::dict stats;
  for (const auto& [name, value] : RuntimeStatsSnapshot()) {
    const size_t dot = name.find('.');
    if (dot == std::string::npos) {
      stats[py::str(name)] = value;
      continue;
    }
    const py::str kind(name.substr(0, dot));
    if (!stats.contains(kind)) stats[kind] = py::dict();
    py::dict per_type = stats[kind];
    per_type[py::str(name.substr(dot + 1))] = value;
  }
  return stats;
}

// For tests only, not part of the API: an allreduce (Sum) whose done callback calls shutdown()
// on the runtime's background thread, as a framework's completion callback may, before it
// completes this call; returns the reduced array.
py::array AllreduceThenShutdownInCallback(const py::object& value, const std::string& name) {
  RequireInitialized("_allreduce_then_shutdown_in_callback");
  py::array input = Contiguous(value);
  py::array output(input.dtype(), ShapeOf(input));
  CollectiveRequest request = AllreduceRequest(input, output, name, ReduceOp::kSum, 1.0, 1.0);
  Status status;
  bool interrupted = false;
  {
    py::gil_scoped_release release;
    auto completion = std::make_shared<Completion>(1);
    request.done = [completion](const Status& s) {
      Shutdown();
      completion->Set(0, s);
    };
    const Status admitted = Enqueue(std::move(request));
    if (!admitted.ok()) completion->Set(0, admitted);  // refused: done never runs
    status = completion->Wait(&interrupted);
  }
  if (interrupted) throw py::error_already_set();
  if (!status.ok()) throw std::runtime_error(status.message());
  return output;
}

// The cost model's policy for the bindings below: `algorithm` a PERSEUS_ALLREDUCE_ALGORITHM name,
// a step latency of at least 0 and a link rate above 0, or a ValueError.
AllreducePolicy PolicyOf(double hop_latency_us, double link_gbit, const std::string& algorithm) {
  if (hop_latency_us < 0 || link_gbit <= 0)
    throw py::value_error("hop_latency_us must be >= 0 and link_gbit > 0");
  AllreducePolicy policy;
  if (!ParseAllreduceAlgorithm(algorithm, &policy.algorithm))
    throw py::value_error("unknown allreduce algorithm \"" + algorithm + "\"");
  policy.hop_latency_secs = hop_latency_us * 1e-6;
  policy.link_bytes_per_sec = link_gbit * 1e9 / 8;
  return policy;
}

}  // namespace
}  // namespace perseus

PYBIND11_MODULE(_core, m) {
  using namespace perseus;
  m.doc() = "perseus_legacy native core: process group and numpy collectives";

  m.def(
      "init_mpi",
      [](intptr_t comm_handle, double start_timeout) {
        TransportOptions options;
        options.mpi_comm_handle = comm_handle;
        options.mpi_start_timeout_secs = start_timeout;
        InitOrRaise("mpi", options);
      },
      py::arg("comm_handle") = 0, py::arg("start_timeout") = 120.0,
      "Joins the process group (collective): MPI_COMM_WORLD, or the MPI_Comm handle given; "
      "each step of the set-up waits at most `start_timeout` seconds for the other ranks.");
  m.def(
      "init_tcp",
      [](int rank, std::vector<std::string> addresses, int local_rank, int local_size,
         int cross_rank, int cross_size, std::string secret, double start_timeout,
         double debug_resolve_secs) {
        TransportOptions options;
        TcpOptions& tcp = options.tcp;
        tcp.rank = rank;
        tcp.addresses = std::move(addresses);
        tcp.local_rank = local_rank;
        tcp.local_size = local_size;
        tcp.cross_rank = cross_rank;
        tcp.cross_size = cross_size;
        tcp.secret = std::move(secret);
        tcp.start_timeout_secs = start_timeout;
        tcp.debug_resolve_secs = debug_resolve_secs;
        InitOrRaise("tcp", options);
      },
      py::arg("rank"), py::arg("addresses"), py::arg("local_rank"), py::arg("local_size"),
      py::arg("cross_rank"), py::arg("cross_size"), py::arg("secret"),
      py::arg("start_timeout") = 120.0, py::arg("debug_resolve_secs") = 0.0,
      "Joins the process group over TCP (collective): ranks meet at their `addresses` "
      "(host:port, rank order) and prove `secret`; MPI is never initialized.");
  m.def("shutdown", &Shutdown, py::call_guard<py::gil_scoped_release>(),
        "Leaves the process group; pending and later collectives fail on every rank.");
  m.def("abort", &Abort, py::arg("reason"), py::call_guard<py::gil_scoped_release>(),
        "This rank's program failed with `reason`: every rank's pending and later collectives "
        "fail with it, the other ranks' at once. A no-op before init(), after shutdown() and "
        "once the runtime has stopped.");
  m.def("is_initialized", &IsInitialized);
  m.def("rank", &Rank, "This process's rank, or -1 before init().");
  m.def("size", &Size, "Number of ranks, or -1 before init().");
  m.def("local_rank", &LocalRank, "Rank among this host's processes, or -1 before init().");
  m.def("local_size", &LocalSize, "Number of ranks on this host, or -1 before init().");
  m.def("cross_rank", &CrossRank, "Index of this host, or -1 before init().");
  m.def("cross_size", &CrossSize, "Number of hosts, or -1 before init().");
  m.def("mpi_threads_supported", &MpiThreadsSupported);
  m.def(
      "transports",
      [] {
        py::list all;
        for (const Transport& registered : RegisteredTransports()) {
          py::dict transport;
          transport["name"] = registered.name;
          transport["built"] = registered.built;
          transport["binding"] = registered.binding;
          all.append(transport);
        }
        return all;
      },
      "Every transport this library registers, in name order: [{\"name\": ..., \"built\": "
      "bool, \"binding\": the function of this module that joins over it}]; a transport that "
      "is not built fails init() saying so.");
  m.def(
      "build_info",
      [] {
        py::dict info;
        for (const Transport& t : RegisteredTransports()) info[py::str(t.name)] = t.built;
        info["nccl"] = false;
        info["controller"] = ControllerName();
        return info;
      },
      "{transport name: built, ..., \"nccl\": False, \"controller\": the transport of the "
      "current or last init(), \"\" before the first}.");

  m.def(
      "join",
      [] {
        RequireInitialized("join");
        int last_joined_rank = -1;
        const Status s = WaitInterruptibly(
            [&](const Interrupted& interrupted) { return Join(&last_joined_rank, interrupted); });
        if (!s.ok()) throw std::runtime_error(s.message());
        return last_joined_rank;
      },
      "Blocks until every rank has called join() (this rank has no more data; it takes part in "
      "the others' collectives without data meanwhile); returns the rank that joined last.");
  m.def("take_peer_joined", &TakePeerJoined,
        "Whether a collective of this rank ran while another rank had joined, since the last "
        "call (which resets it).");
  m.def("runtime_stats", &StatsDict,
        "This process's runtime counters since it started: tensors and bytes submitted and "
        "collectives executed per collective type, fused groups, response-cache hits, misses, "
        "evictions, negotiation rounds, stall warnings.");
  m.def(
      "start_timeline",
      [](const std::string& path) {
        Status s = StartTimeline(path);
        if (!s.ok()) throw std::runtime_error(s.message());
      },
      py::arg("path"),
      "Writes this rank's timeline (Chrome trace events) to `path` with \".rank<r>\" inserted "
      "before the extension.");
  m.def("stop_timeline", &StopTimeline, py::call_guard<py::gil_scoped_release>(),
        "Writes out and closes the timeline; a no-op when none runs.");
  m.def("allreduce", &Allreduce, py::arg("array"), py::arg("name"), py::arg("op") = 0,
        py::arg("prescale_factor") = 1.0, py::arg("postscale_factor") = 1.0,
        py::arg("out") = py::none(), py::arg("process_set_id") = 0,
        "Reduces `array` over all ranks (op: Average=0, Sum=1, Min=2, Max=3, Product=4) into a "
        "new array, or into `out` (same dtype and shape; may be `array` itself).");
  m.def("grouped_allreduce", &GroupedAllreduce, py::arg("arrays"), py::arg("names"),
        py::arg("op") = 0, py::arg("prescale_factor") = 1.0, py::arg("postscale_factor") = 1.0,
        py::arg("process_set_id") = 0,
        "Submits every allreduce, then waits for all: they may be fused into one.");
  m.def("allgather", &Allgather, py::arg("array"), py::arg("name"), py::arg("process_set_id") = 0,
        "Concatenates every rank's array along the first dimension (which may differ).");
  m.def("broadcast", &Broadcast, py::arg("array"), py::arg("root_rank"), py::arg("name"),
        py::arg("process_set_id") = 0,
        "Returns root_rank's array on every rank.");
  m.def("alltoall", &Alltoall, py::arg("array"), py::arg("name"),
        py::arg("splits") = py::none(), py::arg("process_set_id") = 0,
        "Sends splits[r] rows to rank r (default: equal parts); returns (rows received, "
        "received_splits).");

  m.def(
      "add_process_set",
      [](const std::vector<int>& ranks) {
        RequireInitialized("add_process_set");
        int32_t id = 0;
        const Status s = WaitInterruptibly(
            [&](const Interrupted& interrupted) { return AddProcessSet(ranks, &id, interrupted); });
        if (!s.ok()) throw py::value_error(s.message());
        return id;
      },
      py::arg("ranks"),
      "Registers a process set on every rank (collective, same order everywhere); its id.");
  m.def(
      "remove_process_set",
      [](int32_t id) {
        RequireInitialized("remove_process_set");
        const Status s = WaitInterruptibly(
            [&](const Interrupted& interrupted) { return RemoveProcessSet(id, interrupted); });
        if (!s.ok()) throw py::value_error(s.message());
      },
      py::arg("process_set_id"),
      "Removes a process set on every rank (collective, same order everywhere).");
  m.def(
      "process_sets",
      [] {
        py::dict sets;
        for (const auto& [id, ranks] : ProcessSets()) sets[py::int_(id)] = ranks;
        return sets;
      },
      "{id: ranks} of every registered process set; empty before init().");

  m.def(
      "allreduce_cost",
      [](int ranks, double nbytes, double hop_latency_us, double link_gbit,
         const std::string& algorithm) {
        if (ranks < 2) throw py::value_error("ranks must be at least 2, not " +
                                             std::to_string(ranks));
        if (nbytes < 0) throw py::value_error("nbytes must be >= 0");
        const AllreducePolicy policy = PolicyOf(hop_latency_us, link_gbit, algorithm);
        const AllreduceAlgorithm chosen =
            ChooseAllreduce(ranks, static_cast<size_t>(nbytes), policy);
        return py::make_tuple(AllreduceAlgorithmName(chosen),
                              ModelledAllreduceSecs(chosen, ranks, nbytes, policy));
      },
      py::arg("ranks"), py::arg("nbytes"), py::arg("hop_latency_us"), py::arg("link_gbit"),
      py::arg("algorithm") = "auto",
      "The allreduce cost model of the TCP and MPI point-to-point paths: (the algorithm "
      "`algorithm` names, or under \"auto\" the one the runtime picks for `nbytes` over `ranks` "
      "ranks with that step latency and link rate; the seconds the model gives it). No init "
      "needed.");

  m.def(
      "own_collective_bytes",
      [](int ranks, double hop_latency_us, double link_gbit, const std::string& algorithm) {
        if (ranks < 1) throw py::value_error("ranks must be at least 1, not " +
                                             std::to_string(ranks));
        return OwnCollectiveBytes(ranks, PolicyOf(hop_latency_us, link_gbit, algorithm));
      },
      py::arg("ranks"), py::arg("hop_latency_us"), py::arg("link_gbit"),
      py::arg("algorithm") = "auto",
      "The size from which a tensor negotiated together with others runs as an allreduce of its "
      "own instead of through the fusion buffer, over `ranks` ranks with that step latency, "
      "link rate and PERSEUS_ALLREDUCE_ALGORITHM. No init needed.");

  m.def(
      "hierarchical_cost",
      [](int local_ranks, int hosts, double nbytes, double hop_latency_us, double link_gbit,
         const std::string& algorithm, int slices) {
        if (local_ranks < 1 || hosts < 1 || local_ranks * hosts < 2)
          throw py::value_error("local_ranks and hosts must be at least 1, 2 ranks in all, not " +
                                std::to_string(local_ranks) + " and " + std::to_string(hosts));
        if (nbytes < 0) throw py::value_error("nbytes must be >= 0");
        const AllreducePolicy policy = PolicyOf(hop_latency_us, link_gbit, algorithm);
        if (slices >= 0 && policy.algorithm == AllreduceAlgorithm::kAuto)
          throw py::value_error("a plan given by its slices needs its algorithm across hosts");
        const HierarchicalPlan plan =
            slices >= 0 ? HierarchicalPlan{slices, policy.algorithm}
                        : ChooseHierarchical(local_ranks, hosts, static_cast<size_t>(nbytes),
                                             policy);
        return py::make_tuple(
            plan.slices, AllreduceAlgorithmName(plan.across),
            ModelledHierarchicalSecs(local_ranks, hosts, nbytes, plan, policy));
      },
      py::arg("local_ranks"), py::arg("hosts"), py::arg("nbytes"), py::arg("hop_latency_us"),
      py::arg("link_gbit"), py::arg("algorithm") = "auto", py::arg("slices") = -1,
      "The hierarchical allreduce's cost model (TCP): (slices, the algorithm across hosts, "
      "seconds). slices -1: the plan the runtime picks for `nbytes` over `local_ranks` ranks on "
      "each of `hosts` hosts with that step latency and link rate (`algorithm`: the "
      "PERSEUS_ALLREDUCE_ALGORITHM setting); slices 0 (the phases one after another) or more "
      "(overlapped on that many slices), with `algorithm` across hosts: that plan's seconds. "
      "No init needed.");

  m.def(
      "_wire_decode",
      [](const std::string& which, const py::bytes& data) -> py::object {
        const std::string bytes = data;
        std::string again;
        if (which == "requests") {
          RequestList list;
          if (!Deserialize(bytes, &list)) return py::none();
          again = Serialize(list);
        } else if (which == "responses") {
          ResponseList list;
          if (!Deserialize(bytes, &list)) return py::none();
          again = Serialize(list);
        } else {
          throw py::value_error("which must be \"requests\" or \"responses\", not \"" + which +
                                "\"");
        }
        return py::bytes(again);
      },
      py::arg("which"), py::arg("data"),
      "For tests of the wire format: `data` decoded as a RequestList (\"requests\") or a "
      "ResponseList (\"responses\") and encoded again, or None when it is malformed.");

  m.def("_allreduce_then_shutdown_in_callback", &AllreduceThenShutdownInCallback,
        py::arg("array"), py::arg("name"),
        "For tests only: allreduce (Sum) of `array` whose done callback, on the runtime's "
        "background thread, calls shutdown() before this call returns the result.");

  // Leaving the group at interpreter exit lets the other ranks fail fast instead of waiting.
  py::module_::import("atexit").attr("register")(
      py::cpp_function([] {
        py::gil_scoped_release release;
        Shutdown();
      }));
}
