#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "messages/catalogue.hpp"
#include "runtime/outbox.hpp"

namespace duet {

/// Life of a KV handle in the broker, in order: "has reached state" is a comparison.
enum class handle_state : uint8_t { registered, transferring, confirmed, released, nacked, expired, failed };
[[nodiscard]] std::string_view to_string(handle_state state);

struct broker_settings {
  uint32_t lease_ms = 10000;
  std::string engine_kind = "sim";  // decides the transfer path
  bool direct_paths = true;          // same_pool / host_shm / cuda_ipc when both ends allow; else only the stream
};

/// Owns the life of every KV cache in flight: registration, leases, the transfer decision,
/// and the one release back to the owner (after confirm, nack, drop or lease expiry).
class broker_core {
 public:
  broker_core(std::string self, broker_settings settings);

  void on_register(const std::string& from, const msg::kv_register& m, int64_t now_ms);
  void on_pull(const std::string& from, const msg::kv_pull& m, int64_t now_ms);
  void on_confirm(const std::string& from, const msg::kv_confirm& m);
  void on_nack(const std::string& from, const msg::kv_nack& m);
  void on_drop(const std::string& from, const msg::kv_drop& m);
  void on_renew(const std::string& from, const msg::kv_renew& m, int64_t now_ms);
  /// The reclamation sweep (run on a timer): releases every handle whose lease ran out.
  void reclaim(int64_t now_ms);

  [[nodiscard]] outbox& out() { return out_; }
  [[nodiscard]] std::size_t live_handles() const { return handles_.size(); }
  /// KV bytes of handles whose transfer started and is not confirmed yet.
  [[nodiscard]] uint64_t bytes_in_flight() const;
  [[nodiscard]] const std::map<std::string, uint64_t>& counters() const { return counters_; }

 private:
  struct entry {
    msg::kv_handle handle;
    std::vector<uint32_t> blocks;
    handle_state state = handle_state::registered;
    int64_t lease_expiry_ms = 0;
    std::string adopter;
  };
  void release(uint64_t handle_id, handle_state final_state, const std::string& reason);
  [[nodiscard]] msg::kv_path choose_path(const entry& e, const std::string& adopter, const msg::kv_pull& pull) const;

  broker_settings settings_;
  outbox out_;
  std::unordered_map<uint64_t, entry> handles_;
  std::map<std::string, uint64_t> counters_;
};

}  // namespace duet
