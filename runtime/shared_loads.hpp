#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <system_error>

namespace duet {

/// The key a file or directory is shared by: its canonical path where it resolves, else as given.
inline std::filesystem::path canonical_key(const std::filesystem::path& path) {
  std::error_code ec;
  auto canonical = std::filesystem::weakly_canonical(path, ec);
  return ec ? path : canonical;
}

/// One loaded object per key while anyone holds it: weights that several engines of one process
/// read are loaded once and freed with their last holder. The lock is held while loading, so two
/// callers asking for one key at once load it once.
template <typename T, typename Key = std::filesystem::path>
class shared_loads {
 public:
  /// The live object for `key`, or `load()` (a std::shared_ptr<const T>) kept for later callers.
  template <typename Load>
  std::shared_ptr<const T> get(const Key& key, Load&& load) {
    std::lock_guard lock(mutex_);
    if (auto it = loaded_.find(key); it != loaded_.end()) {
      if (auto alive = it->second.lock()) return alive;
    }
    std::shared_ptr<const T> fresh = load();
    loaded_[key] = fresh;
    return fresh;
  }

 private:
  std::mutex mutex_;
  std::map<Key, std::weak_ptr<const T>> loaded_;
};

}  // namespace duet
