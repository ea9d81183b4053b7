#pragma once
// Pools other processes on the same host can read: the host's identity, the hex form of
// binary handles in messages, and POSIX shared-memory KV pools for the CPU engine.
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace duet {

/// This boot of this host (/proc/sys/kernel/random/boot_id): two processes can share memory
/// only when they agree on it. Empty when unknown (then nothing is shared).
[[nodiscard]] const std::string& host_boot_id();

[[nodiscard]] std::string to_hex(std::span<const std::byte> bytes);
/// False when `hex` is not an even-length string of hex digits of `out.size()` bytes.
[[nodiscard]] bool from_hex(std::string_view hex, std::span<std::byte> out);

/// A zero-filled POSIX shared-memory region this process owns: /dev/shm/duet-kv-<pid>-<n>.
/// The name is unlinked when the region is destroyed; regions left by processes that died
/// are removed when the next one is created.
class shm_region {
 public:
  explicit shm_region(uint64_t bytes);
  /// Whether /dev/shm has room for `bytes` more beside every region this process holds. A
  /// tmpfs too small for a pool (Docker's default /dev/shm is 64 MiB) would kill the process
  /// with SIGBUS when a page is first touched, so callers keep such a pool private instead.
  [[nodiscard]] static bool fits(uint64_t bytes);
  ~shm_region();
  shm_region(const shm_region&) = delete;
  shm_region& operator=(const shm_region&) = delete;

  [[nodiscard]] std::byte* data() const { return data_; }
  [[nodiscard]] uint64_t size() const { return bytes_; }
  [[nodiscard]] const std::string& name() const { return name_; }

 private:
  std::string name_;
  std::byte* data_ = nullptr;
  uint64_t bytes_ = 0;
};

/// Read-only mappings of other processes' regions, opened once per name and kept.
class shm_mappings {
 public:
  ~shm_mappings();
  /// The region `name` of `bytes` bytes, or nullptr (with `error` set) when it cannot be mapped.
  [[nodiscard]] const std::byte* map(const std::string& name, uint64_t bytes, std::string& error);

 private:
  struct mapping {
    const std::byte* data = nullptr;
    uint64_t bytes = 0;
  };
  std::mutex mutex_;
  std::map<std::string, mapping> maps_;
};

}  // namespace duet
