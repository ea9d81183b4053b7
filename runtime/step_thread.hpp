#pragma once
// One engine step at a time on a thread of its own. A worker whose engine computes on its
// caller's thread (cpu, cuda) would otherwise read no message for the whole step: acks of a
// KV stream begun during prefill, cancels and new prompts all waited behind the GPU.
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "runtime/engine.hpp"

namespace duet {

class step_thread {
 public:
  step_thread();
  /// Waits for a step still running (the engine it uses outlives this), then joins.
  ~step_thread();
  step_thread(const step_thread&) = delete;
  step_thread& operator=(const step_thread&) = delete;

  /// Runs `step` on the thread, then `done` there (after the result is stored). Throws
  /// std::logic_error while a step is running or its result was not taken.
  void launch(std::function<step_output()> step, std::function<void()> done);
  /// The finished step's output; rethrows what the step threw. Throws std::logic_error when
  /// no step finished (it never waits).
  [[nodiscard]] step_output take();
  /// A step is running or its result waits to be taken.
  [[nodiscard]] bool busy() const;

 private:
  void run();

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::function<step_output()> step_;
  std::function<void()> done_;
  std::optional<step_output> result_;
  std::exception_ptr error_;
  bool pending_ = false;   // launched, not yet taken
  bool finished_ = false;  // the step returned or threw
  bool stopping_ = false;
  std::thread thread_;  // last: starts after every member above exists
};

}  // namespace duet
