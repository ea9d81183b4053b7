#pragma once
// safetensors checkpoints (Hugging Face's weight format): a validating reader over a read-only
// mmap of each file, sharded checkpoints through model.safetensors.index.json, conversion of
// BF16/F16/F32 tensors to float, and a streaming writer.
//
// Format (https://github.com/huggingface/safetensors): 8 bytes little-endian header size N,
// N bytes of JSON {"__metadata__": {str: str}, "<name>": {"dtype", "shape", "data_offsets"}},
// then the data section; data_offsets are [begin, end) relative to the data section.
//
// Every error is a std::runtime_error whose message starts with "safetensors: <file>: " and
// names the tensor involved.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/mapped_file.hpp"

namespace duet {

/// Element types of the safetensors format, as the header spells them.
enum class st_dtype : uint8_t { f64, f32, f16, bf16, i64, i32, i16, i8, u8, boolean, f8_e4m3, f8_e5m2, u16, u32, u64 };

/// "F32", "BF16", ... ; the inverse of st_dtype_from_name.
[[nodiscard]] std::string_view st_dtype_name(st_dtype type);
/// Bytes per element.
[[nodiscard]] uint32_t st_dtype_size(st_dtype type);
/// The dtype named `name` ("F32", "BF16", ...); false when the name is not a safetensors dtype.
[[nodiscard]] bool st_dtype_from_name(std::string_view name, st_dtype& out);

// Scalar conversions, exact for every input (subnormals, infinities and NaN included).
[[nodiscard]] float bf16_to_float(uint16_t bits);
[[nodiscard]] float f16_to_float(uint16_t bits);
/// Round to nearest even; NaN stays NaN (quiet).
[[nodiscard]] uint16_t float_to_bf16(float value);
/// Round to nearest even; overflow gives infinity; NaN stays NaN (quiet).
[[nodiscard]] uint16_t float_to_f16(float value);

/// One tensor as a header describes it.
struct st_tensor_info {
  std::string name;
  st_dtype dtype = st_dtype::f32;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // data_offsets[0], relative to the data section
  uint64_t end = 0;    // data_offsets[1]

  [[nodiscard]] uint64_t n_elements() const;
  [[nodiscard]] uint64_t n_bytes() const { return end - begin; }
};

/// "[4096, 128256]".
[[nodiscard]] std::string shape_to_string(std::span<const uint64_t> shape);

/// One open .safetensors file. Construction validates the header against the file: the size
/// field fits the file, the JSON is an object of well-formed entries, every dtype is known,
/// every byte range lies inside the data section, matches its shape, and overlaps no other.
/// Move-only; tensor views stay valid while the object lives.
class safetensors_file {
 public:
  /// Headers above this size are refused (the reference implementation's limit).
  static constexpr uint64_t max_header_bytes = 100u << 20;

  explicit safetensors_file(const std::filesystem::path& path);
  safetensors_file(safetensors_file&& other) noexcept = default;
  safetensors_file& operator=(safetensors_file&& other) noexcept = default;
  safetensors_file(const safetensors_file&) = delete;
  safetensors_file& operator=(const safetensors_file&) = delete;

  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  [[nodiscard]] uint64_t file_size() const { return map_.size(); }
  /// The "__metadata__" string map (empty when absent).
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Every tensor, sorted by name.
  [[nodiscard]] const std::vector<st_tensor_info>& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr.
  [[nodiscard]] const st_tensor_info* find(std::string_view name) const;
  /// The tensor called `name`; throws "safetensors: <file>: missing tensor '<name>'".
  [[nodiscard]] const st_tensor_info& at(std::string_view name) const;
  /// The raw bytes of `info` (one of tensors()).
  [[nodiscard]] std::span<const std::byte> bytes(const st_tensor_info& info) const;

  /// The tensor converted to float (row-major, as stored). BF16, F16 and F32 only; other
  /// dtypes throw naming the tensor and its dtype. `expected_shape`, when not empty, must equal
  /// the tensor's shape ("wrong shape" error otherwise).
  [[nodiscard]] std::vector<float> read_floats(std::string_view name,
                                               std::span<const uint64_t> expected_shape = {}) const;
  /// Same, into `out`, which must hold exactly n_elements() floats.
  void read_floats_into(std::string_view name, std::span<float> out,
                        std::span<const uint64_t> expected_shape = {}) const;

 private:
  void parse();

  std::filesystem::path path_;
  mapped_file map_;
  uint64_t data_offset_ = 0;  // 8 + header size
  std::map<std::string, std::string> metadata_;
  std::vector<st_tensor_info> tensors_;
};

/// A checkpoint: one .safetensors file, a directory holding model.safetensors, or a directory
/// holding model.safetensors.index.json and the shards it names. Tensor names are unique across
/// shards; a name the index maps to a shard that lacks it is an error at open.
class safetensors_checkpoint {
 public:
  explicit safetensors_checkpoint(const std::filesystem::path& path);

  /// The directory or file it was opened from.
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  [[nodiscard]] bool contains(std::string_view name) const;
  /// Every tensor name, sorted.
  [[nodiscard]] std::vector<std::string> names() const;
  /// Throws "safetensors: <checkpoint>: missing tensor '<name>'".
  [[nodiscard]] const st_tensor_info& info(std::string_view name) const;
  /// The file that holds `name` (throws like info()).
  [[nodiscard]] const safetensors_file& file_of(std::string_view name) const;
  [[nodiscard]] std::vector<float> read_floats(std::string_view name,
                                               std::span<const uint64_t> expected_shape = {}) const;
  void read_floats_into(std::string_view name, std::span<float> out,
                        std::span<const uint64_t> expected_shape = {}) const;
  [[nodiscard]] std::size_t shard_count() const { return files_.size(); }

 private:
  std::filesystem::path path_;
  std::vector<std::unique_ptr<safetensors_file>> files_;
  std::map<std::string, std::size_t, std::less<>> where_;  // tensor name -> files_ index
};

/// One tensor to write. `fill` is called with consecutive pieces of the tensor: the first
/// element index of the piece and the bytes to fill (a whole number of elements).
struct st_write_entry {
  std::string name;
  st_dtype dtype = st_dtype::f32;
  std::vector<uint64_t> shape;
  std::function<void(uint64_t first_element, std::span<std::byte> out)> fill;
};

/// The exact header bytes (size field included) write_safetensors writes for `entries`:
/// compact JSON with keys sorted, tensors laid out in name order, padded with spaces to a
/// multiple of 8 bytes.
[[nodiscard]] std::string safetensors_header(std::span<const st_write_entry> entries,
                                             const std::map<std::string, std::string>& metadata);

/// Writes one .safetensors file (to a temporary name, then renamed). Throws on duplicate names
/// and I/O errors, naming the file.
void write_safetensors(const std::filesystem::path& path, std::span<const st_write_entry> entries,
                       const std::map<std::string, std::string>& metadata = {});

/// Writes `entries` into `dir` as model.safetensors when their data fit `max_shard_bytes`,
/// else as model-0000i-of-0000n.safetensors shards (filled in name order, a new shard when the
/// next tensor would overflow the current one) plus model.safetensors.index.json.
/// Returns the files written, in order.
std::vector<std::filesystem::path> write_safetensors_checkpoint(
    const std::filesystem::path& dir, std::span<const st_write_entry> entries, uint64_t max_shard_bytes,
    const std::map<std::string, std::string>& metadata = {});

}  // namespace duet
