#include "runtime/broker_core.hpp"

namespace duet {

std::string_view to_string(handle_state state) {
  switch (state) {
    case handle_state::registered: return "registered";
    case handle_state::transferring: return "transferring";
    case handle_state::confirmed: return "confirmed";
    case handle_state::released: return "released";
    case handle_state::nacked: return "nacked";
    case handle_state::expired: return "expired";
    case handle_state::failed: return "failed";
  }
  return "unknown";
}

broker_core::broker_core(std::string self, broker_settings settings)
    : settings_(std::move(settings)), out_(std::move(self)) {}

void broker_core::on_register(const std::string& from, const msg::kv_register& m, int64_t now_ms) {
  const auto id = m.handle.handle_id;
  if (handles_.contains(id)) {
    // A retried registration: answer again, change nothing (idempotent).
    ++counters_["duplicate_registrations"];
    out_.send(from, msg::kv_registered{id, handles_[id].lease_expiry_ms});
    return;
  }
  entry e{m.handle, m.block_ids, handle_state::registered, now_ms + settings_.lease_ms, {}};
  e.handle.owner = from;  // the sender owns the blocks, whatever the body claims
  handles_.emplace(id, std::move(e));
  ++counters_["registered"];
  counters_["bytes_registered"] += m.handle.bytes;
  out_.send(from, msg::kv_registered{id, now_ms + settings_.lease_ms});
}

msg::kv_path broker_core::choose_path(const entry& e, const std::string& adopter, const msg::kv_pull& pull) const {
  if (e.handle.owner == adopter) return msg::kv_path::same_pool;
  if (settings_.engine_kind == "sim") return msg::kv_path::none;
  const auto& pool = e.handle.pool;
  const bool same_host = !pool.host.empty() && pool.host == pull.host;
  if (settings_.direct_paths && same_host && pool.arena != 0 && pool.arena == pull.arena && pool.pid == pull.pid) {
    return msg::kv_path::same_pool;  // both workers' blocks are one pool's: ownership moves
  }
  if (settings_.direct_paths && same_host && pool.path != msg::kv_path::none && pool.path == pull.can_import) {
    return pool.path;  // the adopter maps the owner's pool and copies the blocks itself
  }
  return msg::kv_path::tcp;
}

void broker_core::on_pull(const std::string& from, const msg::kv_pull& m, int64_t now_ms) {
  auto it = handles_.find(m.handle_id);
  msg::kv_moved reply;
  reply.handle_id = m.handle_id;
  if (it == handles_.end()) {
    reply.code = msg::error_code::not_found;
    reply.message = "KV handle " + std::to_string(m.handle_id) + " is unknown or its lease expired";
    ++counters_["pulls_unknown"];
    out_.send(from, reply);
    return;
  }
  entry& e = it->second;
  if (e.state != handle_state::registered) {
    reply.code = msg::error_code::bad_request;
    reply.message = "KV handle " + std::to_string(m.handle_id) + " is already " + std::string(to_string(e.state));
    ++counters_["pulls_refused"];
    out_.send(from, reply);
    return;
  }
  if (m.layout_hash != e.handle.layout_hash || m.block_ids.size() < e.blocks.size()) {
    reply.code = msg::error_code::incompatible;
    reply.message = m.layout_hash != e.handle.layout_hash
                        ? "KV layout differs between prefill and decode (model, dtype or block size)"
                        : "destination has fewer blocks than the handle holds";
    ++counters_["pulls_incompatible"];
    out_.send(from, reply);
    release(m.handle_id, handle_state::failed, "incompatible adopter");
    return;
  }
  e.adopter = from;
  e.state = handle_state::transferring;
  e.lease_expiry_ms = now_ms + settings_.lease_ms;
  out_.send(e.handle.owner, msg::kv_registered{m.handle_id, e.lease_expiry_ms});  // the owner's lease moves too
  reply.path = choose_path(e, from, m);
  ++counters_[std::string("transfers_") + std::string(msg::to_string(reply.path))];
  if (reply.path == msg::kv_path::tcp) {
    // Bytes must move: the owner streams them to the adopter, whose last chunk completes
    // the pull and whose kv_confirm (or kv_nack) ends the handle here.
    counters_["bytes_streamed"] += e.handle.bytes;
    out_.send(e.handle.owner, msg::kv_send{m.handle_id, from});
    return;
  }
  reply.bytes = reply.path == msg::kv_path::none ? 0 : e.handle.bytes;
  if (reply.path == msg::kv_path::host_shm || reply.path == msg::kv_path::cuda_ipc ||
      reply.path == msg::kv_path::same_pool) {
    reply.source = e.handle.pool;
    reply.source_blocks = e.blocks;
  }
  // The sim engine's accounting: in place at once. Same pool: the adopter takes the blocks
  // over. Shared pools: the adopter copies. Either then confirms; the owner's blocks stay
  // lent until then.
  out_.send(from, reply);
}

uint64_t broker_core::bytes_in_flight() const {
  uint64_t total = 0;
  for (const auto& [id, e] : handles_) total += e.state == handle_state::transferring ? e.handle.bytes : 0;
  return total;
}

void broker_core::on_confirm(const std::string& from, const msg::kv_confirm& m) {
  auto it = handles_.find(m.handle_id);
  if (it == handles_.end() || it->second.adopter != from) {
    ++counters_["confirms_ignored"];  // duplicate or stale: idempotent
    return;
  }
  it->second.state = handle_state::confirmed;
  ++counters_["confirmed"];
  release(m.handle_id, handle_state::released, "confirmed");
}

void broker_core::on_nack(const std::string& from, const msg::kv_nack& m) {
  if (!handles_.contains(m.handle_id)) {
    ++counters_["nacks_ignored"];
    return;
  }
  ++counters_["nacked"];
  release(m.handle_id, handle_state::nacked, "nacked by " + from + ": " + m.reason);
}

void broker_core::on_drop(const std::string& from, const msg::kv_drop& m) {
  if (!handles_.contains(m.handle_id)) {
    ++counters_["drops_ignored"];
    return;
  }
  ++counters_["dropped"];
  release(m.handle_id, handle_state::released, "dropped by " + from + ": " + m.reason);
}

void broker_core::on_renew(const std::string& from, const msg::kv_renew& m, int64_t now_ms) {
  auto it = handles_.find(m.handle_id);
  if (it == handles_.end()) return;
  it->second.lease_expiry_ms = now_ms + settings_.lease_ms;
  ++counters_["renewed"];
  // The owner reclaims by itself after the lease it knows of: tell it the new end.
  out_.send(it->second.handle.owner, msg::kv_registered{m.handle_id, it->second.lease_expiry_ms});
}

void broker_core::reclaim(int64_t now_ms) {
  std::vector<uint64_t> expired;
  for (const auto& [id, e] : handles_) {
    if (e.lease_expiry_ms <= now_ms) expired.push_back(id);
  }
  for (uint64_t id : expired) {
    ++counters_["lease_expiries"];
    const auto& e = handles_.at(id);
    if (!e.adopter.empty()) {
      out_.send(e.adopter, msg::kv_moved_failure(id, msg::kv_path::none, msg::error_code::timeout, "KV lease expired"));
    }
    release(id, handle_state::expired, "lease expired");
  }
}

void broker_core::release(uint64_t handle_id, handle_state final_state, const std::string& reason) {
  auto it = handles_.find(handle_id);
  if (it == handles_.end()) return;
  counters_["reclaimed_blocks"] += final_state == handle_state::expired ? it->second.blocks.size() : 0;
  out_.send(it->second.handle.owner, msg::kv_release{handle_id, reason});
  handles_.erase(it);
}

}  // namespace duet
