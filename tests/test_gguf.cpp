// GGUF reader, dequantization, config and tokenizer extraction, checked against references
// made by independent tools (gguf-py, llama.cpp): tests/data/gguf/, made by
// tests/tools/make_gguf_fixtures.py. docs/gguf.md explains the method and the tolerances.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/gguf.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const fs::path data_dir = fs::path(DUET_TEST_DATA) / "gguf";
const fs::path model_path =
    fs::path(DUET_SOURCE_DIR) / "models" / "smollm2-135m-instruct-q4_1.gguf";

json load_json(const fs::path& p) {
  std::ifstream in(p);
  REQUIRE_MESSAGE(in.good(), "cannot read ", p.string());
  return json::parse(in);
}

// Tests that need the real model fail (never pass silently) when it has not been fetched.
void require_model() {
  if (!fs::exists(model_path)) {
    FAIL("the SmolLM2 GGUF is missing at "
         << model_path.string() << ": run scripts/fetch-model.sh (it downloads and verifies it)");
  }
}

std::vector<std::byte> from_hex(const std::string& hex) {
  std::vector<std::byte> out(hex.size() / 2);
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<std::byte>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  }
  return out;
}

uint32_t bits_of(float f) {
  return std::bit_cast<uint32_t>(f);
}

uint64_t weighted_sum(const std::vector<float>& v) {
  uint64_t total = 0;
  for (std::size_t i = 0; i < v.size(); ++i)
    total += uint64_t{bits_of(v[i])} * (2 * uint64_t{i} + 1);
  return total;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "<no exception>";
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Scratch files live in memory (/dev/shm) where there is one: the corruption test rewrites
// thousands of them, which takes seconds on a real disk.
fs::path scratch_dir() {
  std::error_code ec;
  if (fs::is_directory("/dev/shm", ec)) return "/dev/shm";
  return DUET_BINARY_DIR;
}

// A scratch file per test process, removed at exit.
class scratch_file {
 public:
  explicit scratch_file(const std::string& tag)
      : path_(scratch_dir() /
              ("duet_test_gguf_" + std::to_string(::getpid()) + "_" + tag + ".gguf")) {}
  ~scratch_file() {
    std::error_code ec;
    fs::remove(path_, ec);
  }
  const fs::path& write(const std::string& bytes) const {
    std::ofstream out(path_, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path_;
  }
  [[nodiscard]] const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Little-endian GGUF byte builder for hand-made (often broken) files.
struct gguf_bytes {
  std::string b;
  gguf_bytes& raw(std::string_view s) {
    b.append(s);
    return *this;
  }
  gguf_bytes& u8(uint8_t v) {
    b.push_back(static_cast<char>(v));
    return *this;
  }
  gguf_bytes& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) u8(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  gguf_bytes& u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) u8(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  gguf_bytes& str(std::string_view s) {
    u64(s.size());
    return raw(s);
  }
  gguf_bytes& header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    return raw("GGUF").u32(version).u64(n_tensors).u64(n_kv);
  }
  gguf_bytes& kv_string(std::string_view key, std::string_view value) {
    return str(key).u32(8).str(value);
  }
  gguf_bytes& kv_u32(std::string_view key, uint32_t value) { return str(key).u32(4).u32(value); }
  gguf_bytes& tensor(std::string_view name, std::vector<uint64_t> shape, uint32_t type,
                     uint64_t offset) {
    str(name).u32(static_cast<uint32_t>(shape.size()));
    for (auto d : shape) u64(d);
    return u32(type).u64(offset);
  }
  gguf_bytes& pad(std::size_t alignment = 32) {
    while (b.size() % alignment) u8(0);
    return *this;
  }
  gguf_bytes& zeros(std::size_t n) {
    b.append(n, '\0');
    return *this;
  }
};

// One valid file: an architecture key and one F32 tensor [8] (32 bytes of data).
std::string small_valid_file() {
  gguf_bytes g;
  g.header(1, 1)
      .kv_string("general.architecture", "duet_fixture")
      .tensor("t", {8}, 0, 0)
      .pad()
      .zeros(32);
  return g.b;
}

// GPT-2 byte-level alphabet: the code point each byte is written as in vocab entries.
std::vector<int> byte_to_codepoint() {
  std::vector<int> map(256, -1);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable =
        (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    map[b] = printable ? b : next++;
  }
  return map;
}

// Decodes the byte-level form of a vocab entry back to the bytes it stands for.
std::string byte_level_decode(const std::string& token) {
  static const std::vector<int> forward = byte_to_codepoint();
  std::string out;
  for (std::size_t i = 0; i < token.size();) {
    const auto c = static_cast<unsigned char>(token[i]);
    int cp = 0;
    int len = 1;
    if (c < 0x80) {
      cp = c;
    } else if ((c >> 5) == 6) {
      cp = c & 0x1F;
      len = 2;
    } else if ((c >> 4) == 14) {
      cp = c & 0x0F;
      len = 3;
    } else {
      cp = c & 0x07;
      len = 4;
    }
    for (int k = 1; k < len; ++k)
      cp = (cp << 6) | (static_cast<unsigned char>(token[i + k]) & 0x3F);
    i += static_cast<std::size_t>(len);
    const auto it = std::find(forward.begin(), forward.end(), cp);
    REQUIRE_MESSAGE(it != forward.end(), "code point ", cp, " is not in the byte-level alphabet");
    out.push_back(static_cast<char>(it - forward.begin()));
  }
  return out;
}

std::string detokenize(const duet::tokenizer_spec& spec, const std::vector<int32_t>& ids) {
  std::string out;
  for (const int32_t id : ids) {
    REQUIRE(id >= 0);
    REQUIRE(static_cast<std::size_t>(id) < spec.vocab.size());
    const auto added = std::find_if(spec.added.begin(), spec.added.end(),
                                    [&](const auto& a) { return a.id == id; });
    out += added != spec.added.end() ? added->content
                                     : byte_level_decode(spec.vocab[static_cast<std::size_t>(id)]);
  }
  return out;
}

// Compares a metadata value with its JSON description {type, value, element_type}.
void check_value(const duet::gguf_value& v, const json& want, const std::string& where) {
  INFO(where);
  const std::string type = want.at("type");
  REQUIRE(std::string(duet::gguf_value_type_name(v.type())) == type);
  const json& x = want.at("value");
  using t = duet::gguf_value_type;
  switch (v.type()) {
    case t::u8:
    case t::u16:
    case t::u32:
    case t::u64:
      CHECK(v.as_u64() == x.get<uint64_t>());
      break;
    case t::i8:
    case t::i16:
    case t::i32:
    case t::i64:
      CHECK(v.as_i64() == x.get<int64_t>());
      break;
    case t::f32:
      CHECK(std::get<float>(v.data) == x.get<float>());
      break;
    case t::f64:
      CHECK(std::get<double>(v.data) == x.get<double>());
      break;
    case t::boolean:
      CHECK(v.as_bool() == x.get<bool>());
      break;
    case t::string:
      CHECK(v.as_string() == x.get<std::string>());
      break;
    case t::array: {
      const auto& arr = v.as_array();
      const std::string elem = want.at("element_type");
      CHECK(std::string(duet::gguf_value_type_name(arr.type)) == elem);
      REQUIRE(arr.items.size() == x.size());
      for (std::size_t i = 0; i < arr.items.size(); ++i) {
        const json item = elem == "array" ? x[i] : json{{"type", elem}, {"value", x[i]}};
        check_value(arr.items[i], item, where + "[" + std::to_string(i) + "]");
      }
      break;
    }
  }
}

// Checks one dequant_reference.json entry against `file`.
void check_dequant_entry(const duet::gguf_file& file, const json& entry) {
  const std::string name = entry.at("tensor");
  INFO("file ", file.path().string(), " tensor ", name, " (", entry.at("type").get<std::string>(),
       ")");
  const duet::gguf_tensor t = file.tensor(name);
  CHECK(std::string(duet::ggml_type_name(t.info->type)) == entry.at("type").get<std::string>());
  CHECK(t.info->shape == entry.at("shape").get<std::vector<uint64_t>>());
  CHECK(t.info->n_bytes == entry.at("n_bytes").get<uint64_t>());
  for (const json& span : entry.at("spans")) {
    const auto first = span.at("first_element").get<uint64_t>();
    const auto n = span.at("n_elements").get<std::size_t>();
    const auto offset = span.at("byte_offset").get<std::size_t>();
    const std::vector<std::byte> raw = from_hex(span.at("raw"));
    const auto want = span.at("bits").get<std::vector<uint32_t>>();
    INFO("span at element ", first);
    REQUIRE(offset + raw.size() <= t.data.size());
    // The file holds the bytes gguf-py read at this place (the offsets agree) ...
    CHECK(std::equal(raw.begin(), raw.end(), t.data.begin() + static_cast<std::ptrdiff_t>(offset)));
    // ... and they dequantize to exactly gguf-py's floats.
    std::vector<float> got(n);
    duet::dequantize_into(t.info->type, raw, got);
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (bits_of(got[i]) != want[i]) {
        if (++mismatches <= 5) {
          MESSAGE("element ", first + i, ": got ", got[i], " (0x", std::hex, bits_of(got[i]),
                  ") want 0x", want[i], std::dec);
        }
      }
    }
    CHECK(mismatches == 0);
  }
  const std::vector<float> all = duet::dequantize(t);
  REQUIRE(all.size() == t.info->n_elements);
  CHECK(std::to_string(weighted_sum(all)) == entry.at("weighted_sum").get<std::string>());
  // Row-wise decoding gives the same floats as the whole tensor.
  const uint64_t rows = t.info->n_rows();
  const uint64_t len = t.info->row_length();
  for (const uint64_t row : {uint64_t{0}, rows / 2, rows - 1}) {
    std::vector<float> one(len);
    duet::dequantize_row(t, row, one);
    CHECK(std::memcmp(one.data(), all.data() + row * len, len * sizeof(float)) == 0);
  }
  const std::vector<float> tail = duet::dequantize_rows(t, rows - 1, 1);
  CHECK(std::memcmp(tail.data(), all.data() + (rows - 1) * len, len * sizeof(float)) == 0);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_CASE("ggml type table has ggml's block sizes and names") {
  using duet::ggml_type;
  CHECK(duet::ggml_type_get(ggml_type::q4_0).block_size == 32);
  CHECK(duet::ggml_type_get(ggml_type::q4_0).type_size == 18);
  CHECK(duet::ggml_type_get(ggml_type::q4_1).type_size == 20);
  CHECK(duet::ggml_type_get(ggml_type::q8_0).type_size == 34);
  CHECK(duet::ggml_type_get(ggml_type::q4_k).block_size == 256);
  CHECK(duet::ggml_type_get(ggml_type::q4_k).type_size == 144);
  CHECK(duet::ggml_type_get(ggml_type::q6_k).type_size == 210);
  CHECK(duet::ggml_type_get(ggml_type::bf16).type_size == 2);
  CHECK(duet::ggml_type_name(ggml_type::iq2_xxs) == "IQ2_XXS");
  CHECK(duet::ggml_type_find(4) == nullptr);  // Q4_2, removed from ggml
  CHECK(duet::ggml_type_find(40) == nullptr);
  CHECK(duet::ggml_type_bytes(ggml_type::q4_k, 512) == 288);
  CHECK_THROWS_AS((void)duet::ggml_type_bytes(ggml_type::q4_0, 33), std::runtime_error);
}

TEST_CASE("fp16 and bf16 convert to float exactly, for every bit pattern") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = duet::ggml_fp16_to_fp32(static_cast<uint16_t>(h));
    const bool negative = (h & 0x8000u) != 0;
    const uint32_t exp = (h >> 10) & 0x1F;
    const uint32_t mant = h & 0x3FF;
    if (exp == 0x1F) {
      if (mant == 0) {
        CHECK(got == (negative ? -INFINITY : INFINITY));
      } else {
        CHECK(std::isnan(got));
        CHECK(bits_of(got) ==
              (((h & 0x8000u) << 16) | 0x7F800000u | (mant << 13)));  // payload kept
      }
      continue;
    }
    const double magnitude =
        exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, static_cast<int>(exp) - 25);
    const double want = negative ? -magnitude : magnitude;
    if (static_cast<double>(got) != want || std::signbit(got) != negative) {
      FAIL_CHECK("fp16 0x" << std::hex << h << ": got " << got << " want " << want);
    }
  }
  for (uint32_t h = 0; h < 65536; ++h) {
    CHECK(bits_of(duet::ggml_bf16_to_fp32(static_cast<uint16_t>(h))) == h << 16);
  }
}

TEST_CASE("every supported tensor type dequantizes bit for bit as gguf-py does (synthetic files)") {
  const json ref = load_json(data_dir / "dequant_reference.json");
  std::vector<std::string> types;
  for (const json& entry : ref.at("tensors")) {
    const std::string file = entry.at("file");
    if (file.rfind("models/", 0) == 0) continue;
    const duet::gguf_file f(data_dir / file);
    check_dequant_entry(f, entry);
    types.push_back(entry.at("type"));
  }
  std::sort(types.begin(), types.end());
  CHECK(types ==
        std::vector<std::string>{"BF16", "F16", "F32", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"});
}

TEST_CASE("the SmolLM2 file's F32, Q8_0 and Q4_1 tensors dequantize bit for bit as gguf-py does") {
  require_model();
  const json ref = load_json(data_dir / "dequant_reference.json");
  const duet::gguf_file f(model_path);
  int checked = 0;
  for (const json& entry : ref.at("tensors")) {
    if (entry.at("file").get<std::string>().rfind("models/", 0) != 0) continue;
    check_dequant_entry(f, entry);
    ++checked;
  }
  CHECK(checked == 5);
}

TEST_CASE(
    "metadata of every value type, nested arrays and general.alignment read back as written") {
  const json ref = load_json(data_dir / "metadata_reference.json").at("synth_metadata.gguf");
  const duet::gguf_file f(data_dir / "synth_metadata.gguf");
  CHECK(f.version() == 3);
  CHECK(f.alignment() == ref.at("alignment").get<uint64_t>());
  CHECK(f.data_offset() % 64 == 0);
  const json& want = ref.at("metadata");
  REQUIRE(f.metadata().size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    const std::string key = want[i].at("key");
    CHECK(f.metadata()[i].key == key);  // file order is kept
    const duet::gguf_value* v = f.find(key);
    REQUIRE_MESSAGE(v != nullptr, key);
    check_value(*v, want[i], key);
  }
  // Typed getters convert between widths and name the key when they cannot.
  CHECK(f.get_u64("duet.u8") == 200);
  CHECK(f.get_i64("duet.u32") == 4000000000);
  CHECK(f.get_f64("duet.i16") == -30000.0);
  CHECK(f.get_f64("duet.f32") == -1.25);
  CHECK(f.find_u64("no.such.key") == std::nullopt);
  CHECK(f.find_string("no.such.key") == nullptr);
  CHECK(contains(message_of([&] { (void)f.get_u64("duet.i8"); }), "metadata key 'duet.i8'"));
  CHECK(contains(message_of([&] { (void)f.get_string("duet.u8"); }),
                 "expected a string, found uint8"));
  CHECK(contains(message_of([&] { (void)f.get_i64("duet.u64"); }), "does not fit int64"));
  CHECK(contains(message_of([&] { (void)f.at("no.such.key"); }),
                 "missing metadata key 'no.such.key'"));
  CHECK(contains(message_of([&] { (void)f.at("no.such.key"); }), "synth_metadata.gguf"));
  CHECK(f.at("duet.array_nested").to_string() == "[[1, 2], [3], [4, 5, 6]]");

  // Tensors are padded to the alignment and read back exactly.
  for (const json& t : ref.at("tensors")) {
    const duet::gguf_tensor_info* info = f.find_tensor(t.at("name").get<std::string>());
    REQUIRE(info != nullptr);
    CHECK(info->shape == t.at("shape").get<std::vector<uint64_t>>());
    CHECK(info->offset == t.at("offset").get<uint64_t>());
  }
  CHECK(duet::dequantize(f.tensor("first")) == std::vector<float>{0, 1, 2});
  const std::vector<float> second = duet::dequantize(f.tensor("second"));
  REQUIRE(second.size() == 10);
  for (int i = 0; i < 10; ++i)
    CHECK(second[static_cast<std::size_t>(i)] == 0.5f * static_cast<float>(i));
  CHECK(duet::dequantize_rows(f.tensor("second"), 1, 1) ==
        std::vector<float>{2.5f, 3, 3.5f, 4, 4.5f});
  CHECK(contains(message_of([&] { (void)duet::dequantize_rows(f.tensor("second"), 1, 2); }),
                 "out of range"));
  CHECK(contains(message_of([&] { (void)f.tensor("nope"); }), "no tensor 'nope'"));
}

TEST_CASE("the SmolLM2 file's metadata maps to its model config") {
  require_model();
  const duet::gguf_file f(model_path);
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.tensors().size() == 272);
  CHECK(f.metadata().size() == 33);
  const duet::gguf_model_config c = duet::gguf_read_model_config(f);
  CHECK(c.arch == "llama");
  CHECK(c.n_layers == 30);
  CHECK(c.hidden == 576);
  CHECK(c.n_heads == 9);
  CHECK(c.n_kv_heads == 3);
  CHECK(c.head_dim == 64);
  CHECK(c.rope_dim == 64);
  CHECK(c.ffn == 1536);
  CHECK(c.vocab == 49152);
  CHECK(c.rope_theta == 100000.0f);
  CHECK(c.rms_eps == 1e-5f);
  CHECK(c.context_length == 8192);
  CHECK(c.tied_embeddings);
  CHECK_FALSE(c.attn_qkv_bias);
  CHECK_FALSE(c.rope_freq_factors);
  CHECK_FALSE(c.rope_scaling.has_value());
  CHECK(c.token_embd_type == duet::ggml_type::q8_0);
  CHECK(f.find_tensor("blk.29.ffn_down.weight") != nullptr);
  CHECK(f.find_tensor("blk.0.attn_k.weight")->shape == std::vector<uint64_t>{576, 192});
}

TEST_CASE("the SmolLM2 tokenizer spec agrees with llama.cpp") {
  require_model();
  const json ref = load_json(data_dir / "llama_cpp_reference.json");
  const duet::gguf_file f(model_path);
  const duet::tokenizer_spec spec = duet::gguf_read_tokenizer(f);
  const json& vocab = ref.at("vocab");
  CHECK(spec.vocab.size() == 49152);
  CHECK(spec.vocab.size() == vocab.at("n_vocab").get<std::size_t>());
  REQUIRE(spec.bos_id.has_value());
  REQUIRE(spec.eos_id.has_value());
  CHECK(*spec.bos_id == vocab.at("bos_id").get<int32_t>());
  CHECK(*spec.eos_id == vocab.at("eos_id").get<int32_t>());
  CHECK(spec.add_bos == vocab.at("add_bos").get<bool>());
  CHECK(spec.pre_tokenizer == "smollm");
  CHECK(spec.normalizer.empty());
  CHECK(spec.merges.size() == 48900);
  CHECK(spec.merges.front() == std::pair<std::string, std::string>{"Ġ", "t"});
  CHECK(spec.vocab[1] == "<|im_start|>");
  CHECK(spec.chat_template.rfind("{% for message in messages %}", 0) == 0);
  // The 17 control tokens <|endoftext|> ... <empty_output> are the added, special tokens.
  REQUIRE(spec.added.size() == 17);
  for (std::size_t i = 0; i < spec.added.size(); ++i) {
    CHECK(spec.added[i].id == static_cast<int32_t>(i));
    CHECK(spec.added[i].special);
    CHECK(spec.added[i].content == spec.vocab[i]);
  }
  // Ids are in the order llama.cpp uses: its token ids for the corpus decode back to the text
  // through our vocab (plain byte-level decoding; no tokenizer involved).
  for (const json& item : ref.at("text_corpus")) {
    const std::string text = item.at("text");
    CHECK(detokenize(spec, item.at("ids").get<std::vector<int32_t>>()) == text);
  }
  for (const json& chat : ref.at("chat")) {
    CHECK(detokenize(spec, chat.at("prompt_ids").get<std::vector<int32_t>>()) ==
          chat.at("rendered").get<std::string>());
  }
}

TEST_CASE(
    "a qwen2 file maps to config and tokenizer, with rope scaling, q bias and user-defined "
    "tokens") {
  const json ref = load_json(data_dir / "metadata_reference.json").at("synth_qwen2.gguf");
  const duet::gguf_file f(data_dir / "synth_qwen2.gguf");
  const json& w = ref.at("config");
  const duet::gguf_model_config c = duet::gguf_read_model_config(f);
  CHECK(c.arch == w.at("arch").get<std::string>());
  CHECK(c.name == w.at("name").get<std::string>());
  CHECK(c.n_layers == w.at("n_layers").get<uint32_t>());
  CHECK(c.hidden == w.at("hidden").get<uint32_t>());
  CHECK(c.n_heads == w.at("n_heads").get<uint32_t>());
  CHECK(c.n_kv_heads == w.at("n_kv_heads").get<uint32_t>());
  CHECK(c.head_dim == w.at("head_dim").get<uint32_t>());
  CHECK(c.ffn == w.at("ffn").get<uint32_t>());
  CHECK(c.vocab == w.at("vocab").get<uint32_t>());
  CHECK(c.rope_dim == w.at("rope_dim").get<uint32_t>());
  CHECK(c.rope_theta == w.at("rope_theta").get<float>());
  CHECK(c.rms_eps == w.at("rms_eps").get<float>());
  CHECK(c.context_length == w.at("context_length").get<uint64_t>());
  CHECK(c.tied_embeddings == w.at("tied_embeddings").get<bool>());
  CHECK(c.attn_qkv_bias == w.at("attn_qkv_bias").get<bool>());
  CHECK(c.rope_freq_factors == w.at("rope_freq_factors").get<bool>());
  REQUIRE(c.rope_scaling.has_value());
  CHECK(c.rope_scaling->type == w.at("rope_scaling").at("type").get<std::string>());
  CHECK(c.rope_scaling->factor == w.at("rope_scaling").at("factor").get<float>());
  CHECK(c.rope_scaling->original_context_length ==
        w.at("rope_scaling").at("original_context_length").get<uint64_t>());

  const json& tw = ref.at("tokenizer");
  const duet::tokenizer_spec spec = duet::gguf_read_tokenizer(f);
  CHECK(spec.vocab == tw.at("vocab").get<std::vector<std::string>>());
  REQUIRE(spec.merges.size() == tw.at("merges").size());
  for (std::size_t i = 0; i < spec.merges.size(); ++i) {
    CHECK(spec.merges[i].first == tw.at("merges")[i][0].get<std::string>());
    CHECK(spec.merges[i].second == tw.at("merges")[i][1].get<std::string>());
  }
  REQUIRE(spec.added.size() == tw.at("added").size());
  for (std::size_t i = 0; i < spec.added.size(); ++i) {
    CHECK(spec.added[i].id == tw.at("added")[i].at("id").get<int32_t>());
    CHECK(spec.added[i].content == tw.at("added")[i].at("content").get<std::string>());
    CHECK(spec.added[i].special == tw.at("added")[i].at("special").get<bool>());
  }
  CHECK(spec.bos_id == tw.at("bos_id").get<int32_t>());
  CHECK(spec.eos_id == tw.at("eos_id").get<int32_t>());
  CHECK(spec.add_bos == tw.at("add_bos").get<bool>());  // absent key: llama.cpp's default for qwen2
  CHECK(spec.pre_tokenizer == tw.at("pre_tokenizer").get<std::string>());
  CHECK_FALSE(spec.chat_template.empty());
}

TEST_CASE("an unsupported architecture or tokenizer model is refused by name") {
  const duet::gguf_file f(data_dir / "synth_f32.gguf");
  const std::string arch = message_of([&] { (void)duet::gguf_read_model_config(f); });
  CHECK(contains(arch, "architecture 'duet_fixture' is not supported"));
  CHECK(contains(arch, "synth_f32.gguf"));
  CHECK(contains(message_of([&] { (void)duet::gguf_read_tokenizer(f); }),
                 "missing metadata key 'tokenizer.ggml.model'"));

  scratch_file s("spm");
  gguf_bytes g;
  g.header(0, 2)
      .kv_string("general.architecture", "llama")
      .kv_string("tokenizer.ggml.model", "llama");
  const duet::gguf_file spm(s.write(g.b));
  CHECK(contains(message_of([&] { (void)duet::gguf_read_tokenizer(spm); }),
                 "tokenizer model 'llama' is not supported"));
  CHECK(contains(message_of([&] { (void)duet::gguf_read_model_config(spm); }),
                 "missing metadata key 'llama.block_count'"));
}

TEST_CASE(
    "a tensor type outside the supported list is parsed but refused at dequantization, by name") {
  scratch_file s("q5k");
  gguf_bytes g;
  g.header(1, 0).tensor("blk.0.ffn_up.weight", {256, 2}, 13 /* Q5_K */, 0).pad().zeros(2 * 176);
  const duet::gguf_file f(s.write(g.b));
  REQUIRE(f.tensors().size() == 1);
  CHECK(f.tensors()[0].type == duet::ggml_type::q5_k);
  CHECK(f.tensors()[0].n_bytes == 352);
  const std::string msg =
      message_of([&] { (void)duet::dequantize(f.tensor("blk.0.ffn_up.weight")); });
  CHECK(contains(msg, "tensor type Q5_K is not supported"));
  CHECK(contains(msg, "blk.0.ffn_up.weight"));
}

TEST_CASE("malformed files are refused with errors naming the file and the culprit") {
  scratch_file s("bad");
  const auto error_of = [&](const std::string& bytes) {
    s.write(bytes);
    return message_of([&] { duet::gguf_file f(s.path()); });
  };
  const std::string file = s.path().filename().string();

  SUBCASE("truncated header") {
    const std::string e = error_of("GGU");
    CHECK(contains(e, file));
    CHECK(contains(e, "truncated"));
    CHECK(contains(error_of(std::string("GGUF\x03\0\0\0\x01\0", 10)),
                   "header (tensor count): truncated"));
  }
  SUBCASE("bad magic") {
    gguf_bytes g;
    g.raw("GGML").u32(3).u64(0).u64(0);
    const std::string e = error_of(g.b);
    CHECK(contains(e, "bad magic 'GGML'"));
    CHECK(contains(e, file));
  }
  SUBCASE("unsupported versions") {
    CHECK(contains(error_of(gguf_bytes{}.header(0, 0, 1).b), "version 1 is not supported"));
    CHECK(contains(error_of(gguf_bytes{}.header(0, 0, 4).b), "unsupported GGUF version 4"));
    CHECK(contains(error_of(gguf_bytes{}.header(0, 0, 0x03000000).b), "big-endian"));
    CHECK_NOTHROW(duet::gguf_file(s.write(gguf_bytes{}.header(0, 0, 2).b)));
  }
  SUBCASE("empty, missing and non-regular files") {
    CHECK(contains(error_of(""), "empty file"));
    CHECK(contains(message_of([] { duet::gguf_file f("/nonexistent/x.gguf"); }), "cannot open"));
    CHECK(contains(message_of([] { duet::gguf_file f(DUET_TEST_DATA); }), "not a regular file"));
  }
  SUBCASE("impossible counts") {
    CHECK(contains(error_of(gguf_bytes{}.header(0, uint64_t{1} << 40).b), "metadata count"));
    CHECK(contains(error_of(gguf_bytes{}.header(uint64_t{1} << 40, 0).b), "tensor count"));
  }
  SUBCASE("a string running past the end names its key") {
    gguf_bytes g;
    g.header(0, 1).str("general.name").u32(8).u64(1000).raw("short");
    const std::string e = error_of(g.b);
    CHECK(contains(e, "metadata key 'general.name'"));
    CHECK(contains(e, "runs past the end of the file"));
  }
  SUBCASE("unknown metadata value type names its key") {
    gguf_bytes g;
    g.header(0, 1).str("duet.weird").u32(13).u32(0);
    CHECK(contains(error_of(g.b), "metadata key 'duet.weird': unknown value type 13"));
  }
  SUBCASE("a huge array count names its key") {
    gguf_bytes g;
    g.header(0, 1).str("tokenizer.ggml.tokens").u32(9).u32(8).u64(uint64_t{1} << 62);
    const std::string e = error_of(g.b);
    CHECK(contains(e, "metadata key 'tokenizer.ggml.tokens'"));
    CHECK(contains(e, "runs past the end"));
  }
  SUBCASE("arrays nested too deep") {
    gguf_bytes g;
    g.header(0, 1).str("duet.deep").u32(9);
    for (int i = 0; i < 40; ++i) g.u32(9).u64(1);
    g.u32(0).u64(0);
    CHECK(contains(error_of(g.b), "nested deeper"));
  }
  SUBCASE("a bool that is neither 0 nor 1") {
    gguf_bytes g;
    g.header(0, 1).str("duet.flag").u32(7).u8(2);
    CHECK(contains(error_of(g.b), "metadata key 'duet.flag': invalid bool value 2"));
  }
  SUBCASE("duplicate keys and tensor names") {
    gguf_bytes g;
    g.header(0, 2).kv_u32("a", 1).kv_u32("a", 2);
    CHECK(contains(error_of(g.b), "metadata key 'a': duplicate key"));
    gguf_bytes h;
    h.header(2, 0).tensor("t", {8}, 0, 0).tensor("t", {8}, 0, 32).pad().zeros(64);
    CHECK(contains(error_of(h.b), "tensor 't': duplicate tensor name"));
  }
  SUBCASE("general.alignment must be a power of two") {
    gguf_bytes g;
    g.header(0, 1).kv_u32("general.alignment", 48);
    CHECK(contains(error_of(g.b), "'general.alignment': 48 is not a power of two"));
  }
  SUBCASE("tensor data past the end of the file") {
    const std::string valid = small_valid_file();
    CHECK_NOTHROW(duet::gguf_file(s.write(valid)));
    const std::string e = error_of(valid.substr(0, valid.size() - 4));
    CHECK(contains(e, "tensor 't'"));
    CHECK(contains(e, "runs past the end of the file"));
    // And in a real file written by gguf-py, cut short.
    const std::string q4 = read_file(data_dir / "synth_q4_0.gguf");
    const std::string e2 = error_of(q4.substr(0, q4.size() - 1));
    CHECK(contains(e2, "tensor 'weight' (Q4_0, shape [256, 4])"));
    CHECK(contains(e2, "runs past the end of the file"));
  }
  SUBCASE("unknown tensor type") {
    gguf_bytes g;
    g.header(1, 0).tensor("blk.0.attn_q.weight", {32}, 99, 0).pad().zeros(64);
    CHECK(contains(error_of(g.b), "tensor 'blk.0.attn_q.weight': unknown tensor type id 99"));
    gguf_bytes removed;
    removed.header(1, 0).tensor("w", {32}, 4 /* Q4_2, removed */, 0).pad().zeros(64);
    CHECK(contains(error_of(removed.b), "tensor 'w': unknown tensor type id 4"));
  }
  SUBCASE("bad tensor shapes and offsets") {
    gguf_bytes dims;
    dims.header(1, 0).str("t").u32(5);
    for (int i = 0; i < 5; ++i) dims.u64(1);
    dims.u32(0).u64(0).pad().zeros(32);
    CHECK(contains(error_of(dims.b), "tensor 't': 5 dimensions"));
    gguf_bytes rows;
    rows.header(1, 0).tensor("t", {33, 2}, 2 /* Q4_0 */, 0).pad().zeros(64);
    CHECK(contains(error_of(rows.b), "tensor 't': type Q4_0 needs rows that are a multiple of 32"));
    gguf_bytes misaligned;
    misaligned.header(1, 0).tensor("t", {8}, 0, 4).pad().zeros(64);
    CHECK(contains(error_of(misaligned.b),
                   "tensor 't': data offset 4 is not a multiple of the alignment 32"));
    gguf_bytes overflow;
    overflow.header(1, 0).tensor("t", {uint64_t{1} << 40, uint64_t{1} << 40}, 0, 0).pad();
    CHECK(contains(error_of(overflow.b), "tensor 't': shape"));
  }
}

TEST_CASE("every truncation and random corruption of a real file throws or parses, never crashes") {
  scratch_file s("fuzz");
  for (const char* name : {"synth_metadata.gguf", "synth_qwen2.gguf", "synth_q4_k.gguf"}) {
    const std::string bytes = read_file(data_dir / name);
    const duet::gguf_file whole(data_dir / name);
    INFO(name);
    // Every cut inside the header, metadata and tensor infos fails cleanly, and so does any cut
    // of the tensor data of the last tensor.
    for (std::size_t n = 0; n < bytes.size(); ++n) {
      s.write(bytes.substr(0, n));
      bool threw = false;
      try {
        duet::gguf_file f(s.path());
      } catch (const std::runtime_error& e) {
        threw = true;
        if (!contains(e.what(), s.path().filename().string()))
          FAIL_CHECK("no file name in: " << e.what());
      }
      if (!threw && n < whole.data_offset()) FAIL_CHECK("a cut at " << n << " bytes parsed");
    }
    // Random byte flips: a parse either succeeds (and then every tensor decodes or is refused
    // cleanly) or throws std::runtime_error.
    std::mt19937 rng(12345);
    for (int iter = 0; iter < 300; ++iter) {
      std::string damaged = bytes;
      const int flips = 1 + static_cast<int>(rng() % 4);
      for (int k = 0; k < flips; ++k) {
        damaged[rng() % whole.data_offset()] = static_cast<char>(rng() & 0xFF);
      }
      s.write(damaged);
      try {
        const duet::gguf_file f(s.path());
        for (const auto& t : f.tensors()) {
          try {
            (void)duet::dequantize_rows(f.tensor(t), 0, std::min<uint64_t>(t.n_rows(), 1));
          } catch (const std::runtime_error&) {
          }
        }
        try {
          (void)duet::gguf_read_model_config(f);
        } catch (const std::runtime_error&) {
        }
        try {
          (void)duet::gguf_read_tokenizer(f);
        } catch (const std::runtime_error&) {
        }
      } catch (const std::runtime_error&) {
      }
    }
  }
}

TEST_CASE("a gguf_file can be moved and its tensor views stay valid") {
  duet::gguf_file a(data_dir / "synth_q8_0.gguf");
  const std::vector<float> before = duet::dequantize(a.tensor("weight"));
  duet::gguf_file b(std::move(a));
  CHECK(duet::dequantize(b.tensor("weight")) == before);
  duet::gguf_file c(data_dir / "synth_f32.gguf");
  c = std::move(b);
  CHECK(c.path().filename() == "synth_q8_0.gguf");
  CHECK(duet::dequantize(c.tensor("weight")) == before);
}
