#include "runtime/compat.hpp"

#include <string>

#include "messages/protocol.hpp"

namespace duet {

uint64_t compat_hash(const deployment_config& config) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  auto mix = [&h](const std::string& bytes) {
    for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
  };
  mix(std::to_string(msg::protocol_version));
  mix(config.model.name);
  mix(config.model.preset);
  mix(config.model.path);
  mix(config.model.dtype);
  mix(std::to_string(config.model.block_tokens));
  mix(config.engine.kind);
  return h;
}

}  // namespace duet
