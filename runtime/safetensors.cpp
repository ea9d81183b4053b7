#include "runtime/safetensors.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace duet {

namespace {

using nlohmann::json;

struct dtype_row {
  st_dtype type;
  std::string_view name;
  uint32_t size;
};

constexpr std::array<dtype_row, 15> dtype_table{{
    {st_dtype::f64, "F64", 8},
    {st_dtype::f32, "F32", 4},
    {st_dtype::f16, "F16", 2},
    {st_dtype::bf16, "BF16", 2},
    {st_dtype::i64, "I64", 8},
    {st_dtype::i32, "I32", 4},
    {st_dtype::i16, "I16", 2},
    {st_dtype::i8, "I8", 1},
    {st_dtype::u8, "U8", 1},
    {st_dtype::boolean, "BOOL", 1},
    {st_dtype::f8_e4m3, "F8_E4M3", 1},
    {st_dtype::f8_e5m2, "F8_E5M2", 1},
    {st_dtype::u16, "U16", 2},
    {st_dtype::u32, "U32", 4},
    {st_dtype::u64, "U64", 8},
}};

[[noreturn]] void fail(const std::filesystem::path& file, const std::string& what) {
  throw std::runtime_error("safetensors: " + file.string() + ": " + what);
}

uint64_t read_le64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | std::to_integer<uint64_t>(p[i]);
  return v;
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t& out) { return __builtin_mul_overflow(a, b, &out); }

uint64_t checked_elements(std::span<const uint64_t> shape, const std::filesystem::path& file,
                          const std::string& name) {
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (mul_overflows(n, d, n)) fail(file, "tensor '" + name + "': shape " + shape_to_string(shape) + " overflows");
  }
  return n;
}

void convert_to_floats(st_dtype type, std::span<const std::byte> src, std::span<float> dst) {
  const std::size_t n = dst.size();
  switch (type) {
    case st_dtype::f32:
      std::memcpy(dst.data(), src.data(), n * sizeof(float));
      return;
    case st_dtype::bf16:
      for (std::size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src.data() + 2 * i, 2);
        dst[i] = bf16_to_float(h);
      }
      return;
    case st_dtype::f16:
      for (std::size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src.data() + 2 * i, 2);
        dst[i] = f16_to_float(h);
      }
      return;
    default:
      break;
  }
  throw std::logic_error("convert_to_floats: unsupported dtype");
}

}  // namespace

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

std::string_view st_dtype_name(st_dtype type) {
  for (const auto& row : dtype_table) {
    if (row.type == type) return row.name;
  }
  return "?";
}

uint32_t st_dtype_size(st_dtype type) {
  for (const auto& row : dtype_table) {
    if (row.type == type) return row.size;
  }
  return 0;
}

bool st_dtype_from_name(std::string_view name, st_dtype& out) {
  for (const auto& row : dtype_table) {
    if (row.name == name) {
      out = row.type;
      return true;
    }
  }
  return false;
}

float bf16_to_float(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
  if (mant == 0) return std::bit_cast<float>(sign);
  // Subnormal: mant * 2^-24, exact in float.
  const float magnitude = static_cast<float>(mant) * 0x1p-24f;
  return sign ? -magnitude : magnitude;
}

uint16_t float_to_bf16(float value) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

uint16_t float_to_f16(float value) {
  // Rounding by the FPU for subnormal results, by integer arithmetic for normal ones
  // (F. Giesen's float_to_half_fast3_rtne).
  constexpr uint32_t f32_infinity = 255u << 23;
  constexpr uint32_t f16_overflow = (127u + 16u) << 23;  // 65536: rounds to infinity and above
  constexpr uint32_t denorm_magic_bits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t x = std::bit_cast<uint32_t>(value);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint16_t out;
  if (x >= f16_overflow) {
    out = x > f32_infinity ? 0x7e00 : 0x7c00;
  } else if (x < (113u << 23)) {  // below the smallest normal half: subnormal or zero
    const float shifted = std::bit_cast<float>(x) + std::bit_cast<float>(denorm_magic_bits);
    out = static_cast<uint16_t>(std::bit_cast<uint32_t>(shifted) - denorm_magic_bits);
  } else {
    const uint32_t mant_odd = (x >> 13) & 1u;
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu;
    x += mant_odd;
    out = static_cast<uint16_t>(x >> 13);
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

uint64_t st_tensor_info::n_elements() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

std::string shape_to_string(std::span<const uint64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// ------------------------------------------------------------------------------ safetensors_file

safetensors_file::safetensors_file(const std::filesystem::path& path) : path_(path) {
  try {
    map_ = mapped_file(path);
  } catch (const mapped_file_error& e) {
    fail(path_, e.what());
  }
  parse();
}

void safetensors_file::parse() {
  if (map_.size() < 8) fail(path_, "truncated file: " + std::to_string(map_.size()) + " bytes, the header size alone takes 8");
  const uint64_t header_size = read_le64(map_.data());
  if (header_size > max_header_bytes) {
    fail(path_, "header size " + std::to_string(header_size) + " is over the limit of " +
                    std::to_string(max_header_bytes) + " bytes");
  }
  if (header_size > map_.size() - 8) {
    fail(path_, "truncated file: the header needs " + std::to_string(header_size) + " bytes after the size field, the file has " +
                    std::to_string(map_.size() - 8));
  }
  data_offset_ = 8 + header_size;
  const uint64_t data_size = map_.size() - data_offset_;
  const auto* text = reinterpret_cast<const char*>(map_.data() + 8);
  json header;
  try {
    header = json::parse(text, text + header_size);
  } catch (const json::parse_error& e) {
    fail(path_, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail(path_, "header is not a JSON object");

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(path_, "__metadata__ is not an object");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) fail(path_, "__metadata__ value '" + m.key() + "' is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (!entry.is_object()) fail(path_, where + ": entry is not an object");
    const auto dtype_it = entry.find("dtype");
    const auto shape_it = entry.find("shape");
    const auto offsets_it = entry.find("data_offsets");
    if (dtype_it == entry.end() || !dtype_it->is_string()) fail(path_, where + ": missing or non-string 'dtype'");
    if (shape_it == entry.end() || !shape_it->is_array()) fail(path_, where + ": missing or non-array 'shape'");
    if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
      fail(path_, where + ": 'data_offsets' must be an array [begin, end]");
    }
    st_tensor_info info;
    info.name = name;
    const std::string dtype_name = dtype_it->get<std::string>();
    if (!st_dtype_from_name(dtype_name, info.dtype)) fail(path_, where + ": unknown dtype '" + dtype_name + "'");
    for (const json& d : *shape_it) {
      if (!d.is_number_unsigned()) fail(path_, where + ": shape holds " + d.dump() + ", not a non-negative integer");
      info.shape.push_back(d.get<uint64_t>());
    }
    for (const json& o : *offsets_it) {
      if (!o.is_number_unsigned()) fail(path_, where + ": data_offsets holds " + o.dump() + ", not a non-negative integer");
    }
    info.begin = (*offsets_it)[0].get<uint64_t>();
    info.end = (*offsets_it)[1].get<uint64_t>();
    if (info.begin > info.end) {
      fail(path_, where + ": data_offsets [" + std::to_string(info.begin) + ", " + std::to_string(info.end) + "] run backwards");
    }
    if (info.end > data_size) {
      fail(path_, where + ": data_offsets end " + std::to_string(info.end) + " is past the data section (" +
                      std::to_string(data_size) + " bytes; the file is truncated or the header is wrong)");
    }
    uint64_t expected_bytes = 0;
    if (mul_overflows(checked_elements(info.shape, path_, name), st_dtype_size(info.dtype), expected_bytes)) {
      fail(path_, where + ": shape " + shape_to_string(info.shape) + " overflows");
    }
    if (info.n_bytes() != expected_bytes) {
      fail(path_, where + ": " + std::to_string(info.n_bytes()) + " bytes for " + dtype_name + " " +
                      shape_to_string(info.shape) + ", which takes " + std::to_string(expected_bytes));
    }
    tensors_.push_back(std::move(info));
  }
  // Non-overlapping byte ranges (empty tensors take no bytes and overlap nothing).
  std::vector<const st_tensor_info*> by_offset;
  for (const auto& t : tensors_) {
    if (t.n_bytes() > 0) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const st_tensor_info* a, const st_tensor_info* b) { return a->begin < b->begin; });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i]->begin < by_offset[i - 1]->end) {
      fail(path_, "tensors '" + by_offset[i - 1]->name + "' and '" + by_offset[i]->name + "' overlap");
    }
  }
  std::sort(tensors_.begin(), tensors_.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
}

const st_tensor_info* safetensors_file::find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const st_tensor_info& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

const st_tensor_info& safetensors_file::at(std::string_view name) const {
  const st_tensor_info* info = find(name);
  if (!info) fail(path_, "missing tensor '" + std::string(name) + "'");
  return *info;
}

std::span<const std::byte> safetensors_file::bytes(const st_tensor_info& info) const {
  if (info.n_bytes() == 0) return {};
  return {map_.data() + data_offset_ + info.begin, info.n_bytes()};
}

std::vector<float> safetensors_file::read_floats(std::string_view name,
                                                 std::span<const uint64_t> expected_shape) const {
  const st_tensor_info& info = at(name);
  std::vector<float> out(info.n_elements());
  read_floats_into(name, out, expected_shape);
  return out;
}

void safetensors_file::read_floats_into(std::string_view name, std::span<float> out,
                                        std::span<const uint64_t> expected_shape) const {
  const st_tensor_info& info = at(name);
  const std::string where = "tensor '" + info.name + "'";
  if (!expected_shape.empty() && !std::equal(expected_shape.begin(), expected_shape.end(), info.shape.begin(),
                                             info.shape.end())) {
    fail(path_, where + ": wrong shape " + shape_to_string(info.shape) + ", expected " + shape_to_string(expected_shape));
  }
  if (info.dtype != st_dtype::f32 && info.dtype != st_dtype::bf16 && info.dtype != st_dtype::f16) {
    fail(path_, where + ": unsupported dtype " + std::string(st_dtype_name(info.dtype)) + " (only BF16, F16 and F32 convert to float)");
  }
  if (out.size() != info.n_elements()) {
    fail(path_, where + ": output holds " + std::to_string(out.size()) + " floats, the tensor has " +
                    std::to_string(info.n_elements()));
  }
  convert_to_floats(info.dtype, bytes(info), out);
}

// ------------------------------------------------------------------------ safetensors_checkpoint

safetensors_checkpoint::safetensors_checkpoint(const std::filesystem::path& path) : path_(path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) fail(path, "no such file or directory");
  auto add_file = [this](const fs::path& file) {
    files_.push_back(std::make_unique<safetensors_file>(file));
    const std::size_t index = files_.size() - 1;
    for (const auto& t : files_.back()->tensors()) {
      auto [it, fresh] = where_.emplace(t.name, index);
      if (!fresh) fail(file, "tensor '" + t.name + "' is also in " + files_[it->second]->path().string());
    }
  };
  if (!fs::is_directory(path, ec)) {
    add_file(path);
    return;
  }
  const fs::path index_path = path / "model.safetensors.index.json";
  if (!fs::exists(index_path, ec)) {
    const fs::path single = path / "model.safetensors";
    if (!fs::exists(single, ec)) fail(path, "no model.safetensors or model.safetensors.index.json in the directory");
    add_file(single);
    return;
  }
  json index;
  {
    std::ifstream in(index_path);
    if (!in) fail(index_path, "cannot read");
    try {
      index = json::parse(in);
    } catch (const json::parse_error& e) {
      fail(index_path, std::string("not valid JSON: ") + e.what());
    }
  }
  const auto map_it = index.find("weight_map");
  if (!index.is_object() || map_it == index.end() || !map_it->is_object()) fail(index_path, "no 'weight_map' object");
  std::set<std::string> shards;
  for (auto it = map_it->begin(); it != map_it->end(); ++it) {
    if (!it.value().is_string()) fail(index_path, "weight_map entry '" + it.key() + "' is not a file name");
    const std::string shard = it.value().get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
      fail(index_path, "weight_map entry '" + it.key() + "' names '" + shard + "', not a file in the directory");
    }
    shards.insert(shard);
  }
  if (shards.empty()) fail(index_path, "weight_map is empty");
  for (const auto& shard : shards) add_file(path / shard);
  for (auto it = map_it->begin(); it != map_it->end(); ++it) {
    auto w = where_.find(it.key());
    const std::string shard = it.value().get<std::string>();
    if (w == where_.end() || files_[w->second]->path().filename() != shard) {
      fail(index_path, "tensor '" + it.key() + "' is mapped to " + shard + ", which does not hold it");
    }
  }
}

bool safetensors_checkpoint::contains(std::string_view name) const { return where_.find(name) != where_.end(); }

std::vector<std::string> safetensors_checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, index] : where_) out.push_back(name);
  return out;
}

const safetensors_file& safetensors_checkpoint::file_of(std::string_view name) const {
  auto it = where_.find(name);
  if (it == where_.end()) fail(path_, "missing tensor '" + std::string(name) + "'");
  return *files_[it->second];
}

const st_tensor_info& safetensors_checkpoint::info(std::string_view name) const { return file_of(name).at(name); }

std::vector<float> safetensors_checkpoint::read_floats(std::string_view name,
                                                       std::span<const uint64_t> expected_shape) const {
  return file_of(name).read_floats(name, expected_shape);
}

void safetensors_checkpoint::read_floats_into(std::string_view name, std::span<float> out,
                                              std::span<const uint64_t> expected_shape) const {
  file_of(name).read_floats_into(name, out, expected_shape);
}

// ---------------------------------------------------------------------------------------- writer

namespace {

struct layout_entry {
  const st_write_entry* entry;
  uint64_t begin;
  uint64_t end;
};

std::vector<layout_entry> layout_of(std::span<const st_write_entry> entries) {
  std::vector<const st_write_entry*> sorted;
  for (const auto& e : entries) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const auto* a, const auto* b) { return a->name < b->name; });
  std::vector<layout_entry> out;
  uint64_t offset = 0;
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    const st_write_entry& e = *sorted[i];
    if (i && sorted[i - 1]->name == e.name) throw std::invalid_argument("safetensors: duplicate tensor '" + e.name + "'");
    if (e.name == "__metadata__" || e.name.empty()) throw std::invalid_argument("safetensors: bad tensor name '" + e.name + "'");
    uint64_t n = 1;
    for (uint64_t d : e.shape) n *= d;
    const uint64_t bytes = n * st_dtype_size(e.dtype);
    out.push_back({&e, offset, offset + bytes});
    offset += bytes;
  }
  return out;
}

std::string header_of(const std::vector<layout_entry>& layout, const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const auto& l : layout) {
    header[l.entry->name] = json{{"dtype", st_dtype_name(l.entry->dtype)},
                                 {"shape", l.entry->shape},
                                 {"data_offsets", {l.begin, l.end}}};
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace

std::string safetensors_header(std::span<const st_write_entry> entries, const std::map<std::string, std::string>& metadata) {
  return header_of(layout_of(entries), metadata);
}

void write_safetensors(const std::filesystem::path& path, std::span<const st_write_entry> entries,
                       const std::map<std::string, std::string>& metadata) {
  const auto layout = layout_of(entries);
  const std::string header = header_of(layout, metadata);
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail(tmp, "cannot create");
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    constexpr uint64_t piece_bytes = 16u << 20;
    std::vector<std::byte> buffer;
    for (const auto& l : layout) {
      const uint32_t element = st_dtype_size(l.entry->dtype);
      const uint64_t total = l.end - l.begin;
      const uint64_t piece = std::max<uint64_t>(element, piece_bytes / element * element);
      for (uint64_t done = 0; done < total; done += piece) {
        const uint64_t n = std::min(piece, total - done);
        buffer.assign(n, std::byte{0});
        if (l.entry->fill) l.entry->fill(done / element, buffer);
        out.write(reinterpret_cast<const char*>(buffer.data()), static_cast<std::streamsize>(n));
      }
    }
    out.flush();
    if (!out) fail(tmp, "write failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) fail(path, "cannot rename from " + tmp.string() + ": " + ec.message());
}

std::vector<std::filesystem::path> write_safetensors_checkpoint(const std::filesystem::path& dir,
                                                                std::span<const st_write_entry> entries,
                                                                uint64_t max_shard_bytes,
                                                                const std::map<std::string, std::string>& metadata) {
  std::filesystem::create_directories(dir);
  const auto layout = layout_of(entries);
  // A checkpoint written earlier into the same directory must not shadow this one.
  for (const auto& item : std::filesystem::directory_iterator(dir)) {
    const std::string name = item.path().filename().string();
    const bool shard = name.starts_with("model-") && name.ends_with(".safetensors");
    if (shard || name == "model.safetensors" || name == "model.safetensors.index.json") {
      std::filesystem::remove(item.path());
    }
  }
  const uint64_t total = layout.empty() ? 0 : layout.back().end;
  if (total <= max_shard_bytes) {
    write_safetensors(dir / "model.safetensors", entries, metadata);
    return {dir / "model.safetensors"};
  }
  std::vector<std::vector<st_write_entry>> shards(1);
  uint64_t in_shard = 0;
  for (const auto& l : layout) {
    const uint64_t bytes = l.end - l.begin;
    if (in_shard > 0 && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(*l.entry);
    in_shard += bytes;
  }
  auto shard_name = [&](std::size_t i) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    return std::string(buf);
  };
  std::vector<std::filesystem::path> written;
  json weight_map = json::object();
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const std::string name = shard_name(i);
    write_safetensors(dir / name, shards[i], metadata);
    written.push_back(dir / name);
    for (const auto& e : shards[i]) weight_map[e.name] = name;
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const std::filesystem::path index_path = dir / "model.safetensors.index.json";
  std::ofstream out(index_path, std::ios::trunc);
  out << index.dump(2) << "\n";
  if (!out) fail(index_path, "write failed");
  written.push_back(index_path);
  return written;
}

}  // namespace duet
