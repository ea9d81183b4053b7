#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <stdexcept>

namespace duet {

/// Why a file could not be mapped: "cannot open: <errno text>", "cannot stat: ...", "not a
/// regular file", "cannot mmap <n> bytes: ...". Carries no path; the reader that asked names
/// its format and the file.
struct mapped_file_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A whole regular file mapped read-only and private (nothing mapped for an empty file). The
/// descriptor is closed at once: the mapping keeps the file. Move-only; views into bytes() stay
/// valid while the object lives.
class mapped_file {
 public:
  mapped_file() = default;
  explicit mapped_file(const std::filesystem::path& path);
  ~mapped_file();
  mapped_file(mapped_file&& other) noexcept;
  mapped_file& operator=(mapped_file&& other) noexcept;
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;

  [[nodiscard]] const std::byte* data() const { return base_; }
  [[nodiscard]] uint64_t size() const { return size_; }
  [[nodiscard]] std::span<const std::byte> bytes() const {
    return {base_, static_cast<std::size_t>(size_)};
  }

 private:
  void unmap() noexcept;

  const std::byte* base_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace duet
