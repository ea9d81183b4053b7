// GGUF reader, dequantization, hyper-parameters and tokenizer extraction. See gguf.hpp and
// docs/gguf.md. The dequantizers follow ggml's reference order of operations; in every supported
// type each product is exact in float, so results are bit-identical to ggml's whatever the
// evaluation order. Built with -ffp-contract=off (runtime/gguf.cmake) all the same.
#include "runtime/gguf.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace duet {
namespace {

[[noreturn]] void fail(const std::filesystem::path& file, const std::string& message) {
  throw std::runtime_error("gguf: " + file.string() + ": " + message);
}

std::string in_quotes(std::string_view s) {
  std::string out = "'";
  out.append(s);
  out += '\'';
  return out;
}

template <class T>
T load_le(const std::byte* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  if constexpr (std::endian::native == std::endian::big && sizeof(T) > 1) {
    auto* b = reinterpret_cast<unsigned char*>(&value);
    std::reverse(b, b + sizeof(T));
  }
  return value;
}

uint16_t load_u16(const std::byte* p) {
  return load_le<uint16_t>(p);
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t& out) {
  return __builtin_mul_overflow(a, b, &out);
}
bool add_overflows(uint64_t a, uint64_t b, uint64_t& out) {
  return __builtin_add_overflow(a, b, &out);
}

// ---- type table -----------------------------------------------------------------------------

// Block sizes and bytes per block from ggml/src/ggml.c `type_traits` and the static_asserts of
// ggml/src/ggml-common.h.
constexpr std::array<ggml_type_traits, 32> type_table{{
    {ggml_type::f32, "F32", 1, 4, true},
    {ggml_type::f16, "F16", 1, 2, true},
    {ggml_type::q4_0, "Q4_0", 32, 18, true},
    {ggml_type::q4_1, "Q4_1", 32, 20, true},
    {ggml_type::q5_0, "Q5_0", 32, 22, false},
    {ggml_type::q5_1, "Q5_1", 32, 24, false},
    {ggml_type::q8_0, "Q8_0", 32, 34, true},
    {ggml_type::q8_1, "Q8_1", 32, 36, false},
    {ggml_type::q2_k, "Q2_K", 256, 84, false},
    {ggml_type::q3_k, "Q3_K", 256, 110, false},
    {ggml_type::q4_k, "Q4_K", 256, 144, true},
    {ggml_type::q5_k, "Q5_K", 256, 176, false},
    {ggml_type::q6_k, "Q6_K", 256, 210, true},
    {ggml_type::q8_k, "Q8_K", 256, 292, false},
    {ggml_type::iq2_xxs, "IQ2_XXS", 256, 66, false},
    {ggml_type::iq2_xs, "IQ2_XS", 256, 74, false},
    {ggml_type::iq3_xxs, "IQ3_XXS", 256, 98, false},
    {ggml_type::iq1_s, "IQ1_S", 256, 50, false},
    {ggml_type::iq4_nl, "IQ4_NL", 32, 18, false},
    {ggml_type::iq3_s, "IQ3_S", 256, 110, false},
    {ggml_type::iq2_s, "IQ2_S", 256, 82, false},
    {ggml_type::iq4_xs, "IQ4_XS", 256, 136, false},
    {ggml_type::i8, "I8", 1, 1, false},
    {ggml_type::i16, "I16", 1, 2, false},
    {ggml_type::i32, "I32", 1, 4, false},
    {ggml_type::i64, "I64", 1, 8, false},
    {ggml_type::f64, "F64", 1, 8, false},
    {ggml_type::iq1_m, "IQ1_M", 256, 56, false},
    {ggml_type::bf16, "BF16", 1, 2, true},
    {ggml_type::tq1_0, "TQ1_0", 256, 54, false},
    {ggml_type::tq2_0, "TQ2_0", 256, 66, false},
    {ggml_type::mxfp4, "MXFP4", 32, 17, false},
}};

constexpr std::string_view supported_types = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K";

// ---- dequantizers: one block of `block_size` values each, transcribed from ggml-quants.c ------

constexpr int qk_k = 256;

// ggml-common.h: block_q8_0 { ggml_half d; int8_t qs[32]; }            34 bytes
void dequant_block_q8_0(const std::byte* b, float* y) {
  const float d = ggml_fp16_to_fp32(load_u16(b));
  const auto* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

// block_q4_0 { ggml_half d; uint8_t qs[16]; }                           18 bytes
// element j: low nibble of qs[j]; element j + 16: high nibble; value (nibble - 8) * d
void dequant_block_q4_0(const std::byte* b, float* y) {
  const float d = ggml_fp16_to_fp32(load_u16(b));
  const auto* qs = reinterpret_cast<const uint8_t*>(b + 2);
  for (int j = 0; j < 16; ++j) {
    const int x0 = (qs[j] & 0x0F) - 8;
    const int x1 = (qs[j] >> 4) - 8;
    y[j] = static_cast<float>(x0) * d;
    y[j + 16] = static_cast<float>(x1) * d;
  }
}

// block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }              20 bytes
// value nibble * d + m, nibbles ordered as in q4_0
void dequant_block_q4_1(const std::byte* b, float* y) {
  const float d = ggml_fp16_to_fp32(load_u16(b));
  const float m = ggml_fp16_to_fp32(load_u16(b + 2));
  const auto* qs = reinterpret_cast<const uint8_t*>(b + 4);
  for (int j = 0; j < 16; ++j) {
    const int x0 = qs[j] & 0x0F;
    const int x1 = qs[j] >> 4;
    y[j] = static_cast<float>(x0) * d + m;
    y[j + 16] = static_cast<float>(x1) * d + m;
  }
}

// ggml-quants.c get_scale_min_k4: 8 pairs of 6-bit (scale, min) packed in 12 bytes.
inline void get_scale_min_k4(int j, const uint8_t* q, uint8_t& d, uint8_t& m) {
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
  }
}

// block_q4_K { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qs[128]; }  144 bytes
// 8 sub-blocks of 32; each 64-value chunk j uses qs[32*j/64 ...]: low nibbles for the first 32
// values (scale pair 2j/64), high nibbles for the next 32 (pair 2j/64 + 1).
// value (d * sc) * nibble - (dmin * m)
void dequant_block_q4_k(const std::byte* b, float* y) {
  const float d = ggml_fp16_to_fp32(load_u16(b));
  const float min = ggml_fp16_to_fp32(load_u16(b + 2));
  const auto* scales = reinterpret_cast<const uint8_t*>(b + 4);
  const auto* q = reinterpret_cast<const uint8_t*>(b + 16);
  int is = 0;
  uint8_t sc = 0;
  uint8_t m = 0;
  for (int j = 0; j < qk_k; j += 64) {
    get_scale_min_k4(is + 0, scales, sc, m);
    const float d1 = d * static_cast<float>(sc);
    const float m1 = min * static_cast<float>(m);
    get_scale_min_k4(is + 1, scales, sc, m);
    const float d2 = d * static_cast<float>(sc);
    const float m2 = min * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

// block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d; }   210 bytes
// 16 sub-blocks of 16 with 8-bit signed scales; 6-bit quants = 4 low bits (ql) | 2 high (qh).
// value (d * scale) * (q - 32)
void dequant_block_q6_k(const std::byte* b, float* y) {
  const auto* ql = reinterpret_cast<const uint8_t*>(b);
  const auto* qh = reinterpret_cast<const uint8_t*>(b + 128);
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = ggml_fp16_to_fp32(load_u16(b + 208));
  for (int n = 0; n < qk_k; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = static_cast<int8_t>((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = static_cast<int8_t>((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l + 0] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// ---- the mapped-file cursor -----------------------------------------------------------------

constexpr int max_array_depth = 16;

class cursor {
 public:
  cursor(const std::filesystem::path& file, const std::byte* base, uint64_t size)
      : file_(file), base_(base), size_(size) {}

  [[nodiscard]] uint64_t pos() const { return pos_; }
  [[nodiscard]] uint64_t remaining() const { return size_ - pos_; }

  // Throws naming `what` unless n more bytes are there.
  void need(uint64_t n, const std::string& what) const {
    if (n > remaining()) {
      fail(file_, what + ": truncated file: needs " + std::to_string(n) + " bytes at offset " +
                      std::to_string(pos_) + ", file has " + std::to_string(size_) + " bytes");
    }
  }

  template <class T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v = load_le<T>(base_ + pos_);
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(const std::string& what) {
    const auto n = read<uint64_t>(what + " (string length)");
    if (n > remaining()) {
      fail(file_, what + ": string length " + std::to_string(n) + " at offset " +
                      std::to_string(pos_ - 8) + " runs past the end of the file (" +
                      std::to_string(size_) + " bytes)");
    }
    std::string s(reinterpret_cast<const char*>(base_ + pos_), static_cast<std::size_t>(n));
    pos_ += n;
    return s;
  }

  gguf_value read_value(gguf_value_type type, const std::string& what, int depth) {
    using t = gguf_value_type;
    switch (type) {
      case t::u8:
        return {read<uint8_t>(what)};
      case t::i8:
        return {read<int8_t>(what)};
      case t::u16:
        return {read<uint16_t>(what)};
      case t::i16:
        return {read<int16_t>(what)};
      case t::u32:
        return {read<uint32_t>(what)};
      case t::i32:
        return {read<int32_t>(what)};
      case t::f32:
        return {read<float>(what)};
      case t::boolean: {
        const auto b = read<uint8_t>(what);
        if (b > 1)
          fail(file_, what + ": invalid bool value " + std::to_string(b) + " (must be 0 or 1)");
        return {b == 1};
      }
      case t::string:
        return {read_string(what)};
      case t::array:
        return {read_array(what, depth + 1)};
      case t::u64:
        return {read<uint64_t>(what)};
      case t::i64:
        return {read<int64_t>(what)};
      case t::f64:
        return {read<double>(what)};
    }
    fail(file_, what + ": invalid value type " + std::to_string(static_cast<uint32_t>(type)));
  }

  gguf_value_type read_type(const std::string& what) {
    const auto raw = read<uint32_t>(what + " (value type)");
    if (raw > static_cast<uint32_t>(gguf_value_type::f64)) {
      fail(file_, what + ": unknown value type " + std::to_string(raw) + " at offset " +
                      std::to_string(pos_ - 4));
    }
    return static_cast<gguf_value_type>(raw);
  }

  gguf_array read_array(const std::string& what, int depth) {
    if (depth > max_array_depth) {
      fail(file_,
           what + ": arrays nested deeper than " + std::to_string(max_array_depth) + " levels");
    }
    gguf_array arr;
    arr.type = read_type(what + " (array element type)");
    const auto n = read<uint64_t>(what + " (array length)");
    // Every element takes at least one byte (strings and arrays more), so a count larger than
    // the rest of the file is malformed; checking first avoids a huge allocation.
    const uint64_t min_size = min_encoded_size(arr.type);
    uint64_t min_total = 0;
    if (mul_overflows(n, min_size, min_total) || min_total > remaining()) {
      fail(file_, what + ": array of " + std::to_string(n) + " " +
                      std::string(gguf_value_type_name(arr.type)) + " elements at offset " +
                      std::to_string(pos_ - 8) + " runs past the end of the file (" +
                      std::to_string(size_) + " bytes)");
    }
    // Grow as elements really parse: a lying count must not reserve a large block up front.
    arr.items.reserve(static_cast<std::size_t>(std::min<uint64_t>(n, uint64_t{1} << 16)));
    for (uint64_t i = 0; i < n; ++i) {
      if (arr.type == gguf_value_type::array) {
        arr.items.push_back(
            gguf_value{read_array(what + "[" + std::to_string(i) + "]", depth + 1)});
      } else if (arr.type == gguf_value_type::string) {
        // Fast path for the big token and merge lists; the element index names the culprit.
        const auto len = read<uint64_t>(what + "[" + std::to_string(i) + "] (string length)");
        if (len > remaining()) {
          fail(file_, what + "[" + std::to_string(i) + "]: string length " + std::to_string(len) +
                          " at offset " + std::to_string(pos_ - 8) +
                          " runs past the end of the file (" + std::to_string(size_) + " bytes)");
        }
        arr.items.push_back(gguf_value{std::string(reinterpret_cast<const char*>(base_ + pos_),
                                                   static_cast<std::size_t>(len))});
        pos_ += len;
      } else {
        arr.items.push_back(read_value(arr.type, what + "[" + std::to_string(i) + "]", depth));
      }
    }
    return arr;
  }

  static uint64_t min_encoded_size(gguf_value_type type) {
    using t = gguf_value_type;
    switch (type) {
      case t::u8:
      case t::i8:
      case t::boolean:
        return 1;
      case t::u16:
      case t::i16:
        return 2;
      case t::u32:
      case t::i32:
      case t::f32:
        return 4;
      case t::u64:
      case t::i64:
      case t::f64:
      case t::string:
        return 8;
      case t::array:
        return 12;
    }
    return 1;
  }

 private:
  const std::filesystem::path& file_;
  const std::byte* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

std::string shape_string(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string tensor_context(const gguf_tensor& t) {
  return "tensor " + in_quotes(t.info->name) + " (" + std::string(ggml_type_name(t.info->type)) +
         ", shape " + shape_string(t.info->shape) + ")";
}

}  // namespace

// ---- values ---------------------------------------------------------------------------------

std::string_view gguf_value_type_name(gguf_value_type type) {
  switch (type) {
    case gguf_value_type::u8:
      return "uint8";
    case gguf_value_type::i8:
      return "int8";
    case gguf_value_type::u16:
      return "uint16";
    case gguf_value_type::i16:
      return "int16";
    case gguf_value_type::u32:
      return "uint32";
    case gguf_value_type::i32:
      return "int32";
    case gguf_value_type::f32:
      return "float32";
    case gguf_value_type::boolean:
      return "bool";
    case gguf_value_type::string:
      return "string";
    case gguf_value_type::array:
      return "array";
    case gguf_value_type::u64:
      return "uint64";
    case gguf_value_type::i64:
      return "int64";
    case gguf_value_type::f64:
      return "float64";
  }
  return "unknown";
}

bool gguf_value::is_integer() const {
  switch (type()) {
    case gguf_value_type::u8:
    case gguf_value_type::i8:
    case gguf_value_type::u16:
    case gguf_value_type::i16:
    case gguf_value_type::u32:
    case gguf_value_type::i32:
    case gguf_value_type::u64:
    case gguf_value_type::i64:
      return true;
    default:
      return false;
  }
}

bool gguf_value::is_float() const {
  return type() == gguf_value_type::f32 || type() == gguf_value_type::f64;
}

namespace {
[[noreturn]] void wrong_type(std::string_view what, std::string_view wanted, const gguf_value& v) {
  throw std::runtime_error(std::string(what) + ": expected " + std::string(wanted) + ", found " +
                           std::string(gguf_value_type_name(v.type())) + " " + v.to_string(4));
}
}  // namespace

uint64_t gguf_value::as_u64(std::string_view what) const {
  if (!is_integer()) wrong_type(what, "an unsigned integer", *this);
  return std::visit(
      [&](const auto& x) -> uint64_t {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
          if constexpr (std::is_signed_v<T>) {
            if (x < 0)
              throw std::runtime_error(
                  std::string(what) + ": expected an unsigned integer, found " + std::to_string(x));
          }
          return static_cast<uint64_t>(x);
        } else {
          return 0;
        }
      },
      data);
}

int64_t gguf_value::as_i64(std::string_view what) const {
  if (!is_integer()) wrong_type(what, "an integer", *this);
  if (type() == gguf_value_type::u64) {
    const auto x = std::get<uint64_t>(data);
    if (x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw std::runtime_error(std::string(what) + ": " + std::to_string(x) +
                               " does not fit int64");
    }
    return static_cast<int64_t>(x);
  }
  return std::visit(
      [](const auto& x) -> int64_t {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
          return static_cast<int64_t>(x);
        } else {
          return 0;
        }
      },
      data);
}

double gguf_value::as_f64(std::string_view what) const {
  if (type() == gguf_value_type::f32) return std::get<float>(data);
  if (type() == gguf_value_type::f64) return std::get<double>(data);
  if (type() == gguf_value_type::u64) return static_cast<double>(std::get<uint64_t>(data));
  if (is_integer()) return static_cast<double>(as_i64(what));
  wrong_type(what, "a number", *this);
}

bool gguf_value::as_bool(std::string_view what) const {
  if (type() != gguf_value_type::boolean) wrong_type(what, "a bool", *this);
  return std::get<bool>(data);
}

const std::string& gguf_value::as_string(std::string_view what) const {
  if (type() != gguf_value_type::string) wrong_type(what, "a string", *this);
  return std::get<std::string>(data);
}

const gguf_array& gguf_value::as_array(std::string_view what) const {
  if (type() != gguf_value_type::array) wrong_type(what, "an array", *this);
  return std::get<gguf_array>(data);
}

std::string gguf_value::to_string(std::size_t max_items) const {
  std::ostringstream out;
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, bool>) {
          out << (x ? "true" : "false");
        } else if constexpr (std::is_same_v<T, std::string>) {
          constexpr std::size_t max_chars = 80;
          out << '"' << x.substr(0, max_chars) << (x.size() > max_chars ? "..." : "") << '"';
        } else if constexpr (std::is_same_v<T, gguf_array>) {
          out << '[';
          for (std::size_t i = 0; i < x.items.size() && i < max_items; ++i) {
            out << (i ? ", " : "") << x.items[i].to_string(max_items);
          }
          if (x.items.size() > max_items) out << ", ... (" << x.items.size() << " items)";
          out << ']';
        } else if constexpr (std::is_same_v<T, uint8_t> || std::is_same_v<T, int8_t>) {
          out << static_cast<int>(x);
        } else if constexpr (std::is_floating_point_v<T>) {
          out.precision(std::numeric_limits<T>::max_digits10);
          out << x;
        } else {
          out << x;
        }
      },
      data);
  return out.str();
}

// ---- types ----------------------------------------------------------------------------------

const ggml_type_traits* ggml_type_find(uint32_t raw_id) {
  for (const auto& t : type_table) {
    if (static_cast<uint32_t>(t.type) == raw_id) return &t;
  }
  return nullptr;
}

const ggml_type_traits& ggml_type_get(ggml_type type) {
  const auto* t = ggml_type_find(static_cast<uint32_t>(type));
  if (!t)
    throw std::invalid_argument("ggml type id " + std::to_string(static_cast<uint32_t>(type)) +
                                " is not a ggml type");
  return *t;
}

std::string_view ggml_type_name(ggml_type type) {
  const auto* t = ggml_type_find(static_cast<uint32_t>(type));
  return t ? t->name : std::string_view("unknown");
}

uint64_t ggml_type_bytes(ggml_type type, uint64_t n_elements) {
  const auto& t = ggml_type_get(type);
  if (n_elements % t.block_size != 0) {
    throw std::runtime_error(std::to_string(n_elements) + " elements of " + std::string(t.name) +
                             " are not a whole number of " + std::to_string(t.block_size) +
                             "-element blocks");
  }
  uint64_t bytes = 0;
  if (mul_overflows(n_elements / t.block_size, t.type_size, bytes)) {
    throw std::runtime_error(std::to_string(n_elements) + " elements of " + std::string(t.name) +
                             " overflow 64 bits of bytes");
  }
  return bytes;
}

float ggml_fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits = 0;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf or NaN, payload kept
  } else if (exp != 0) {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;  // signed zero
  } else {
    // subnormal: normalise; value mant * 2^-24
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3FFu) << 13);
  }
  return std::bit_cast<float>(bits);
}

float ggml_bf16_to_fp32(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

// ---- tensor infos ---------------------------------------------------------------------------

uint64_t gguf_tensor_info::n_rows() const {
  const uint64_t len = row_length();
  return len == 0 ? 0 : n_elements / len;
}

uint64_t gguf_tensor_info::row_bytes() const {
  return ggml_type_bytes(type, row_length());
}

// ---- the file -------------------------------------------------------------------------------

gguf_file::gguf_file(const std::filesystem::path& path) : path_(path) {
  try {
    map_ = mapped_file(path);
  } catch (const mapped_file_error& e) {
    fail(path_, e.what());
  }
  if (map_.size() == 0) fail(path_, "empty file (0 bytes), not a GGUF file");
  parse();
}

void gguf_file::parse() {
  cursor in(path_, map_.data(), map_.size());

  // Header: magic "GGUF", uint32 version, uint64 tensor count, uint64 metadata count.
  in.need(4, "header (magic)");
  if (std::memcmp(map_.data(), "GGUF", 4) != 0) {
    std::string seen;
    for (int i = 0; i < 4; ++i) {
      const auto c = static_cast<unsigned char>(map_.data()[i]);
      seen += (c >= 0x20 && c < 0x7F) ? static_cast<char>(c) : '?';
    }
    fail(path_, "bad magic '" + seen + "': not a GGUF file (expected 'GGUF')");
  }
  in.read<uint32_t>("header (magic)");
  version_ = in.read<uint32_t>("header (version)");
  if (version_ != 2 && version_ != 3) {
    if (version_ != 0 && (version_ & 0xFFFFu) == 0) {
      fail(path_, "GGUF version " + std::to_string(version_) +
                      " looks byte-swapped: big-endian GGUF files are not supported");
    }
    if (version_ == 1) fail(path_, "GGUF version 1 is not supported (only versions 2 and 3)");
    fail(path_,
         "unsupported GGUF version " + std::to_string(version_) + " (only versions 2 and 3)");
  }
  const auto n_tensors = in.read<uint64_t>("header (tensor count)");
  const auto n_kv = in.read<uint64_t>("header (metadata count)");
  // Each metadata entry takes at least 8 + 4 + 1 bytes and each tensor info at least 8 + 4 + 4 + 8.
  if (n_kv > in.remaining() / 13) {
    fail(path_, "header: metadata count " + std::to_string(n_kv) + " is impossible for a file of " +
                    std::to_string(map_.size()) + " bytes");
  }
  if (n_tensors > in.remaining() / 24) {
    fail(path_, "header: tensor count " + std::to_string(n_tensors) +
                    " is impossible for a file of " + std::to_string(map_.size()) + " bytes");
  }

  kv_.reserve(static_cast<std::size_t>(n_kv));
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string where = "metadata entry " + std::to_string(i);
    std::string key = in.read_string(where + " (key)");
    const std::string what = "metadata key " + in_quotes(key);
    if (kv_index_.count(key)) fail(path_, what + ": duplicate key");
    const auto type = in.read_type(what);
    gguf_value value = in.read_value(type, what, 0);
    kv_index_.emplace(key, kv_.size());
    kv_.push_back(gguf_kv{std::move(key), std::move(value)});
  }

  if (const gguf_value* a = find("general.alignment")) {
    if (!a->is_integer()) {
      fail(path_, "metadata key 'general.alignment': expected an unsigned integer, found " +
                      std::string(gguf_value_type_name(a->type())));
    }
    const uint64_t v = a->as_u64("metadata key 'general.alignment'");
    if (v == 0 || (v & (v - 1)) != 0) {
      fail(path_,
           "metadata key 'general.alignment': " + std::to_string(v) + " is not a power of two");
    }
    alignment_ = v;
  }

  tensors_.reserve(static_cast<std::size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    gguf_tensor_info t;
    t.name = in.read_string("tensor info " + std::to_string(i) + " (name)");
    const std::string what = "tensor " + in_quotes(t.name);
    if (tensor_index_.count(t.name)) fail(path_, what + ": duplicate tensor name");
    const auto n_dims = in.read<uint32_t>(what + " (dimension count)");
    if (n_dims > 4) {
      fail(path_, what + ": " + std::to_string(n_dims) + " dimensions (at most 4)");
    }
    t.n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const auto ne = in.read<uint64_t>(what + " (dimension " + std::to_string(d) + ")");
      if (ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail(path_, what + ": dimension " + std::to_string(d) + " is " + std::to_string(ne) +
                        ", too large");
      }
      t.shape.push_back(ne);
      if (mul_overflows(t.n_elements, ne, t.n_elements) ||
          t.n_elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail(path_, what + ": shape " + shape_string(t.shape) + " has too many elements");
      }
    }
    const auto raw_type = in.read<uint32_t>(what + " (type)");
    const ggml_type_traits* traits = ggml_type_find(raw_type);
    if (!traits) {
      fail(path_, what + ": unknown tensor type id " + std::to_string(raw_type));
    }
    t.type = traits->type;
    if (t.row_length() % traits->block_size != 0) {
      fail(path_, what + ": type " + std::string(traits->name) +
                      " needs rows that are a multiple of " + std::to_string(traits->block_size) +
                      " elements, shape is " + shape_string(t.shape));
    }
    t.n_bytes = ggml_type_bytes(t.type, t.n_elements);
    t.offset = in.read<uint64_t>(what + " (data offset)");
    if (t.offset % alignment_ != 0) {
      fail(path_, what + ": data offset " + std::to_string(t.offset) +
                      " is not a multiple of the alignment " + std::to_string(alignment_));
    }
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment.
  const uint64_t end = in.pos();
  data_offset_ = (end + alignment_ - 1) / alignment_ * alignment_;
  for (const auto& t : tensors_) {
    uint64_t begin = 0;
    uint64_t stop = 0;
    if (add_overflows(data_offset_, t.offset, begin) || add_overflows(begin, t.n_bytes, stop) ||
        stop > map_.size()) {
      fail(path_, "tensor " + in_quotes(t.name) + " (" + std::string(ggml_type_name(t.type)) +
                      ", shape " + shape_string(t.shape) + "): data [" +
                      std::to_string(data_offset_) + " + " + std::to_string(t.offset) + ", +" +
                      std::to_string(t.n_bytes) + " bytes) runs past the end of the file (" +
                      std::to_string(map_.size()) + " bytes)");
    }
  }
}

const gguf_value* gguf_file::find(std::string_view key) const {
  const auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].value;
}

const gguf_value& gguf_file::at(std::string_view key) const {
  const gguf_value* v = find(key);
  if (!v) fail(path_, "missing metadata key " + in_quotes(key));
  return *v;
}

namespace {
std::string key_context(const std::filesystem::path& file, std::string_view key) {
  return "gguf: " + file.string() + ": metadata key " + in_quotes(key);
}
}  // namespace

uint64_t gguf_file::get_u64(std::string_view key) const {
  return at(key).as_u64(key_context(path_, key));
}
int64_t gguf_file::get_i64(std::string_view key) const {
  return at(key).as_i64(key_context(path_, key));
}
double gguf_file::get_f64(std::string_view key) const {
  return at(key).as_f64(key_context(path_, key));
}
bool gguf_file::get_bool(std::string_view key) const {
  return at(key).as_bool(key_context(path_, key));
}
const std::string& gguf_file::get_string(std::string_view key) const {
  return at(key).as_string(key_context(path_, key));
}
const gguf_array& gguf_file::get_array(std::string_view key) const {
  return at(key).as_array(key_context(path_, key));
}

std::optional<uint64_t> gguf_file::find_u64(std::string_view key) const {
  const gguf_value* v = find(key);
  if (!v) return std::nullopt;
  return v->as_u64(key_context(path_, key));
}
std::optional<int64_t> gguf_file::find_i64(std::string_view key) const {
  const gguf_value* v = find(key);
  if (!v) return std::nullopt;
  return v->as_i64(key_context(path_, key));
}
std::optional<double> gguf_file::find_f64(std::string_view key) const {
  const gguf_value* v = find(key);
  if (!v) return std::nullopt;
  return v->as_f64(key_context(path_, key));
}
std::optional<bool> gguf_file::find_bool(std::string_view key) const {
  const gguf_value* v = find(key);
  if (!v) return std::nullopt;
  return v->as_bool(key_context(path_, key));
}
const std::string* gguf_file::find_string(std::string_view key) const {
  const gguf_value* v = find(key);
  return v ? &v->as_string(key_context(path_, key)) : nullptr;
}
const gguf_array* gguf_file::find_array(std::string_view key) const {
  const gguf_value* v = find(key);
  return v ? &v->as_array(key_context(path_, key)) : nullptr;
}

const gguf_tensor_info* gguf_file::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

gguf_tensor gguf_file::tensor(std::string_view name) const {
  const gguf_tensor_info* info = find_tensor(name);
  if (!info) fail(path_, "no tensor " + in_quotes(name));
  return tensor(*info);
}

gguf_tensor gguf_file::tensor(const gguf_tensor_info& info) const {
  if (tensors_.empty() || &info < tensors_.data() || &info >= tensors_.data() + tensors_.size()) {
    fail(path_, "tensor " + in_quotes(info.name) + " does not belong to this file");
  }
  return gguf_tensor{&info,
                     std::span<const std::byte>(map_.data() + data_offset_ + info.offset,
                                                static_cast<std::size_t>(info.n_bytes)),
                     path_};
}

// ---- dequantization -------------------------------------------------------------------------

void dequantize_into(ggml_type type, std::span<const std::byte> src, std::span<float> dst) {
  const ggml_type_traits* traits = ggml_type_find(static_cast<uint32_t>(type));
  if (!traits) {
    throw std::runtime_error("dequantize: unknown tensor type id " +
                             std::to_string(static_cast<uint32_t>(type)));
  }
  if (!traits->dequantizable) {
    throw std::runtime_error("dequantize: tensor type " + std::string(traits->name) +
                             " is not supported (supported: " + std::string(supported_types) + ")");
  }
  const uint64_t n = dst.size();
  const uint64_t bytes = ggml_type_bytes(type, n);
  if (src.size() != bytes) {
    throw std::runtime_error("dequantize: " + std::to_string(n) + " " + std::string(traits->name) +
                             " values need " + std::to_string(bytes) + " bytes, got " +
                             std::to_string(src.size()));
  }
  const std::byte* s = src.data();
  float* y = dst.data();
  const uint64_t n_blocks = n / traits->block_size;
  switch (type) {
    case ggml_type::f32:
      if (n) std::memcpy(y, s, static_cast<std::size_t>(bytes));
      if constexpr (std::endian::native == std::endian::big) {
        for (uint64_t i = 0; i < n; ++i) y[i] = load_le<float>(s + 4 * i);
      }
      return;
    case ggml_type::f16:
      for (uint64_t i = 0; i < n; ++i) y[i] = ggml_fp16_to_fp32(load_u16(s + 2 * i));
      return;
    case ggml_type::bf16:
      for (uint64_t i = 0; i < n; ++i) y[i] = ggml_bf16_to_fp32(load_u16(s + 2 * i));
      return;
    case ggml_type::q8_0:
      for (uint64_t b = 0; b < n_blocks; ++b) dequant_block_q8_0(s + b * 34, y + b * 32);
      return;
    case ggml_type::q4_0:
      for (uint64_t b = 0; b < n_blocks; ++b) dequant_block_q4_0(s + b * 18, y + b * 32);
      return;
    case ggml_type::q4_1:
      for (uint64_t b = 0; b < n_blocks; ++b) dequant_block_q4_1(s + b * 20, y + b * 32);
      return;
    case ggml_type::q4_k:
      for (uint64_t b = 0; b < n_blocks; ++b) dequant_block_q4_k(s + b * 144, y + b * qk_k);
      return;
    case ggml_type::q6_k:
      for (uint64_t b = 0; b < n_blocks; ++b) dequant_block_q6_k(s + b * 210, y + b * qk_k);
      return;
    default:
      break;
  }
  throw std::runtime_error("dequantize: tensor type " + std::string(traits->name) +
                           " is not supported");
}

std::vector<float> dequantize(const gguf_tensor& tensor) {
  if (!tensor.info) throw std::invalid_argument("dequantize: empty tensor view");
  return dequantize_rows(tensor, 0, tensor.info->n_rows());
}

std::vector<float> dequantize_rows(const gguf_tensor& tensor, uint64_t first_row, uint64_t n_rows) {
  if (!tensor.info) throw std::invalid_argument("dequantize_rows: empty tensor view");
  const gguf_tensor_info& info = *tensor.info;
  const uint64_t rows = info.n_rows();
  if (first_row > rows || n_rows > rows - first_row) {
    fail(tensor.file, tensor_context(tensor) + ": rows [" + std::to_string(first_row) + ", " +
                          std::to_string(first_row + n_rows) + ") out of range (" +
                          std::to_string(rows) + " rows)");
  }
  const uint64_t len = info.row_length();
  const uint64_t row_bytes = info.row_bytes();
  if (tensor.data.size() < info.n_bytes) {
    fail(tensor.file, tensor_context(tensor) + ": view holds " +
                          std::to_string(tensor.data.size()) + " bytes, the tensor needs " +
                          std::to_string(info.n_bytes));
  }
  std::vector<float> out(static_cast<std::size_t>(len * n_rows));
  try {
    dequantize_into(info.type,
                    tensor.data.subspan(static_cast<std::size_t>(first_row * row_bytes),
                                        static_cast<std::size_t>(n_rows * row_bytes)),
                    out);
  } catch (const std::runtime_error& e) {
    fail(tensor.file, tensor_context(tensor) + ": " + e.what());
  }
  return out;
}

void dequantize_row(const gguf_tensor& tensor, uint64_t row, std::span<float> out) {
  if (!tensor.info) throw std::invalid_argument("dequantize_row: empty tensor view");
  const gguf_tensor_info& info = *tensor.info;
  if (row >= info.n_rows()) {
    fail(tensor.file, tensor_context(tensor) + ": row " + std::to_string(row) + " out of range (" +
                          std::to_string(info.n_rows()) + " rows)");
  }
  if (out.size() != info.row_length()) {
    fail(tensor.file, tensor_context(tensor) + ": output holds " + std::to_string(out.size()) +
                          " floats, a row has " + std::to_string(info.row_length()));
  }
  const uint64_t row_bytes = info.row_bytes();
  try {
    dequantize_into(info.type,
                    tensor.data.subspan(static_cast<std::size_t>(row * row_bytes),
                                        static_cast<std::size_t>(row_bytes)),
                    out);
  } catch (const std::runtime_error& e) {
    fail(tensor.file, tensor_context(tensor) + ": " + e.what());
  }
}

// ---- hyper-parameters -----------------------------------------------------------------------

namespace {

uint32_t to_u32(const gguf_file& f, std::string_view key, uint64_t v) {
  if (v > std::numeric_limits<uint32_t>::max()) {
    fail(f.path(), "metadata key " + in_quotes(key) + ": " + std::to_string(v) + " is too large");
  }
  return static_cast<uint32_t>(v);
}

// A per-model count that some files store per layer (an array): it must be one value here.
std::optional<uint32_t> find_count(const gguf_file& f, const std::string& key) {
  const gguf_value* v = f.find(key);
  if (!v) return std::nullopt;
  const std::string what = "gguf: " + f.path().string() + ": metadata key " + in_quotes(key);
  if (v->type() == gguf_value_type::array) {
    const auto& a = v->as_array(what);
    if (a.items.empty()) fail(f.path(), "metadata key " + in_quotes(key) + ": empty array");
    const uint64_t first = a.items.front().as_u64(what);
    for (const auto& item : a.items) {
      if (item.as_u64(what) != first) {
        fail(f.path(), "metadata key " + in_quotes(key) + ": per-layer values differ (" +
                           v->to_string() +
                           "); models whose layers differ in shape are not supported");
      }
    }
    return to_u32(f, key, first);
  }
  return to_u32(f, key, v->as_u64(what));
}

uint32_t get_count(const gguf_file& f, const std::string& key) {
  const auto v = find_count(f, key);
  if (!v) fail(f.path(), "missing metadata key " + in_quotes(key));
  return *v;
}

}  // namespace

gguf_model_config gguf_read_model_config(const gguf_file& f) {
  gguf_model_config c;
  c.arch = f.get_string("general.architecture");
  if (c.arch != "llama" && c.arch != "qwen2") {
    fail(f.path(),
         "architecture " + in_quotes(c.arch) + " is not supported (supported: llama, qwen2)");
  }
  if (const std::string* name = f.find_string("general.name")) c.name = *name;
  const std::string p = c.arch + ".";

  c.n_layers = get_count(f, p + "block_count");
  c.hidden = get_count(f, p + "embedding_length");
  c.ffn = get_count(f, p + "feed_forward_length");
  c.n_heads = get_count(f, p + "attention.head_count");
  c.n_kv_heads = find_count(f, p + "attention.head_count_kv").value_or(c.n_heads);
  c.context_length = f.get_u64(p + "context_length");
  c.rms_eps = static_cast<float>(f.get_f64(p + "attention.layer_norm_rms_epsilon"));
  c.rope_theta = static_cast<float>(f.find_f64(p + "rope.freq_base").value_or(10000.0));

  if (c.n_layers == 0 || c.hidden == 0 || c.n_heads == 0 || c.n_kv_heads == 0 || c.ffn == 0) {
    fail(f.path(), "architecture " + in_quotes(c.arch) +
                       ": block_count, embedding_length, feed_forward_length, "
                       "head_count and head_count_kv must all be positive");
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    fail(f.path(), "metadata key " + in_quotes(p + "attention.head_count_kv") + ": " +
                       std::to_string(c.n_kv_heads) + " does not divide head_count " +
                       std::to_string(c.n_heads));
  }
  if (const auto k = find_count(f, p + "attention.key_length")) {
    c.head_dim = *k;
    if (const auto v = find_count(f, p + "attention.value_length"); v && *v != *k) {
      fail(f.path(), "attention.key_length " + std::to_string(*k) +
                         " differs from attention.value_length " + std::to_string(*v) +
                         ": not supported");
    }
  } else {
    if (c.hidden % c.n_heads != 0) {
      fail(f.path(), "metadata key " + in_quotes(p + "embedding_length") + ": " +
                         std::to_string(c.hidden) + " is not a multiple of head_count " +
                         std::to_string(c.n_heads));
    }
    c.head_dim = c.hidden / c.n_heads;
  }
  c.rope_dim = find_count(f, p + "rope.dimension_count").value_or(c.head_dim);
  if (c.rope_dim > c.head_dim || c.rope_dim % 2 != 0) {
    fail(f.path(), "metadata key " + in_quotes(p + "rope.dimension_count") + ": " +
                       std::to_string(c.rope_dim) + " must be even and at most head_dim " +
                       std::to_string(c.head_dim));
  }
  if (!(c.rms_eps > 0.0f) || !std::isfinite(c.rms_eps)) {
    fail(f.path(),
         "metadata key " + in_quotes(p + "attention.layer_norm_rms_epsilon") + " must be positive");
  }
  if (!(c.rope_theta > 0.0f) || !std::isfinite(c.rope_theta)) {
    fail(f.path(), "metadata key " + in_quotes(p + "rope.freq_base") + " must be positive");
  }

  const gguf_tensor_info* embd = f.find_tensor("token_embd.weight");
  if (const auto v = find_count(f, p + "vocab_size")) {
    c.vocab = *v;
  } else if (const gguf_array* tokens = f.find_array("tokenizer.ggml.tokens")) {
    c.vocab = to_u32(f, "tokenizer.ggml.tokens", tokens->items.size());
  } else if (embd && embd->shape.size() == 2) {
    c.vocab = to_u32(f, "token_embd.weight", embd->shape[1]);
  } else {
    fail(f.path(), "cannot tell the vocabulary size: no " + in_quotes(p + "vocab_size") +
                       ", no tokenizer.ggml.tokens and no token_embd.weight");
  }
  if (embd) {
    c.token_embd_type = embd->type;
    if (embd->shape.size() != 2 || embd->shape[0] != c.hidden || embd->shape[1] != c.vocab) {
      fail(f.path(), "tensor 'token_embd.weight': shape " + shape_string(embd->shape) +
                         ", expected [" + std::to_string(c.hidden) + ", " +
                         std::to_string(c.vocab) + "] (embedding_length, vocab)");
    }
  } else if (!f.tensors().empty()) {
    fail(f.path(), "no tensor 'token_embd.weight'");
  }
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  c.attn_qkv_bias = f.find_tensor("blk.0.attn_q.bias") != nullptr;
  c.rope_freq_factors = f.find_tensor("rope_freqs.weight") != nullptr;

  if (const std::string* type = f.find_string(p + "rope.scaling.type")) {
    if (*type != "none") {
      gguf_rope_scaling s;
      s.type = *type;
      s.factor = static_cast<float>(f.find_f64(p + "rope.scaling.factor").value_or(1.0));
      s.original_context_length = f.find_u64(p + "rope.scaling.original_context_length");
      if (const auto a = f.find_f64(p + "rope.scaling.attn_factor"))
        s.attn_factor = static_cast<float>(*a);
      s.finetuned = f.find_bool(p + "rope.scaling.finetuned").value_or(false);
      c.rope_scaling = std::move(s);
    }
  } else if (const auto linear = f.find_f64(p + "rope.scale_linear"); linear && *linear != 1.0) {
    c.rope_scaling =
        gguf_rope_scaling{"linear", static_cast<float>(*linear), std::nullopt, std::nullopt, false};
  }
  return c;
}

// ---- tokenizer ------------------------------------------------------------------------------

namespace {
// llama.cpp's token types (llama.h `enum llama_token_type`).
constexpr int32_t token_type_control = 3;
constexpr int32_t token_type_user_defined = 4;

// llama-vocab.cpp: pre-tokenizers for which llama.cpp adds BOS unless add_bos_token says otherwise.
bool default_add_bos(std::string_view pre) {
  constexpr std::array<std::string_view, 10> with_bos{
      "llama3",  "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
      "pixtral", "midm-2.0", "lfm2",      "tekken",  "chameleon"};
  return std::find(with_bos.begin(), with_bos.end(), pre) != with_bos.end();
}
}  // namespace

tokenizer_spec gguf_read_tokenizer(const gguf_file& f) {
  const std::string& model = f.get_string("tokenizer.ggml.model");
  if (model != "gpt2") {
    fail(f.path(), "tokenizer model " + in_quotes(model) +
                       " is not supported (metadata key 'tokenizer.ggml.model'; supported: gpt2, "
                       "byte-level BPE)");
  }
  tokenizer_spec spec;
  const gguf_array& tokens = f.get_array("tokenizer.ggml.tokens");
  if (tokens.type != gguf_value_type::string) {
    fail(f.path(),
         "metadata key 'tokenizer.ggml.tokens': expected an array of strings, found an array of " +
             std::string(gguf_value_type_name(tokens.type)));
  }
  if (tokens.items.empty())
    fail(f.path(), "metadata key 'tokenizer.ggml.tokens': empty vocabulary");
  if (tokens.items.size() > static_cast<std::size_t>(std::numeric_limits<int32_t>::max())) {
    fail(f.path(), "metadata key 'tokenizer.ggml.tokens': too many tokens");
  }
  spec.vocab.reserve(tokens.items.size());
  for (const auto& t : tokens.items) spec.vocab.push_back(std::get<std::string>(t.data));
  const auto n_vocab = static_cast<int64_t>(spec.vocab.size());

  if (const gguf_array* merges = f.find_array("tokenizer.ggml.merges")) {
    if (merges->type != gguf_value_type::string) {
      fail(
          f.path(),
          "metadata key 'tokenizer.ggml.merges': expected an array of strings, found an array of " +
              std::string(gguf_value_type_name(merges->type)));
    }
    spec.merges.reserve(merges->items.size());
    for (std::size_t i = 0; i < merges->items.size(); ++i) {
      const auto& m = std::get<std::string>(merges->items[i].data);
      const auto space = m.find(' ');
      if (space == std::string::npos) {
        fail(f.path(), "metadata key 'tokenizer.ggml.merges'[" + std::to_string(i) +
                           "]: " + in_quotes(m) + " has no space between the two parts");
      }
      spec.merges.emplace_back(m.substr(0, space), m.substr(space + 1));
    }
  }

  if (const gguf_array* types = f.find_array("tokenizer.ggml.token_type")) {
    if (types->items.size() != spec.vocab.size()) {
      fail(f.path(),
           "metadata key 'tokenizer.ggml.token_type': " + std::to_string(types->items.size()) +
               " entries for " + std::to_string(spec.vocab.size()) + " tokens");
    }
    for (std::size_t id = 0; id < types->items.size(); ++id) {
      const int64_t type = types->items[id].as_i64("gguf: " + f.path().string() +
                                                   ": metadata key 'tokenizer.ggml.token_type'[" +
                                                   std::to_string(id) + "]");
      if (type == token_type_control || type == token_type_user_defined) {
        tokenizer_spec::added_token a;
        a.id = static_cast<int32_t>(id);
        a.content = spec.vocab[id];
        a.special = type == token_type_control;
        spec.added.push_back(std::move(a));
      }
    }
  }

  const auto special_id = [&](const char* key) -> std::optional<int32_t> {
    const auto v = f.find_i64(key);
    if (!v) return std::nullopt;
    if (*v < 0 || *v >= n_vocab) {
      fail(f.path(), "metadata key " + in_quotes(key) + ": token id " + std::to_string(*v) +
                         " is outside the vocabulary (" + std::to_string(n_vocab) + " tokens)");
    }
    return static_cast<int32_t>(*v);
  };
  spec.bos_id = special_id("tokenizer.ggml.bos_token_id");
  spec.eos_id = special_id("tokenizer.ggml.eos_token_id");

  const std::string* pre = f.find_string("tokenizer.ggml.pre");
  spec.pre_tokenizer = pre ? *pre : "default";
  spec.add_bos =
      f.find_bool("tokenizer.ggml.add_bos_token").value_or(default_add_bos(spec.pre_tokenizer));
  if (const std::string* tmpl = f.find_string("tokenizer.chat_template"))
    spec.chat_template = *tmpl;
  return spec;
}

}  // namespace duet
