#include <cstring>

#include "kernels/embedding.cuh"

namespace duet::kernels {

void embedding_gather_reference(const embedding_params& p) {
  for (uint32_t r = 0; r < p.rows; ++r) {
    uint16_t* dst = p.out + static_cast<uint64_t>(r) * p.hidden;
    const int32_t id = p.ids[r];
    if (id < 0 || static_cast<uint32_t>(id) >= p.vocab) {
      std::memset(dst, 0, p.hidden * sizeof(uint16_t));
    } else {
      std::memcpy(dst, p.table + static_cast<uint64_t>(id) * p.hidden, p.hidden * sizeof(uint16_t));
    }
  }
}

}  // namespace duet::kernels
