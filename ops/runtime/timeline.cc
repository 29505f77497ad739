// The timeline's queue, writer thread and trace-event file (see timeline.h).
#include "runtime/timeline.h"

#include <chrono>
#include <utility>

namespace perseus {
namespace {

// How long events wait in the queue at most before the writer appends them to the file; a
// killed rank's file lacks at most this much of its end.
constexpr auto kFlushInterval = std::chrono::milliseconds(200);

// What ends the file after every batch; the next batch is written over it.
constexpr char kTrailer[] = "\n]\n";
constexpr long kTrailerBytes = sizeof(kTrailer) - 1;

void AppendJsonString(const std::string& s, std::string* out) {
  static const char kHex[] = "0123456789abcdef";
  out->push_back('"');
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(c));
    } else if (c < 0x20) {
      *out += "\\u00";
      out->push_back(kHex[c >> 4]);
      out->push_back(kHex[c & 15]);
    } else {
      out->push_back(static_cast<char>(c));
    }
  }
  out->push_back('"');
}

}  // namespace

int64_t Timeline::NowMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string Timeline::RankedPath(const std::string& path, int rank) {
  const size_t slash = path.find_last_of('/');
  const size_t dot = path.find_last_of('.');
  const std::string tag = ".rank" + std::to_string(rank);
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash) ||
      dot == (slash == std::string::npos ? 0 : slash + 1)) {
    return path + tag;  // no extension (a leading dot names a hidden file, not an extension)
  }
  return path.substr(0, dot) + tag + path.substr(dot);
}

void Timeline::SetIdentity(int rank, const std::string& transport) {
  std::lock_guard<std::mutex> control(control_mu_);
  rank_ = rank;
  transport_ = transport;
}

Status Timeline::Start(const std::string& path) {
  std::lock_guard<std::mutex> control(control_mu_);
  if (writer_.joinable()) {
    return Status::Error("perseus_legacy: a timeline is already being written; call "
                         "stop_timeline() before starting another (asked for \"" + path + "\")");
  }
  file_ = std::fopen(path.c_str(), "w");
  if (file_ == nullptr) {
    return Status::Error("perseus_legacy: cannot open the timeline file \"" + path +
                         "\" for writing on rank " + std::to_string(rank_));
  }
  const std::string pid = std::to_string(rank_);
  std::string header = "[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + pid +
                       ",\"args\":{\"name\":\"rank " + pid + "\"}},\n" +
                       "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" + pid +
                       ",\"args\":{\"sort_index\":" + pid + "}}" + kTrailer;
  std::fwrite(header.data(), 1, header.size(), file_);
  std::fflush(file_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.clear();
    stopping_ = false;
    accepting_ = true;
  }
  writer_ = std::thread(&Timeline::WriterLoop, this);
  enabled_.store(true, std::memory_order_relaxed);
  return Status::OK();
}

void Timeline::Stop() {
  std::lock_guard<std::mutex> control(control_mu_);
  if (!writer_.joinable()) return;
  enabled_.store(false, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    accepting_ = false;
  }
  cv_.notify_one();
  writer_.join();
  std::fclose(file_);
  file_ = nullptr;
  rows_.clear();
}

void Timeline::Record(const std::string& tensor, const char* phase, int64_t start_us,
                      int64_t end_us, std::string args, bool transport) {
  Event event{tensor, phase, transport, start_us, end_us - start_us, std::move(args)};
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) return;
    if (queue_.size() >= kCapacity) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    queue_.push_back(std::move(event));
    wake = queue_.size() == kCapacity / 2;
  }
  if (wake) cv_.notify_one();
}

void Timeline::WriterLoop() {
  std::vector<Event> batch;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait_for(lock, kFlushInterval,
                 [this] { return stopping_ || queue_.size() >= kCapacity / 2; });
    batch.clear();
    std::swap(batch, queue_);  // the runtime's next events reuse the last batch's memory
    const bool stop = stopping_;
    lock.unlock();
    if (!batch.empty()) Write(batch);
    lock.lock();
    if (stop && queue_.empty()) return;
  }
}

int Timeline::Row(const std::string& tensor, std::string* text) {
  auto [it, added] = rows_.emplace(tensor, static_cast<int>(rows_.size()) + 1);
  if (added) {
    // The row's name, shown in place of its number.
    *text += ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + std::to_string(rank_) +
             ",\"tid\":" + std::to_string(it->second) + ",\"args\":{\"name\":";
    AppendJsonString(tensor, text);
    *text += "}}";
  }
  return it->second;
}

void Timeline::Write(const std::vector<Event>& batch) {
  std::string text;
  const std::string pid = std::to_string(rank_);
  for (const Event& e : batch) {
    const int tid = Row(e.tensor, &text);
    text += ",\n{\"name\":\"";
    if (e.transport) text += transport_ + "_";
    text += e.phase;
    text += "\",\"ph\":\"X\",\"pid\":" + pid + ",\"tid\":" + std::to_string(tid) +
            ",\"ts\":" + std::to_string(e.start_us) + ",\"dur\":" + std::to_string(e.dur_us) +
            ",\"args\":{" + e.args + "}}";
  }
  text += kTrailer;
  // Over the previous trailer: the file ends with a complete JSON array after each batch.
  std::fseek(file_, -kTrailerBytes, SEEK_END);
  std::fwrite(text.data(), 1, text.size(), file_);
  std::fflush(file_);
}

}  // namespace perseus
