// runtime/step_thread under ThreadSanitizer (tests/step_thread_tsan.cmake): steps launched,
// awaited through their done callback and taken, results written on the step thread and read
// on the caller's, and threads destroyed in the middle of a step. Any data race is a TSan
// report, which fails the test (exit code 66); a lost or wrong result fails it too.
#include <cstdio>
#include <semaphore>

#include "runtime/step_thread.hpp"

int main() {
  long expected = 0, got = 0;
  for (int round = 0; round < 100; ++round) {
    duet::step_thread steps;
    std::binary_semaphore done{0};
    int written_on_step_thread = 0;  // plain int: ordered only by launch, done and take
    for (int i = 0; i < 20; ++i) {
      steps.launch(
          [&, i] {
            written_on_step_thread = i;
            duet::step_output out;
            out.tokens = {i};
            return out;
          },
          [&] { done.release(); });
      done.acquire();
      got += steps.take().tokens.at(0) + written_on_step_thread;
      expected += 2 * i;
    }
    if (round % 2 == 1) steps.launch([] { return duet::step_output{}; }, [&] { done.release(); });
  }
  if (got != expected) {
    std::fprintf(stderr, "step_thread: results %ld, expected %ld\n", got, expected);
    return 1;
  }
  std::printf("step_thread: 2000 steps, results as expected\n");
  return 0;
}
