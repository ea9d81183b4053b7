#include "runtime/kv_arena.hpp"

#include <atomic>
#include <stdexcept>

namespace duet {

namespace {
std::atomic<uint64_t> next_arena_id{1};
}

kv_arena::kv_arena(std::span<const uint32_t> member_blocks) : id_(next_arena_id++) {
  if (member_blocks.empty()) throw std::invalid_argument("kv_arena: no members");
  uint64_t total = 0;
  for (uint32_t b : member_blocks) total += b;
  if (total > UINT32_MAX - 1) throw std::invalid_argument("kv_arena: more than 2^32 - 1 blocks");
  owner_.resize(total);
  in_use_.assign(total, 0);
  lent_.assign(total, 0);
  uint32_t first = 0;
  for (uint32_t m = 0; m < member_blocks.size(); ++m) {
    member_state s;
    s.blocks = member_blocks[m];
    s.free.reserve(s.blocks);
    // Lowest ids on top of the stack, as a pool of its own has always handed them out.
    for (uint32_t i = s.blocks; i > 0; --i) s.free.push_back(first + i - 1);
    for (uint32_t i = 0; i < s.blocks; ++i) owner_[first + i] = m;
    first += s.blocks;
    members_.push_back(std::move(s));
  }
}

uint32_t kv_arena::free_blocks(uint32_t member) const {
  std::lock_guard lock(mutex_);
  return static_cast<uint32_t>(members_.at(member).free.size());
}

uint32_t kv_arena::member_blocks(uint32_t member) const {
  std::lock_guard lock(mutex_);
  return members_.at(member).blocks;
}

std::vector<uint32_t> kv_arena::allocate(uint32_t member, uint32_t blocks) {
  std::lock_guard lock(mutex_);
  auto& free = members_.at(member).free;
  if (blocks > free.size()) return {};
  std::vector<uint32_t> out(free.end() - blocks, free.end());
  free.resize(free.size() - blocks);
  for (uint32_t id : out) in_use_[id] = 1;
  return out;
}

kv_arena::free_result kv_arena::free(uint32_t member, std::span<const uint32_t> blocks) {
  return release(member, blocks, std::nullopt);
}

kv_arena::free_result kv_arena::free_lent(uint32_t member, std::span<const uint32_t> blocks, uint64_t handle) {
  return release(member, blocks, handle);
}

kv_arena::free_result kv_arena::release(uint32_t member, std::span<const uint32_t> blocks,
                                        std::optional<uint64_t> handle) {
  std::lock_guard lock(mutex_);
  auto& free = members_.at(member).free;
  free_result r;
  for (uint32_t id : blocks) {
    const bool mine = id < owner_.size() && owner_[id] == member && in_use_[id];
    if (id < owner_.size() && handle && (!mine || lent_[id] != *handle)) {
      ++r.moved;  // no longer lent under the handle: an adopter's now, or back here for another use
    } else if (!mine) {
      ++r.invalid;
    } else {
      in_use_[id] = 0;
      lent_[id] = 0;
      free.push_back(id);
    }
  }
  return r;
}

void kv_arena::lend(uint32_t member, std::span<const uint32_t> blocks, uint64_t handle) {
  std::lock_guard lock(mutex_);
  for (uint32_t id : blocks) {
    if (id < owner_.size() && owner_[id] == member && in_use_[id]) lent_[id] = handle;
  }
}

std::string kv_arena::move_lent(uint64_t handle, uint32_t to, std::span<const uint32_t> src,
                                std::span<uint32_t> table) {
  std::lock_guard lock(mutex_);
  if (handle == 0) return "handle 0 is never lent";
  if (to >= members_.size()) return "no such member of the pool";
  if (src.size() > table.size()) return "the handle holds more blocks than were reserved";
  if (src.empty()) return {};
  const uint32_t lender = src[0] < owner_.size() ? owner_[src[0]] : no_owner;
  if (lender == no_owner || lender == to) return "the handle's blocks are not another member's";
  for (uint32_t id : src) {
    if (id >= owner_.size() || owner_[id] != lender || !in_use_[id] || lent_[id] != handle) {
      return "block " + std::to_string(id) + " is no longer lent under this handle";
    }
  }
  for (std::size_t i = 0; i < src.size(); ++i) {
    const uint32_t id = table[i];
    if (id >= owner_.size() || owner_[id] != to || !in_use_[id]) {
      return "block " + std::to_string(id) + " of the adopter's table is not its own";
    }
  }
  auto& lender_free = members_[lender].free;
  for (std::size_t i = 0; i < src.size(); ++i) {
    const uint32_t given = table[i];
    owner_[given] = lender;
    in_use_[given] = 0;
    lent_[given] = 0;
    lender_free.push_back(given);
    owner_[src[i]] = to;
    lent_[src[i]] = 0;
    table[i] = src[i];
  }
  return {};
}

}  // namespace duet
