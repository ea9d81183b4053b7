#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace duet {

/// Accounting of one KV pool: fixed-size blocks, each with exactly one owner or free.
/// Check/act pairs (can_allocate/allocate) so callers decide before they commit.
class block_manager {
 public:
  block_manager(uint32_t total_blocks, uint32_t block_tokens);

  [[nodiscard]] static uint32_t blocks_for(uint32_t tokens, uint32_t block_tokens) {
    return tokens / block_tokens + (tokens % block_tokens != 0);  // no overflow near UINT32_MAX
  }
  [[nodiscard]] uint32_t blocks_for(uint32_t tokens) const { return blocks_for(tokens, block_tokens_); }
  [[nodiscard]] bool can_allocate(uint32_t blocks) const { return blocks <= free_.size(); }
  /// Takes `blocks` free blocks; returns an empty vector when there are not enough.
  [[nodiscard]] std::vector<uint32_t> allocate(uint32_t blocks);
  /// Returns blocks to the pool. A block that is already free or out of range is not
  /// touched and counted in double_frees(): an invariant violation surfaced, not hidden.
  void free(std::span<const uint32_t> blocks);

  [[nodiscard]] uint32_t free_blocks() const { return static_cast<uint32_t>(free_.size()); }
  [[nodiscard]] uint32_t total_blocks() const { return static_cast<uint32_t>(in_use_.size()); }
  [[nodiscard]] uint32_t used_blocks() const { return total_blocks() - free_blocks(); }
  [[nodiscard]] uint32_t block_tokens() const { return block_tokens_; }
  [[nodiscard]] uint64_t double_frees() const { return double_frees_; }

 private:
  uint32_t block_tokens_;
  std::vector<uint32_t> free_;   // stack of free block ids
  std::vector<uint8_t> in_use_;  // per block: 1 while owned
  uint64_t double_frees_ = 0;
};

}  // namespace duet
