// TensorFlow glue: the Perseus* graph ops and their CPU kernels.
//
// Every kernel is an AsyncOpKernel: ComputeAsync validates its inputs, builds one
// perseus::CollectiveRequest and hands it to the runtime (perseus::Enqueue), then returns at once.
// The runtime's background thread later fills the outputs and runs the request's `done`, which
// sets the kernel's status and calls TensorFlow's done callback. No TF executor thread ever waits
// on communication, so independent collectives of one step are all in flight together and the
// runtime can fuse them.
//
// No algorithm lives here: reduction, scaling, fusion and negotiation belong to ops/runtime.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/common.h"
#include "runtime/runtime.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace perseus {
namespace tensorflow_ops {
namespace {

namespace tf = ::tensorflow;
using tf::AsyncOpKernel;
using tf::OpKernelConstruction;
using tf::OpKernelContext;
using tf::Tensor;
using tf::TensorShape;
using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;

// dtype lists of the op definitions. One kernel registration per op (no TypeConstraint) serves
// every dtype the op definition allows, since the kernels only move bytes and pass the dtype on.
#define COLLECTIVE_REDUCIBLE_TYPES \
  "half, bfloat16, float, double, int32, int64, uint8, int8, int16, uint16"
#define COLLECTIVE_ALL_TYPES COLLECTIVE_REDUCIBLE_TYPES ", bool"

// The single TF -> runtime dtype mapping.
tf::Status ToPerseusDataType(tf::DataType tf_dtype, DataType* out) {
  switch (tf_dtype) {
    case tf::DT_HALF: *out = DataType::kFloat16; return tf::OkStatus();
    case tf::DT_BFLOAT16: *out = DataType::kBFloat16; return tf::OkStatus();
    case tf::DT_FLOAT: *out = DataType::kFloat32; return tf::OkStatus();
    case tf::DT_DOUBLE: *out = DataType::kFloat64; return tf::OkStatus();
    case tf::DT_INT32: *out = DataType::kInt32; return tf::OkStatus();
    case tf::DT_INT64: *out = DataType::kInt64; return tf::OkStatus();
    case tf::DT_UINT8: *out = DataType::kUInt8; return tf::OkStatus();
    case tf::DT_INT8: *out = DataType::kInt8; return tf::OkStatus();
    case tf::DT_BOOL: *out = DataType::kBool; return tf::OkStatus();
    case tf::DT_INT16: *out = DataType::kInt16; return tf::OkStatus();
    case tf::DT_UINT16: *out = DataType::kUInt16; return tf::OkStatus();
    default:
      return tf::errors::InvalidArgument("perseus_legacy collectives do not support dtype ",
                                         tf::DataTypeString(tf_dtype));
  }
}

// A failed collective as the TensorFlow error a Horovod user catches: FailedPrecondition when
// the ranks' requests disagree, Unknown when the collective could not run.
tf::Status FailedCollective(const std::string& what, const Status& status) {
  const std::string text = what + " failed: " + status.message();
  if (status.kind() == ErrorKind::kMismatch) return tf::errors::FailedPrecondition(text);
  return tf::errors::Unknown(text);
}

// The number of ranks in process set `id` on this rank, or -1 when it is not registered (the
// runtime then refuses the request with an error naming the set).
int ProcessSetSize(int32_t id) {
  for (const auto& [set, ranks] : perseus::ProcessSets()) {
    if (set == id) return static_cast<int>(ranks.size());
  }
  return -1;
}

std::vector<int64_t> ShapeOf(const TensorShape& shape) {
  std::vector<int64_t> dims;
  dims.reserve(shape.dims());
  for (int i = 0; i < shape.dims(); ++i) dims.push_back(shape.dim_size(i));
  return dims;
}

// Common part of the four kernels: the tensor name, the request skeleton, and the hand-off to the
// runtime with its completion. Subclasses only describe their buffers.
class CollectiveOpKernel : public AsyncOpKernel {
 public:
  CollectiveOpKernel(OpKernelConstruction* ctx, CollectiveType type)
      : AsyncOpKernel(ctx), type_(type) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tensor_name", &tensor_name_));
    // An empty name means "the node name": unique within a graph, and identical on every rank
    // when every rank builds the same graph.
    if (tensor_name_.empty()) tensor_name_ = name();
    OP_REQUIRES_OK(ctx, ctx->GetAttr("process_set_id", &process_set_id_));
    description_ = type_string() + " '" + tensor_name_ + "'";
  }

 protected:
  // Runs after a successful collective, still before TF's done (e.g. to fill extra outputs).
  using OnSuccess = std::function<tf::Status(OpKernelContext*)>;

  // Fills name/type/dtype/shape from input 0, after checking the runtime is up.
  tf::Status StartRequest(OpKernelContext* ctx, CollectiveRequest* request) const {
    if (!perseus::IsInitialized()) {
      return tf::errors::FailedPrecondition(
          "perseus_legacy has not been initialized: call perseus_legacy.init() before running ",
          description_);
    }
    const Tensor& input = ctx->input(0);
    request->name = tensor_name_;
    request->type = type_;
    request->process_set_id = process_set_id_;
    TF_RETURN_IF_ERROR(ToPerseusDataType(input.dtype(), &request->dtype));
    request->shape = ShapeOf(input.shape());
    request->input = input.data();
    return tf::OkStatus();
  }

  // Hands the request to the runtime. `done` of TF runs exactly once: here if the runtime refuses
  // the request, otherwise on the runtime's background thread.
  void Submit(OpKernelContext* ctx, CollectiveRequest request, DoneCallback done,
              OnSuccess on_success = nullptr) {
    // The context, its inputs and outputs stay valid until `done` runs.
    request.done = [ctx, done, what = description_, on_success](const Status& status) {
      if (!status.ok()) {
        ctx->SetStatus(FailedCollective(what, status));
      } else if (on_success) {
        ctx->SetStatus(on_success(ctx));
      }
      done();
    };
    Status enqueued = perseus::Enqueue(std::move(request));
    if (!enqueued.ok()) {
      ctx->SetStatus(tf::errors::FailedPrecondition(description_, " could not be submitted: ",
                                                    enqueued.message()));
      done();
    }
  }

  const std::string& tensor_name() const { return tensor_name_; }
  int process_set_id() const { return process_set_id_; }

 private:
  CollectiveType type_;
  std::string tensor_name_;
  int process_set_id_ = 0;
  std::string description_;  // "PerseusAllreduce 'name'", for error messages
};

// Output 0 of allreduce / broadcast: the input's shape, in the input's own buffer when the
// executor lets us forward it (the runtime then reduces in place), otherwise a new buffer that
// MPI writes directly (it reads the input where it is). Either way there is no staging copy.
tf::Status SameShapeOutput(OpKernelContext* ctx, Tensor** output) {
  if (ctx->forward_input_to_output_with_shape(0, 0, ctx->input(0).shape(), output)) {
    return tf::OkStatus();
  }
  return ctx->allocate_output(0, ctx->input(0).shape(), output);
}

// An allreduce whose input cannot be forwarded (a variable, a tensor with other consumers) needs
// a new output every step. TF's default CPU allocator hands large buffers back to the OS, so each
// step would page-fault its output in again, which costs more than the reduction itself at tens
// of MiB. The kernel keeps its last large output and reuses it once nobody else holds it; the
// buffer stays resident between steps, as it would in a caching allocator. Only in a Session:
// there a kernel belongs to one graph node that runs every step, while eager kernels are cached
// by attributes (tensor names included) and may never run again, so they must not hold memory.
class ReusedOutput {
 public:
  tf::Status Get(OpKernelContext* ctx, void** data) {
    const Tensor& input = ctx->input(0);
    Tensor* output = nullptr;
    if (input.TotalBytes() < kMinBytes || ctx->session_handle().empty() ||
        ctx->forward_input_to_output_with_shape(0, 0, input.shape(), &output)) {
      if (output == nullptr) TF_RETURN_IF_ERROR(SameShapeOutput(ctx, &output));
      *data = output->data();
      return tf::OkStatus();
    }
    std::lock_guard<std::mutex> lock(mu_);
    // Refcount one: no consumer, fetch or eager handle of an earlier step still sees it.
    if (last_.IsInitialized() && last_.dtype() == input.dtype() &&
        last_.shape() == input.shape() && last_.RefCountIsOne()) {
      ctx->set_output(0, last_);
      *data = last_.data();
      return tf::OkStatus();
    }
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, input.shape(), &output));
    last_ = *output;
    *data = output->data();
    return tf::OkStatus();
  }

 private:
  static constexpr size_t kMinBytes = size_t{1} << 20;
  std::mutex mu_;
  Tensor last_;
};

// Output `index` allocated by the runtime's background thread once its shape is known.
OutputAllocator AllocateOutputLater(OpKernelContext* ctx, int index) {
  return [ctx, index](const std::vector<int64_t>& dims, void** data) -> Status {
    TensorShape shape;
    tf::Status status = TensorShape::BuildTensorShape(dims, &shape);
    Tensor* output = nullptr;
    if (status.ok()) status = ctx->allocate_output(index, shape, &output);
    if (!status.ok()) return Status::Error(std::string(status.message()));
    *data = output->data();
    return Status::OK();
  };
}

// The reduction attributes of PerseusAllreduce and PerseusGroupedAllreduce.
struct Reduction {
  ReduceOp op = ReduceOp::kAverage;
  float prescale_factor = 1.0f;  // TF op attributes have no double
  float postscale_factor = 1.0f;

  tf::Status Read(OpKernelConstruction* ctx) {
    int reduce_op = 0;
    TF_RETURN_IF_ERROR(ctx->GetAttr("reduce_op", &reduce_op));
    if (reduce_op < 0 || reduce_op > static_cast<int>(kLastReduceOp)) {
      return tf::errors::InvalidArgument("unknown reduce_op ", reduce_op,
                                         " (0=Average, 1=Sum, 2=Min, 3=Max, 4=Product)");
    }
    op = static_cast<ReduceOp>(reduce_op);
    TF_RETURN_IF_ERROR(ctx->GetAttr("prescale_factor", &prescale_factor));
    return ctx->GetAttr("postscale_factor", &postscale_factor);
  }

  void Apply(CollectiveRequest* request) const {
    request->reduce_op = op;
    request->prescale_factor = prescale_factor;
    request->postscale_factor = postscale_factor;
  }
};

class AllreduceOp : public CollectiveOpKernel {
 public:
  explicit AllreduceOp(OpKernelConstruction* ctx)
      : CollectiveOpKernel(ctx, CollectiveType::kAllreduce) {
    OP_REQUIRES_OK(ctx, reduction_.Read(ctx));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    CollectiveRequest request;
    OP_REQUIRES_OK_ASYNC(ctx, StartRequest(ctx, &request), done);
    OP_REQUIRES_OK_ASYNC(ctx, output_.Get(ctx, &request.output), done);
    reduction_.Apply(&request);
    Submit(ctx, std::move(request), std::move(done));
  }

 private:
  Reduction reduction_;
  ReusedOutput output_;
};

// N tensors (dtypes may differ) reduced as N collectives named `<tensor_name>.<i>`, handed to the
// runtime in one go, so that they are negotiated together and fused; done runs once all are.
class GroupedAllreduceOp : public AsyncOpKernel {
 public:
  explicit GroupedAllreduceOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tensor_name", &tensor_name_));
    if (tensor_name_.empty()) tensor_name_ = name();
    OP_REQUIRES_OK(ctx, ctx->GetAttr("process_set_id", &process_set_id_));
    OP_REQUIRES_OK(ctx, reduction_.Read(ctx));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    OP_REQUIRES_ASYNC(ctx, perseus::IsInitialized(),
                      tf::errors::FailedPrecondition(
                          "perseus_legacy has not been initialized: call perseus_legacy.init() "
                          "before running PerseusGroupedAllreduce '", tensor_name_, "'"),
                      done);
    const int n = ctx->num_inputs();
    std::vector<CollectiveRequest> requests(n);
    for (int i = 0; i < n; ++i) {
      CollectiveRequest& request = requests[i];
      const Tensor& input = ctx->input(i);
      request.name = tensor_name_ + "." + std::to_string(i);
      request.type = CollectiveType::kAllreduce;
      request.process_set_id = process_set_id_;
      OP_REQUIRES_OK_ASYNC(ctx, ToPerseusDataType(input.dtype(), &request.dtype), done);
      request.shape = ShapeOf(input.shape());
      request.input = input.data();
      Tensor* output = nullptr;
      if (!ctx->forward_input_to_output_with_shape(i, i, input.shape(), &output)) {
        OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(i, input.shape(), &output), done);
      }
      request.output = output->data();
      reduction_.Apply(&request);
    }
    // The context stays valid until `done` runs, after the last request completed.
    struct Group {
      std::mutex mu;
      int remaining;
      Status error;  // the first failure
    };
    auto group = std::make_shared<Group>();
    group->remaining = n;
    auto finish = [ctx, done, group, what = tensor_name_](const Status& status) {
      {
        std::lock_guard<std::mutex> lock(group->mu);
        if (!status.ok() && group->error.ok()) group->error = status;
        if (--group->remaining > 0) return;
      }
      if (!group->error.ok()) {
        ctx->SetStatus(FailedCollective("PerseusGroupedAllreduce '" + what + "'", group->error));
      }
      done();
    };
    for (CollectiveRequest& request : requests) request.done = finish;
    std::vector<Status> admitted = perseus::EnqueueAll(std::move(requests));
    for (const Status& status : admitted) {
      if (!status.ok()) finish(status);  // refused: its done never runs
    }
  }

 private:
  std::string tensor_name_;
  int process_set_id_ = 0;
  Reduction reduction_;
};

class AllgatherOp : public CollectiveOpKernel {
 public:
  explicit AllgatherOp(OpKernelConstruction* ctx)
      : CollectiveOpKernel(ctx, CollectiveType::kAllgather) {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    OP_REQUIRES_ASYNC(ctx, ctx->input(0).dims() >= 1,
                      tf::errors::InvalidArgument("allgather '", tensor_name(),
                                                  "' needs a tensor of rank >= 1, got a scalar"),
                      done);
    CollectiveRequest request;
    OP_REQUIRES_OK_ASYNC(ctx, StartRequest(ctx, &request), done);
    request.allocate_output = AllocateOutputLater(ctx, 0);
    Submit(ctx, std::move(request), std::move(done));
  }
};

class BroadcastOp : public CollectiveOpKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction* ctx)
      : CollectiveOpKernel(ctx, CollectiveType::kBroadcast) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("root_rank", &root_rank_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    CollectiveRequest request;
    OP_REQUIRES_OK_ASYNC(ctx, StartRequest(ctx, &request), done);
    const int size = perseus::Size();
    OP_REQUIRES_ASYNC(ctx, root_rank_ >= 0 && root_rank_ < size,
                      tf::errors::InvalidArgument("broadcast '", tensor_name(), "': root_rank ",
                                                  root_rank_, " is not in [0, ", size, ")"),
                      done);
    // Broadcasts mostly run once (initial variables): no buffer is kept for a next step.
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, SameShapeOutput(ctx, &output), done);
    request.output = output->data();
    request.root_rank = root_rank_;
    Submit(ctx, std::move(request), std::move(done));
  }

 private:
  int root_rank_ = 0;
};

template <typename T>
std::vector<int64_t> ReadSplits(const Tensor& splits) {
  auto flat = splits.flat<T>();
  return std::vector<int64_t>(flat.data(), flat.data() + flat.size());
}

template <typename T>
void WriteSplits(const std::vector<int64_t>& values, Tensor* out) {
  auto flat = out->flat<T>();
  for (size_t i = 0; i < values.size(); ++i) flat(i) = static_cast<T>(values[i]);
}

class AlltoallOp : public CollectiveOpKernel {
 public:
  explicit AlltoallOp(OpKernelConstruction* ctx)
      : CollectiveOpKernel(ctx, CollectiveType::kAlltoall) {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& input = ctx->input(0);
    const Tensor& splits_tensor = ctx->input(1);
    OP_REQUIRES_ASYNC(ctx, input.dims() >= 1,
                      tf::errors::InvalidArgument("alltoall '", tensor_name(),
                                                  "' needs a tensor of rank >= 1, got a scalar"),
                      done);
    OP_REQUIRES_ASYNC(ctx, splits_tensor.dims() == 1,
                      tf::errors::InvalidArgument("alltoall '", tensor_name(),
                                                  "': splits must be a vector, got shape ",
                                                  splits_tensor.shape().DebugString()),
                      done);
    CollectiveRequest request;
    OP_REQUIRES_OK_ASYNC(ctx, StartRequest(ctx, &request), done);
    request.splits = splits_tensor.dtype() == tf::DT_INT32 ? ReadSplits<int32_t>(splits_tensor)
                                                           : ReadSplits<int64_t>(splits_tensor);
    OP_REQUIRES_OK_ASYNC(ctx, CheckSplits(request.splits, input.dim_size(0)), done);

    auto received = std::make_shared<std::vector<int64_t>>();
    request.received_splits = received.get();
    request.allocate_output = AllocateOutputLater(ctx, 0);
    const tf::DataType splits_dtype = splits_tensor.dtype();
    auto write_received = [received, splits_dtype](OpKernelContext* c) -> tf::Status {
      Tensor* out = nullptr;
      TF_RETURN_IF_ERROR(c->allocate_output(
          1, TensorShape({static_cast<int64_t>(received->size())}), &out));
      if (splits_dtype == tf::DT_INT32) {
        WriteSplits<int32_t>(*received, out);
      } else {
        WriteSplits<int64_t>(*received, out);
      }
      return tf::OkStatus();
    };
    Submit(ctx, std::move(request), std::move(done), std::move(write_received));
  }

 private:
  tf::Status CheckSplits(const std::vector<int64_t>& splits, int64_t rows) const {
    const int size = ProcessSetSize(process_set_id());
    if (size <= 0) return tf::OkStatus();  // an unknown set: the runtime names it
    if (splits.empty()) {
      if (rows % size != 0) {
        return tf::errors::InvalidArgument("alltoall '", tensor_name(), "': without splits, dim 0 (",
                                           rows, ") must be divisible by the number of ranks (",
                                           size, ")");
      }
      return tf::OkStatus();
    }
    if (static_cast<int>(splits.size()) != size) {
      return tf::errors::InvalidArgument("alltoall '", tensor_name(), "': splits has ",
                                         splits.size(), " entries, expected one per rank (", size,
                                         ")");
    }
    int64_t total = 0;
    for (int64_t s : splits) {
      if (s < 0) {
        return tf::errors::InvalidArgument("alltoall '", tensor_name(),
                                           "': splits must be non-negative, got ", s);
      }
      total += s;
    }
    if (total != rows) {
      return tf::errors::InvalidArgument("alltoall '", tensor_name(), "': splits sum to ", total,
                                         " but the tensor has ", rows, " rows");
    }
    return tf::OkStatus();
  }
};

// Allgather / alltoall: dim 0 depends on the other ranks; the other dims are kept.
tf::Status UnknownFirstDim(InferenceContext* c) {
  ShapeHandle input;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &input));
  ShapeHandle output;
  TF_RETURN_IF_ERROR(c->ReplaceDim(input, 0, c->UnknownDim(), &output));
  c->set_output(0, output);
  return tf::OkStatus();
}

}  // namespace

// The ops are stateful so that neither Grappler nor the session's graph optimizer constant-folds
// or deduplicates a collective (folding allreduce(constant) would run it at optimization time).
// perseus_legacy/ops.py exempts them from tf.function's automatic program-order chaining, as TF
// does for its own collectives, so the collectives of one step can still be fused.
REGISTER_OP("PerseusAllreduce")
    .Attr("T: {" COLLECTIVE_REDUCIBLE_TYPES "}")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Output("reduced: T")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Reduces `tensor` across all ranks (reduce_op: 0=Average 1=Sum 2=Min 3=Max 4=Product).");

REGISTER_OP("PerseusGroupedAllreduce")
    .Attr("T: list({" COLLECTIVE_REDUCIBLE_TYPES "})")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensors: T")
    .Output("reduced: T")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return ::tensorflow::OkStatus();
    })
    .Doc("Reduces every tensor of `tensors` like PerseusAllreduce, submitted together.");

REGISTER_OP("PerseusAllgather")
    .Attr("T: {" COLLECTIVE_ALL_TYPES "}")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Output("gathered: T")
    .SetIsStateful()
    .SetShapeFn(UnknownFirstDim)
    .Doc("Concatenates every rank's `tensor` along dim 0, in rank order; dim 0 may differ.");

REGISTER_OP("PerseusBroadcast")
    .Attr("T: {" COLLECTIVE_ALL_TYPES "}")
    .Attr("root_rank: int")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Output("broadcast: T")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Returns `root_rank`'s `tensor` on every rank.");

REGISTER_OP("PerseusAlltoall")
    .Attr("T: {" COLLECTIVE_ALL_TYPES "}")
    .Attr("Tsplits: {int32, int64} = DT_INT32")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Input("splits: Tsplits")
    .Output("received: T")
    .Output("received_splits: Tsplits")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle splits;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &splits));
      TF_RETURN_IF_ERROR(UnknownFirstDim(c));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return ::tensorflow::OkStatus();
    })
    .Doc("Sends splits[r] rows of `tensor` to rank r (evenly when splits is empty); returns the "
         "rows received from every rank, in rank order, and how many came from each.");

// A GPU build would register the same classes for DEVICE_GPU (alltoall's `splits` and
// `received_splits` in HostMemory) and pass the device to the runtime with the request.
#define REGISTER_COLLECTIVE_KERNEL(op, kernel, device) \
  REGISTER_KERNEL_BUILDER(Name(op).Device(device), kernel)

REGISTER_COLLECTIVE_KERNEL("PerseusAllreduce", AllreduceOp, ::tensorflow::DEVICE_CPU);
REGISTER_COLLECTIVE_KERNEL("PerseusGroupedAllreduce", GroupedAllreduceOp, ::tensorflow::DEVICE_CPU);
REGISTER_COLLECTIVE_KERNEL("PerseusAllgather", AllgatherOp, ::tensorflow::DEVICE_CPU);
REGISTER_COLLECTIVE_KERNEL("PerseusBroadcast", BroadcastOp, ::tensorflow::DEVICE_CPU);
REGISTER_COLLECTIVE_KERNEL("PerseusAlltoall", AlltoallOp, ::tensorflow::DEVICE_CPU);

}  // namespace tensorflow_ops
}  // namespace perseus
