#include "runtime/step_thread.hpp"

#include <stdexcept>

namespace duet {

step_thread::step_thread() : thread_([this] { run(); }) {}

step_thread::~step_thread() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void step_thread::launch(std::function<step_output()> step, std::function<void()> done) {
  {
    std::lock_guard lock(mutex_);
    if (pending_)
      throw std::logic_error("step_thread: a step is running or its result was not taken");
    step_ = std::move(step);
    done_ = std::move(done);
    result_.reset();
    error_ = nullptr;
    finished_ = false;
    pending_ = true;
  }
  wake_.notify_all();
}

step_output step_thread::take() {
  std::lock_guard lock(mutex_);
  if (!pending_ || !finished_) throw std::logic_error("step_thread: no finished step to take");
  pending_ = false;
  if (error_) std::rethrow_exception(error_);
  return std::move(*result_);
}

bool step_thread::busy() const {
  std::lock_guard lock(mutex_);
  return pending_;
}

void step_thread::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    // Without a timeout: this thread has nothing to do until launch or the destructor.
    wake_.wait(lock, [&] { return stopping_ || (pending_ && !finished_ && step_); });
    if (pending_ && !finished_ && step_) {
      auto step = std::move(step_);
      step_ = nullptr;
      auto done = std::move(done_);
      done_ = nullptr;
      lock.unlock();
      std::optional<step_output> out;
      std::exception_ptr error;
      try {
        out = step();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      result_ = std::move(out);
      error_ = error;
      finished_ = true;
      lock.unlock();
      if (done) done();
      lock.lock();
      continue;
    }
    if (stopping_) return;
  }
}

}  // namespace duet
