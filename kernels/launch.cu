#include <cstdlib>
#include <cstring>

#include "kernels/launch.cuh"

namespace duet::kernels {

bool pdl_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("DUET_CUDA_PDL");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return enabled;
}

}  // namespace duet::kernels
