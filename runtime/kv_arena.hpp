#pragma once
// Block accounting of one KV pool that several workers of one process share (a prefill and a
// decode worker on one device): every block belongs to one member, so a handover between
// members moves ownership of blocks instead of copying their bytes (the `same_pool` path,
// docs/pipeline.md). A pool of one worker is an arena with one member.
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace duet {

class kv_arena {
 public:
  /// Member m starts with the next member_blocks[m] block ids, all free.
  explicit kv_arena(std::span<const uint32_t> member_blocks);

  /// Nonzero and unique in this process: two workers share a pool when their ids agree.
  [[nodiscard]] uint64_t id() const { return id_; }
  [[nodiscard]] uint32_t total_blocks() const { return static_cast<uint32_t>(owner_.size()); }
  [[nodiscard]] uint32_t members() const { return static_cast<uint32_t>(members_.size()); }

  [[nodiscard]] uint32_t free_blocks(uint32_t member) const;
  [[nodiscard]] uint32_t member_blocks(uint32_t member) const;  // constant: moves are swaps
  /// `blocks` of the member's free blocks, or none when it has fewer.
  [[nodiscard]] std::vector<uint32_t> allocate(uint32_t member, uint32_t blocks);

  struct free_result {
    uint32_t invalid = 0;  // free already, another member's, or out of range: an invariant violation
    uint32_t moved = 0;    // free_lent: no longer lent under the handle (moved to an adopter)
  };
  free_result free(uint32_t member, std::span<const uint32_t> blocks);
  /// Frees those of `blocks` still lent under `handle` by the member; the others moved to an
  /// adopter (or came back to the member since, for another use) and are not touched.
  free_result free_lent(uint32_t member, std::span<const uint32_t> blocks, uint64_t handle);

  /// Marks the member's blocks as lent under `handle` (registered with the broker): only
  /// those can move, and freeing them ends the loan.
  void lend(uint32_t member, std::span<const uint32_t> blocks, uint64_t handle);
  /// Moves the blocks `src` lent under `handle` to member `to`, in exchange for the first
  /// src.size() blocks of `table` (to's own, in use), which become free blocks of the lender;
  /// `table` then starts with `src`. Nothing changes when any block is not as described (the
  /// lender freed them, say, at its lease's end): the reason is returned, empty on success.
  [[nodiscard]] std::string move_lent(uint64_t handle, uint32_t to, std::span<const uint32_t> src,
                                      std::span<uint32_t> table);

 private:
  static constexpr uint32_t no_owner = UINT32_MAX;
  /// free (no handle) and free_lent (handle): one loop.
  free_result release(uint32_t member, std::span<const uint32_t> blocks, std::optional<uint64_t> handle);
  struct member_state {
    std::vector<uint32_t> free;  // stack of free block ids
    uint32_t blocks = 0;
  };
  mutable std::mutex mutex_;
  uint64_t id_;
  std::vector<member_state> members_;
  std::vector<uint32_t> owner_;   // per block
  std::vector<uint8_t> in_use_;   // per block
  std::vector<uint64_t> lent_;    // per block: the handle it is lent under, 0 none
};

}  // namespace duet
