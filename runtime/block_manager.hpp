#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "runtime/kv_arena.hpp"

namespace duet {

/// Accounting of one worker's KV blocks, each with exactly one owner or free: a pool of its
/// own, or a member's share of a kv_arena it shares with other workers of its process.
/// Check/act pairs (can_allocate/allocate) so callers decide before they commit.
class block_manager {
 public:
  block_manager(uint32_t total_blocks, uint32_t block_tokens);
  block_manager(std::shared_ptr<kv_arena> arena, uint32_t member, uint32_t block_tokens);
  block_manager(const block_manager&) = delete;  // two copies would hand out the same blocks
  block_manager& operator=(const block_manager&) = delete;

  [[nodiscard]] static uint32_t blocks_for(uint32_t tokens, uint32_t block_tokens) {
    return tokens / block_tokens + (tokens % block_tokens != 0);  // no overflow near UINT32_MAX
  }
  [[nodiscard]] uint32_t blocks_for(uint32_t tokens) const { return blocks_for(tokens, block_tokens_); }
  [[nodiscard]] bool can_allocate(uint32_t blocks) const { return blocks <= free_blocks(); }
  /// Takes `blocks` free blocks; returns an empty vector when there are not enough.
  [[nodiscard]] std::vector<uint32_t> allocate(uint32_t blocks) { return arena_->allocate(member_, blocks); }
  /// Returns blocks to the pool. A block that is already free, not this worker's, or out of
  /// range is not touched and counted in double_frees(): an invariant violation surfaced,
  /// not hidden.
  void free(std::span<const uint32_t> blocks);

  /// Blocks registered with the broker under `handle`: another member may take them.
  void lend(std::span<const uint32_t> blocks, uint64_t handle) { arena_->lend(member_, blocks, handle); }
  /// Frees a lent handle's blocks: those an adopter took over are its now (moved_away()),
  /// even where they have come back to this worker since for another prompt.
  void free_lent(std::span<const uint32_t> blocks, uint64_t handle);
  /// Takes the blocks `src` another member lent under `handle`, giving the first src.size()
  /// blocks of `table` in exchange (kv_arena::move_lent). Empty on success, else why not.
  [[nodiscard]] std::string take_lent(uint64_t handle, std::span<const uint32_t> src, std::span<uint32_t> table) {
    return arena_->move_lent(handle, member_, src, table);
  }

  [[nodiscard]] uint32_t free_blocks() const { return arena_->free_blocks(member_); }
  [[nodiscard]] uint32_t total_blocks() const { return total_; }
  [[nodiscard]] uint32_t used_blocks() const { return total_blocks() - free_blocks(); }
  [[nodiscard]] uint32_t block_tokens() const { return block_tokens_; }
  [[nodiscard]] uint64_t double_frees() const { return double_frees_; }
  [[nodiscard]] uint64_t moved_away() const { return moved_away_; }
  /// The arena's id when it has other members (a shared pool), else 0.
  [[nodiscard]] uint64_t shared_arena() const { return arena_->members() > 1 ? arena_->id() : 0; }

 private:
  std::shared_ptr<kv_arena> arena_;
  uint32_t member_ = 0;
  uint32_t total_ = 0;
  uint32_t block_tokens_;
  uint64_t double_frees_ = 0;
  uint64_t moved_away_ = 0;
};

}  // namespace duet
