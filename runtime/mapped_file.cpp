#include "runtime/mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

namespace duet {

mapped_file::mapped_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw mapped_file_error(std::string("cannot open: ") + std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw mapped_file_error(std::string("cannot stat: ") + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw mapped_file_error("not a regular file");
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    return;
  }
  void* addr = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (addr == MAP_FAILED) {
    throw mapped_file_error("cannot mmap " + std::to_string(size) + " bytes: " + std::strerror(err));
  }
  base_ = static_cast<const std::byte*>(addr);
  size_ = size;
}

mapped_file::~mapped_file() { unmap(); }

mapped_file::mapped_file(mapped_file&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)), size_(std::exchange(other.size_, 0)) {}

mapped_file& mapped_file::operator=(mapped_file&& other) noexcept {
  if (this != &other) {
    unmap();
    base_ = std::exchange(other.base_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void mapped_file::unmap() noexcept {
  if (base_ != nullptr) ::munmap(const_cast<std::byte*>(base_), static_cast<std::size_t>(size_));
  base_ = nullptr;
  size_ = 0;
}

}  // namespace duet
