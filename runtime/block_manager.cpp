#include "runtime/block_manager.hpp"

#include <stdexcept>

namespace duet {

block_manager::block_manager(uint32_t total_blocks, uint32_t block_tokens)
    : block_tokens_(block_tokens), in_use_(total_blocks, 0) {
  if (block_tokens == 0) throw std::invalid_argument("block_tokens must be positive");
  free_.reserve(total_blocks);
  for (uint32_t id = total_blocks; id > 0; --id) free_.push_back(id - 1);
}

std::vector<uint32_t> block_manager::allocate(uint32_t blocks) {
  if (!can_allocate(blocks)) return {};
  std::vector<uint32_t> out(free_.end() - blocks, free_.end());
  free_.resize(free_.size() - blocks);
  for (uint32_t id : out) in_use_[id] = 1;
  return out;
}

void block_manager::free(std::span<const uint32_t> blocks) {
  for (uint32_t id : blocks) {
    if (id >= in_use_.size() || !in_use_[id]) {
      ++double_frees_;
      continue;
    }
    in_use_[id] = 0;
    free_.push_back(id);
  }
}

}  // namespace duet
