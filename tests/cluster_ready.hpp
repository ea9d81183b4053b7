#pragma once
// Waiting for a live cluster: its router has seen a ready prefill and a ready decode worker.
#include "runtime/client.hpp"

namespace duet::testing {

using duet::wait_ready;  // runtime/client.hpp

}  // namespace duet::testing
