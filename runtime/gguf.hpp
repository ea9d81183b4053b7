#pragma once
// GGUF model files (llama.cpp's format): a bounds-checked reader over a read-only mmap of the
// file, dequantization of the common ggml tensor types to float, and the two things duet needs
// from a GGUF besides weights: the model hyper-parameters and the tokenizer description.
//
// Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3, little
// endian). Block layouts: ggml/src/ggml-common.h, dequantizers: ggml/src/ggml-quants.c.
// docs/gguf.md has the details, the sources and how the reader is tested.
//
// Every error is a std::runtime_error whose message starts with "gguf: <file>: " and names the
// metadata key or tensor involved.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "runtime/mapped_file.hpp"
#include "runtime/tokenizer_spec.hpp"

namespace duet {

// ---------------------------------------------------------------------------------------------
// Metadata values

/// GGUF metadata value types, with their on-disk ids (gguf.h `enum gguf_type`).
enum class gguf_value_type : uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};

/// "uint8", "string", "array", ... as the GGUF spec spells them.
[[nodiscard]] std::string_view gguf_value_type_name(gguf_value_type type);

struct gguf_value;

/// A typed GGUF array; `type` is the element type, kept even when the array is empty.
/// Elements of an array of arrays are gguf_value holding a gguf_array each.
struct gguf_array {
  gguf_value_type type = gguf_value_type::u8;
  std::vector<gguf_value> items;
};

/// One metadata value. The variant's index is the gguf_value_type id.
struct gguf_value {
  using storage = std::variant<uint8_t, int8_t, uint16_t, int16_t, uint32_t, int32_t, float, bool,
                               std::string, gguf_array, uint64_t, int64_t, double>;
  storage data;

  [[nodiscard]] gguf_value_type type() const { return static_cast<gguf_value_type>(data.index()); }
  [[nodiscard]] bool is_integer() const;  // u8 .. i64, not bool
  [[nodiscard]] bool is_float() const;    // f32 or f64

  // Typed reads. They convert between integer widths and from integers and floats to double,
  // and throw std::runtime_error("<what>: ...") when the type does not fit or the value does
  // not fit the result (a negative value read as unsigned, say).
  [[nodiscard]] uint64_t as_u64(std::string_view what = "value") const;
  [[nodiscard]] int64_t as_i64(std::string_view what = "value") const;
  [[nodiscard]] double as_f64(std::string_view what = "value") const;
  [[nodiscard]] bool as_bool(std::string_view what = "value") const;
  [[nodiscard]] const std::string& as_string(std::string_view what = "value") const;
  [[nodiscard]] const gguf_array& as_array(std::string_view what = "value") const;

  /// Short human-readable form: numbers, quoted strings, arrays as "[a, b, ... (n items)]"
  /// showing at most `max_items` elements.
  [[nodiscard]] std::string to_string(std::size_t max_items = 8) const;
};

/// One metadata entry, in file order.
struct gguf_kv {
  std::string key;
  gguf_value value;
};

// ---------------------------------------------------------------------------------------------
// Tensor types

/// ggml tensor types with their on-disk ids (ggml.h `enum ggml_type`). Ids 4, 5, 31-33 and
/// 36-38 were removed from ggml and are rejected like any unknown id.
enum class ggml_type : uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  q8_k = 15,
  iq2_xxs = 16,
  iq2_xs = 17,
  iq3_xxs = 18,
  iq1_s = 19,
  iq4_nl = 20,
  iq3_s = 21,
  iq2_s = 22,
  iq4_xs = 23,
  i8 = 24,
  i16 = 25,
  i32 = 26,
  i64 = 27,
  f64 = 28,
  iq1_m = 29,
  bf16 = 30,
  tq1_0 = 34,
  tq2_0 = 35,
  mxfp4 = 39,
};

/// Storage facts of one ggml type: `block_size` elements take `type_size` bytes.
struct ggml_type_traits {
  ggml_type type;
  std::string_view name;  // "F32", "Q4_K", ... (upper case, as llama.cpp prints them)
  uint32_t block_size;    // elements per block
  uint32_t type_size;     // bytes per block
  bool dequantizable;     // duet::dequantize supports it
};

/// Traits of a raw on-disk type id; nullptr when the id is not a ggml type.
[[nodiscard]] const ggml_type_traits* ggml_type_find(uint32_t raw_id);
/// Traits of a known type (every ggml_type enumerator has them).
[[nodiscard]] const ggml_type_traits& ggml_type_get(ggml_type type);
[[nodiscard]] std::string_view ggml_type_name(ggml_type type);
/// Bytes taken by `n_elements` values of `type`; throws when n_elements is not a whole number
/// of blocks or the size overflows.
[[nodiscard]] uint64_t ggml_type_bytes(ggml_type type, uint64_t n_elements);

/// IEEE half and bfloat16 to float, exact for every input (subnormals, inf and NaN included).
[[nodiscard]] float ggml_fp16_to_fp32(uint16_t h);
[[nodiscard]] float ggml_bf16_to_fp32(uint16_t h);

// ---------------------------------------------------------------------------------------------
// Tensors and the file

/// A tensor as the file describes it.
struct gguf_tensor_info {
  std::string name;
  std::vector<uint64_t> shape;  // ggml order: shape[0] is the row length (contiguous); 0..4 dims
  ggml_type type = ggml_type::f32;
  uint64_t offset = 0;  // from the start of the data section
  uint64_t n_elements = 0;
  uint64_t n_bytes = 0;

  /// Elements per row: shape[0] (1 for a zero-dimensional tensor).
  [[nodiscard]] uint64_t row_length() const { return shape.empty() ? 1 : shape[0]; }
  /// Rows: the product of shape[1..]; 0 when the tensor is empty.
  [[nodiscard]] uint64_t n_rows() const;
  /// Bytes per row.
  [[nodiscard]] uint64_t row_bytes() const;
};

/// A view of one tensor's bytes inside a mapped gguf_file; valid while the file object lives.
struct gguf_tensor {
  const gguf_tensor_info* info = nullptr;
  std::span<const std::byte> data;  // exactly info->n_bytes bytes
  std::filesystem::path file;       // for error messages
};

/// An open GGUF file: parsed header, metadata and tensor infos over a read-only mmap of the
/// whole file. Construction validates everything that can be validated without decoding the
/// tensor data (see docs/gguf.md); a malformed file throws std::runtime_error naming the file
/// and the offending key or tensor. Move-only.
class gguf_file {
 public:
  static constexpr uint32_t default_alignment = 32;

  explicit gguf_file(const std::filesystem::path& path);
  gguf_file(gguf_file&& other) noexcept = default;
  gguf_file& operator=(gguf_file&& other) noexcept = default;
  gguf_file(const gguf_file&) = delete;
  gguf_file& operator=(const gguf_file&) = delete;

  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  [[nodiscard]] uint32_t version() const { return version_; }
  [[nodiscard]] uint64_t file_size() const { return map_.size(); }
  /// `general.alignment`, or 32 when absent.
  [[nodiscard]] uint64_t alignment() const { return alignment_; }
  /// File offset of the data section (the end of the tensor infos, rounded up to alignment).
  [[nodiscard]] uint64_t data_offset() const { return data_offset_; }

  /// Every metadata entry, in file order.
  [[nodiscard]] const std::vector<gguf_kv>& metadata() const { return kv_; }
  /// The value of `key`, or nullptr.
  [[nodiscard]] const gguf_value* find(std::string_view key) const;
  /// The value of `key`; throws "gguf: <file>: missing metadata key '<key>'".
  [[nodiscard]] const gguf_value& at(std::string_view key) const;

  // Typed reads of one key, with the conversions of gguf_value::as_*; errors name file and key.
  // get_* throw when the key is missing, find_* return nullopt / nullptr.
  [[nodiscard]] uint64_t get_u64(std::string_view key) const;
  [[nodiscard]] int64_t get_i64(std::string_view key) const;
  [[nodiscard]] double get_f64(std::string_view key) const;
  [[nodiscard]] bool get_bool(std::string_view key) const;
  [[nodiscard]] const std::string& get_string(std::string_view key) const;
  [[nodiscard]] const gguf_array& get_array(std::string_view key) const;
  [[nodiscard]] std::optional<uint64_t> find_u64(std::string_view key) const;
  [[nodiscard]] std::optional<int64_t> find_i64(std::string_view key) const;
  [[nodiscard]] std::optional<double> find_f64(std::string_view key) const;
  [[nodiscard]] std::optional<bool> find_bool(std::string_view key) const;
  [[nodiscard]] const std::string* find_string(std::string_view key) const;
  [[nodiscard]] const gguf_array* find_array(std::string_view key) const;

  /// Every tensor, in file order.
  [[nodiscard]] const std::vector<gguf_tensor_info>& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr.
  [[nodiscard]] const gguf_tensor_info* find_tensor(std::string_view name) const;
  /// A view of the tensor called `name`; throws "gguf: <file>: no tensor '<name>'".
  [[nodiscard]] gguf_tensor tensor(std::string_view name) const;
  /// A view of `info`, which must be one of tensors().
  [[nodiscard]] gguf_tensor tensor(const gguf_tensor_info& info) const;

  /// The whole mapped file.
  [[nodiscard]] std::span<const std::byte> bytes() const { return map_.bytes(); }

 private:
  void parse();

  std::filesystem::path path_;
  mapped_file map_;
  uint32_t version_ = 0;
  uint64_t alignment_ = default_alignment;
  uint64_t data_offset_ = 0;
  std::vector<gguf_kv> kv_;
  std::map<std::string, std::size_t, std::less<>> kv_index_;
  std::vector<gguf_tensor_info> tensors_;
  std::map<std::string, std::size_t, std::less<>> tensor_index_;
};

// ---------------------------------------------------------------------------------------------
// Dequantization (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)

/// Decodes `dst.size()` values of `type` from `src`, which must hold exactly
/// ggml_type_bytes(type, dst.size()) bytes, with ggml's reference arithmetic (results are
/// bit-identical to ggml's dequantize_row_* built without floating-point contraction).
/// Throws for a type outside the list above, naming it, and for mismatched sizes.
void dequantize_into(ggml_type type, std::span<const std::byte> src, std::span<float> dst);

/// The whole tensor as floats, in ggml element order (row-major, shape[0] fastest).
[[nodiscard]] std::vector<float> dequantize(const gguf_tensor& tensor);
/// Rows [first_row, first_row + n_rows) of the tensor viewed as n_rows() rows of row_length().
[[nodiscard]] std::vector<float> dequantize_rows(const gguf_tensor& tensor, uint64_t first_row,
                                                 uint64_t n_rows);
/// One row into `out`, which must hold exactly row_length() floats.
void dequantize_row(const gguf_tensor& tensor, uint64_t row, std::span<float> out);

// ---------------------------------------------------------------------------------------------
// Model hyper-parameters and tokenizer

/// Rope scaling declared in `<arch>.rope.scaling.*` (or the legacy `<arch>.rope.scale_linear`).
struct gguf_rope_scaling {
  std::string type;  // "linear", "yarn", "longrope", ...
  float factor = 1.0f;
  std::optional<uint64_t> original_context_length;
  std::optional<float> attn_factor;
  bool finetuned = false;
};

/// The transformer shape of a llama- or qwen2-architecture GGUF.
struct gguf_model_config {
  std::string arch;                // general.architecture: "llama" or "qwen2"
  std::string name;                // general.name, "" when absent
  uint32_t n_layers = 0;           // <arch>.block_count
  uint32_t hidden = 0;             // <arch>.embedding_length
  uint32_t n_heads = 0;            // <arch>.attention.head_count
  uint32_t n_kv_heads = 0;         // <arch>.attention.head_count_kv (default: n_heads)
  uint32_t head_dim = 0;           // <arch>.attention.key_length (default: hidden / n_heads)
  uint32_t ffn = 0;                // <arch>.feed_forward_length
  uint32_t vocab = 0;              // <arch>.vocab_size, else the token count, else token_embd rows
  uint32_t rope_dim = 0;           // <arch>.rope.dimension_count (default: head_dim)
  float rope_theta = 10000.0f;     // <arch>.rope.freq_base (default as llama.cpp: 10000)
  float rms_eps = 0.0f;            // <arch>.attention.layer_norm_rms_epsilon
  uint64_t context_length = 0;     // <arch>.context_length
  bool tied_embeddings = false;    // no output.weight tensor: the output reuses token_embd.weight
  bool attn_qkv_bias = false;      // blk.0.attn_q.bias present (qwen2)
  bool rope_freq_factors = false;  // rope_freqs.weight present (how GGUF stores llama3 scaling)
  std::optional<gguf_rope_scaling> rope_scaling;
  ggml_type token_embd_type = ggml_type::f32;
};

/// Reads the hyper-parameters and checks them against each other and the tensor shapes.
/// Refuses an architecture other than llama and qwen2, naming it.
[[nodiscard]] gguf_model_config gguf_read_model_config(const gguf_file& file);

/// The byte-level BPE tokenizer in `tokenizer.ggml.*` (tokenizer.ggml.model "gpt2"): vocab from
/// tokens, merges split at the first space, added tokens from token_type (3 control = special,
/// 4 user-defined = not special), bos/eos ids, add_bos_token (llama.cpp's default per
/// pre-tokenizer when absent), tokenizer.ggml.pre ("default" when absent) and
/// tokenizer.chat_template. Refuses other tokenizer models (SentencePiece "llama", ...), naming
/// them.
[[nodiscard]] tokenizer_spec gguf_read_tokenizer(const gguf_file& file);

}  // namespace duet
