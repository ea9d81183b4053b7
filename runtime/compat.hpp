#pragma once
#include <cstdint>

#include "runtime/config.hpp"

namespace duet {

/// What two nodes of one deployment must agree on before they exchange anything:
/// protocol version, served model, checkpoint, dtype and KV block size. Sent in `hello`.
[[nodiscard]] uint64_t compat_hash(const deployment_config& config);

}  // namespace duet
