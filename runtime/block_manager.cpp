#include "runtime/block_manager.hpp"

#include <stdexcept>

namespace duet {

namespace {
std::shared_ptr<kv_arena> own_arena(uint32_t total_blocks) {
  const uint32_t blocks[] = {total_blocks};
  return std::make_shared<kv_arena>(blocks);
}
}  // namespace

block_manager::block_manager(uint32_t total_blocks, uint32_t block_tokens)
    : block_manager(own_arena(total_blocks), 0, block_tokens) {}

block_manager::block_manager(std::shared_ptr<kv_arena> arena, uint32_t member, uint32_t block_tokens)
    : arena_(std::move(arena)), member_(member), block_tokens_(block_tokens) {
  if (block_tokens == 0) throw std::invalid_argument("block_tokens must be positive");
  if (!arena_ || member_ >= arena_->members()) throw std::invalid_argument("block_manager: no such arena member");
  total_ = arena_->member_blocks(member_);
}

void block_manager::free(std::span<const uint32_t> blocks) { double_frees_ += arena_->free(member_, blocks).invalid; }

void block_manager::free_lent(std::span<const uint32_t> blocks, uint64_t handle) {
  const auto r = arena_->free_lent(member_, blocks, handle);
  double_frees_ += r.invalid;
  moved_away_ += r.moved;
}

}  // namespace duet
