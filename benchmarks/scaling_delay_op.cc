// EmulatedDelay: benchmarks/scaling_model.py's emulated accelerator time. The op forwards its
// input unchanged after `micros` microseconds without holding a thread or a core: an
// AsyncOpKernel whose completion a single timer thread calls when the time is up, as a GPU
// kernel ends while the CPU does something else.
//
// All delays of a process form one stream, like kernels on one GPU: a delay starts when the
// previous one ends or when it is started, whichever is later. A GPU runs its next kernel
// straight after the last because the CPU queued it ahead; here the next delay can only be
// started once the previous one has completed and the executor has woken up, which on a
// loaded host takes up to a millisecond. So a delay started at most kLaunchSlack after the
// stream's end is timed from that end; one started later (after a real wait: an allreduce,
// the next step) from its start. Built on first use against the TensorFlow that loads it
// (scaling_model.build_delay_library); never part of the perseus_legacy library.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::microseconds kLaunchSlack(1000);

// Runs callbacks at their due time on one thread, in due-time order.
class Timer {
 public:
  static Timer& Get() {
    static Timer* timer = new Timer();  // never destroyed: kernels may complete at exit
    return *timer;
  }

  // Runs `callback` once the stream has spent `micros` more on it.
  void After(std::chrono::microseconds micros, std::function<void()> callback) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      Clock::time_point start = std::max(Clock::now() - kLaunchSlack, stream_end_);
      stream_end_ = start + micros;
      due_.emplace(stream_end_, std::move(callback));
    }
    changed_.notify_one();
  }

 private:
  Timer() : thread_([this] { Loop(); }) { thread_.detach(); }

  void Loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      if (due_.empty()) {
        changed_.wait(lock);
        continue;
      }
      auto next = due_.begin();
      if (Clock::now() < next->first) {
        changed_.wait_until(lock, next->first);
        continue;
      }
      std::function<void()> callback = std::move(next->second);
      due_.erase(next);
      lock.unlock();
      callback();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::multimap<Clock::time_point, std::function<void()>> due_;
  Clock::time_point stream_end_;
  std::thread thread_;
};

class EmulatedDelayOp : public tensorflow::AsyncOpKernel {
 public:
  explicit EmulatedDelayOp(tensorflow::OpKernelConstruction* context)
      : AsyncOpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("micros", &micros_));
    OP_REQUIRES(context, micros_ >= 0,
                tensorflow::errors::InvalidArgument("EmulatedDelay ", name(),
                                                    ": micros must be >= 0, got ", micros_));
  }

  void ComputeAsync(tensorflow::OpKernelContext* context, DoneCallback done) override {
    context->set_output(0, context->input(0));
    if (micros_ == 0) {
      done();
      return;
    }
    Timer::Get().After(std::chrono::microseconds(micros_), std::move(done));
  }

 private:
  int64_t micros_ = 0;
};

}  // namespace

REGISTER_OP("EmulatedDelay")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: type")
    .Attr("micros: int")
    .SetIsStateful()  // never folded, merged or pruned: its time is the point
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape);

REGISTER_KERNEL_BUILDER(Name("EmulatedDelay").Device(tensorflow::DEVICE_CPU), EmulatedDelayOp);
