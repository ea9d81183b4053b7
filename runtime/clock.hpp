#pragma once
#include <chrono>
#include <cstdint>

namespace duet {

using steady = std::chrono::steady_clock;

/// Wall-clock milliseconds since the Unix epoch: deadlines travel between processes in this.
[[nodiscard]] inline int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace duet
