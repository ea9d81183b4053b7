#include "runtime/kv_pool_share.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace duet {

const std::string& host_boot_id() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string line;
    std::getline(in, line);
    return line;
  }();
  return id;
}

std::string to_hex(std::span<const std::byte> bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (std::byte b : bytes) {
    out.push_back(digits[std::to_integer<unsigned>(b) >> 4]);
    out.push_back(digits[std::to_integer<unsigned>(b) & 15]);
  }
  return out;
}

bool from_hex(std::string_view hex, std::span<std::byte> out) {
  if (hex.size() != out.size() * 2) return false;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (std::size_t i = 0; i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = std::byte(hi * 16 + lo);
  }
  return true;
}

namespace {

constexpr std::string_view shm_prefix = "duet-kv-";

/// Regions of processes that no longer exist (killed before they could unlink them).
void remove_orphaned_regions() {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(shm_prefix)) continue;
    const std::string rest = name.substr(shm_prefix.size());
    const pid_t pid = static_cast<pid_t>(std::atol(rest.substr(0, rest.find('-')).c_str()));
    if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) ::shm_unlink(("/" + name).c_str());
  }
}

}  // namespace

namespace {
std::atomic<uint64_t> live_region_bytes{0};
}  // namespace

bool shm_region::fits(uint64_t bytes) {
  struct statvfs fs {};
  if (::statvfs("/dev/shm", &fs) != 0) return false;
  const uint64_t available = uint64_t{fs.f_bavail} * fs.f_frsize;
  return bytes + live_region_bytes.load() <= available;
}

shm_region::shm_region(uint64_t bytes) : bytes_(bytes) {
  static std::atomic<uint32_t> counter{0};
  remove_orphaned_regions();
  // The time makes a name unique even when a pid is reused; importers cache mappings by name.
  name_ = "/" + std::string(shm_prefix) + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
          std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
  const int fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error("cannot create shared memory " + name_ + ": " + std::strerror(errno));
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(name_.c_str());
    throw std::runtime_error("cannot size shared memory " + name_ + " to " + std::to_string(bytes) +
                             " bytes: " + std::strerror(err));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::shm_unlink(name_.c_str());
    throw std::runtime_error("cannot map shared memory " + name_ + ": " + std::strerror(err));
  }
  data_ = static_cast<std::byte*>(p);
  live_region_bytes += bytes;
}

shm_region::~shm_region() {
  if (data_) {
    ::munmap(data_, bytes_);
    live_region_bytes -= bytes_;
  }
  ::shm_unlink(name_.c_str());
}

shm_mappings::~shm_mappings() {
  for (auto& [name, m] : maps_) ::munmap(const_cast<std::byte*>(m.data), m.bytes);
}

const std::byte* shm_mappings::map(const std::string& name, uint64_t bytes, std::string& error) {
  std::lock_guard lock(mutex_);
  if (auto it = maps_.find(name); it != maps_.end()) {
    if (it->second.bytes == bytes) return it->second.data;
    error = "shared memory " + name + " was mapped with another size";
    return nullptr;
  }
  if (!name.starts_with("/" + std::string(shm_prefix)) || name.find('/', 1) != std::string::npos) {
    error = "'" + name + "' is not a duet KV pool name";
    return nullptr;
  }
  const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) {
    error = "cannot open shared memory " + name + ": " + std::strerror(errno);
    return nullptr;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < bytes) {
    ::close(fd);
    error = "shared memory " + name + " is smaller than the pool it should hold";
    return nullptr;
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    error = "cannot map shared memory " + name + ": " + std::strerror(errno);
    return nullptr;
  }
  maps_[name] = {static_cast<const std::byte*>(p), bytes};
  return static_cast<const std::byte*>(p);
}

}  // namespace duet
