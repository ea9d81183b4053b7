// The CPU reference engine and what it stands on: safetensors, HF config parsing, RoPE tables,
// paged attention, the sampler, random checkpoints, and agreement with Hugging Face
// transformers on the same weights (tests/data/hf-fixtures/, made by
// tests/tools/make_hf_fixtures.py). docs/cpu-engine.md explains the method and tolerances.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "runtime/cpu_engine.hpp"
#include "runtime/hf_model.hpp"
#include "runtime/random_checkpoint.hpp"
#include "runtime/safetensors.hpp"
#include "runtime/sampler.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace duet;

namespace {

const fs::path fixture_dir = fs::path(DUET_TEST_DATA) / "hf-fixtures";

// A directory under the system temp dir, removed with everything in it.
struct temp_dir {
  fs::path path;
  temp_dir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() / ("duet-cpu-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
};

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// ------------------------------------------------------------------ tiny checkpoints, once each

random_checkpoint_params tiny_params(const std::string& arch) {
  random_checkpoint_params p;
  p.arch = arch;
  p.size = "tiny";
  p.seed = 1;
  p.dtype = "bf16";
  p.norm_stddev = 0.1;  // norms other than 1, so a mixed-up norm shows
  return p;
}

struct tiny_model {
  temp_dir dir;
  std::shared_ptr<const model_weights> weights;
};

const tiny_model& tiny(const std::string& arch) {
  static std::map<std::string, std::unique_ptr<tiny_model>> models;
  auto& m = models[arch];
  if (!m) {
    m = std::make_unique<tiny_model>();
    (void)write_random_checkpoint(m->dir.path, tiny_params(arch));
    m->weights = std::make_shared<const model_weights>(load_hf_model(m->dir.path));
  }
  return *m;
}

cpu_engine make_tiny_engine(const std::string& arch, uint32_t threads = 2, uint32_t kv_blocks = 512) {
  cpu_engine_params p;
  p.served_name = "tiny-" + arch;
  p.kv_blocks = kv_blocks;
  p.block_tokens = 16;
  p.max_context = 4096;
  p.threads = threads;
  return cpu_engine(tiny(arch).weights, p);
}

std::vector<uint32_t> block_range(uint32_t first, uint32_t count) {
  std::vector<uint32_t> b(count);
  std::iota(b.begin(), b.end(), first);
  return b;
}

std::vector<int32_t> random_tokens(std::size_t n, uint32_t seed, int32_t vocab = 128000) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, vocab - 1);
  std::vector<int32_t> out(n);
  for (auto& t : out) t = dist(rng);
  return out;
}

struct prefill_result {
  int32_t token;
  std::vector<float> logits;
};

// Prefills `tokens` as sequence `seq` in chunks of `chunk` tokens.
prefill_result prefill_in_chunks(cpu_engine& e, uint64_t seq, std::span<const int32_t> tokens,
                                 std::span<const uint32_t> blocks, std::size_t chunk,
                                 const msg::sampling_params* sampling = nullptr) {
  prefill_result r{};
  for (std::size_t start = 0; start < tokens.size(); start += chunk) {
    const std::size_t n = std::min(chunk, tokens.size() - start);
    prefill_chunk c;
    c.seq_id = seq;
    c.tokens = tokens.subspan(start, n);
    c.start = static_cast<uint32_t>(start);
    c.blocks = blocks;
    c.last = start + n == tokens.size();
    c.sampling = sampling;
    const step_output out = e.prefill(std::span(&c, 1));
    if (c.last) {
      REQUIRE(out.tokens.size() == 1);
      r.token = out.tokens[0];
      r.logits.assign(e.last_logits(0).begin(), e.last_logits(0).end());
    } else {
      REQUIRE(out.tokens.empty());
    }
  }
  return r;
}

prefill_result decode_one(cpu_engine& e, uint64_t seq, std::span<const int32_t> history, std::span<const uint32_t> blocks,
                          const msg::sampling_params* sampling = nullptr) {
  decode_slot s{seq, history, blocks, sampling};
  const step_output out = e.decode(std::span(&s, 1));
  REQUIRE(out.tokens.size() == 1);
  return {out.tokens[0], std::vector<float>(e.last_logits(0).begin(), e.last_logits(0).end())};
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Units in the last place between two floats of the same sign.
int64_t ulp_distance(float a, float b) {
  return std::abs(static_cast<int64_t>(std::bit_cast<int32_t>(a)) - static_cast<int64_t>(std::bit_cast<int32_t>(b)));
}

void write_raw_safetensors(const fs::path& path, const std::string& header, std::size_t data_bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t n = header.size();
  char size[8];
  for (int i = 0; i < 8; ++i) size[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out.write(size, 8);
  out << header;
  out << std::string(data_bytes, '\0');
}

st_write_entry float_entry(const std::string& name, st_dtype type, std::vector<uint64_t> shape, std::vector<float> values) {
  const uint32_t element = st_dtype_size(type);
  return {name, type, std::move(shape), [values, type, element](uint64_t first, std::span<std::byte> out) {
            for (std::size_t i = 0; i < out.size() / element; ++i) {
              const float v = values[first + i];
              if (type == st_dtype::f32) {
                std::memcpy(out.data() + i * 4, &v, 4);
              } else {
                const uint16_t h = type == st_dtype::bf16 ? float_to_bf16(v) : float_to_f16(v);
                std::memcpy(out.data() + i * 2, &h, 2);
              }
            }
          }};
}

}  // namespace

// =================================================================================== safetensors

TEST_CASE("safetensors: F32, BF16 and F16 tensors written by the writer read back as floats") {
  temp_dir dir;
  const fs::path file = dir.path / "t.safetensors";
  const std::vector<float> a = {1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, -7.0f};
  const std::vector<float> b = {1.0f, 0.5f, -0.375f, 2.0f};           // exact in bf16
  const std::vector<float> c = {1.0f, 0x1p-24f, -65504.0f, 0.099975586f};  // exact in f16
  std::vector<st_write_entry> entries = {float_entry("b", st_dtype::bf16, {2, 2}, b),
                                         float_entry("a", st_dtype::f32, {2, 3}, a),
                                         float_entry("c", st_dtype::f16, {4}, c)};
  write_safetensors(file, entries, {{"format", "pt"}});

  const safetensors_file f(file);
  CHECK(f.metadata().at("format") == "pt");
  REQUIRE(f.tensors().size() == 3);
  CHECK(f.tensors()[0].name == "a");  // sorted by name, laid out in that order
  CHECK(f.at("a").begin == 0);
  CHECK(f.at("b").begin == 24);
  CHECK(f.at("c").begin == 32);
  CHECK(f.at("b").dtype == st_dtype::bf16);
  CHECK(f.read_floats("a", std::vector<uint64_t>{2, 3}) == a);
  CHECK(f.read_floats("b") == b);
  CHECK(f.read_floats("c") == c);
  // The header is padded to a multiple of 8 and the data follows it directly.
  CHECK(safetensors_header(entries, {{"format", "pt"}}).size() % 8 == 0);
  CHECK(f.file_size() == safetensors_header(entries, {{"format", "pt"}}).size() + 24 + 8 + 8);
}

TEST_CASE("float_to_bf16 and float_to_f16 round to nearest even and keep specials") {
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  CHECK(float_to_bf16(1.0f + 0x1p-8f) == 0x3f80);          // tie: to even
  CHECK(float_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82);      // tie: to even (up)
  CHECK(float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  CHECK(float_to_bf16(-INFINITY) == 0xff80);
  CHECK(float_to_f16(1.0f) == 0x3c00);
  CHECK(float_to_f16(65504.0f) == 0x7bff);
  CHECK(float_to_f16(65519.0f) == 0x7bff);
  CHECK(float_to_f16(65520.0f) == 0x7c00);   // rounds to infinity
  CHECK(float_to_f16(0x1p-24f) == 0x0001);   // smallest subnormal
  CHECK(float_to_f16(0x1p-25f) == 0x0000);   // tie: to even (zero)
  CHECK(float_to_f16(3 * 0x1p-25f) == 0x0002);
  CHECK(float_to_f16(-0.0f) == 0x8000);
  CHECK(std::isnan(f16_to_float(float_to_f16(NAN))));
  for (float v : {0.1f, -3.14159f, 1e-5f, 6.1e-5f, 1000.5f}) {
    CHECK(f16_to_float(float_to_f16(v)) == doctest::Approx(v).epsilon(1e-3));
  }
  for (uint32_t h = 0; h < 0x10000; ++h) {  // every finite half round-trips exactly
    if ((h & 0x7c00) == 0x7c00) continue;
    REQUIRE(float_to_f16(f16_to_float(static_cast<uint16_t>(h))) == h);
  }
}

TEST_CASE("safetensors: malformed files are refused with an error naming the file and the tensor") {
  temp_dir dir;
  const fs::path p = dir.path / "bad.safetensors";
  auto open_error = [&] { return error_of([&] { safetensors_file f(p); }); };

  {
    std::ofstream(p, std::ios::binary) << "abc";
    const std::string e = open_error();
    CHECK(e.find(p.string()) != std::string::npos);
    CHECK(e.find("truncated file") != std::string::npos);
  }
  {  // the size field claims more header than the file holds
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    const char size[8] = {0x00, 0x10, 0, 0, 0, 0, 0, 0};
    out.write(size, 8);
    out << "{}";
  }
  CHECK(open_error().find("truncated file") != std::string::npos);
  write_raw_safetensors(p, "{not json", 0);
  CHECK(open_error().find("not valid JSON") != std::string::npos);
  write_raw_safetensors(p, R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8);
  {
    const std::string e = open_error();
    CHECK(e.find("tensor 'w'") != std::string::npos);
    CHECK(e.find("past the data section") != std::string::npos);
  }
  write_raw_safetensors(p, R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", 16);
  CHECK(open_error().find("which takes 12") != std::string::npos);
  write_raw_safetensors(p, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 16);
  CHECK(open_error().find("'a' and 'b' overlap") != std::string::npos);
  write_raw_safetensors(p, R"({"w":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}})", 4);
  CHECK(open_error().find("unknown dtype 'F99'") != std::string::npos);
  write_raw_safetensors(p, R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4);
  CHECK(open_error().find("not a non-negative integer") != std::string::npos);
  write_raw_safetensors(p, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8);
  CHECK(open_error().find("run backwards") != std::string::npos);
  write_raw_safetensors(p, R"([1,2])", 0);
  CHECK(open_error().find("not a JSON object") != std::string::npos);

  // A valid file: conversions and lookups that must fail.
  write_raw_safetensors(p, R"({"i":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[16,32]}})", 32);
  const safetensors_file f(p);
  CHECK(error_of([&] { (void)f.read_floats("i"); }).find("tensor 'i': unsupported dtype I64") != std::string::npos);
  CHECK(error_of([&] { (void)f.read_floats("x"); }).find("missing tensor 'x'") != std::string::npos);
  const std::string shape_error = error_of([&] { (void)f.read_floats("w", std::vector<uint64_t>{4}); });
  CHECK(shape_error.find("tensor 'w': wrong shape [2, 2], expected [4]") != std::string::npos);
  CHECK(shape_error.find(p.string()) != std::string::npos);
}

TEST_CASE("safetensors: a sharded checkpoint opens through its index, and a bad index is refused") {
  temp_dir dir;
  std::vector<st_write_entry> entries;
  for (int i = 0; i < 5; ++i) {
    entries.push_back(float_entry("t" + std::to_string(i), st_dtype::f32, {64}, std::vector<float>(64, float(i))));
  }
  const auto files = write_safetensors_checkpoint(dir.path, entries, 600);  // 256 bytes each: 2 per shard
  REQUIRE(files.size() == 4);
  CHECK(files[0].filename() == "model-00001-of-00003.safetensors");
  CHECK(files.back().filename() == "model.safetensors.index.json");
  const safetensors_checkpoint ckpt(dir.path);
  CHECK(ckpt.shard_count() == 3);
  CHECK(ckpt.names().size() == 5);
  CHECK(ckpt.read_floats("t4")[63] == 4.0f);
  CHECK(ckpt.file_of("t4").path().filename() == "model-00003-of-00003.safetensors");

  // Writing a single-file checkpoint into the same directory replaces the shards and the index.
  (void)write_safetensors_checkpoint(dir.path, entries, 1u << 20);
  CHECK(safetensors_checkpoint(dir.path).shard_count() == 1);
  CHECK(!fs::exists(dir.path / "model.safetensors.index.json"));

  (void)write_safetensors_checkpoint(dir.path, entries, 600);
  json index = json::parse(std::ifstream(dir.path / "model.safetensors.index.json"));
  index["weight_map"]["t0"] = "model-00002-of-00003.safetensors";
  std::ofstream(dir.path / "model.safetensors.index.json") << index.dump();
  CHECK(error_of([&] { safetensors_checkpoint c(dir.path); }).find("tensor 't0' is mapped to model-00002-of-00003.safetensors") !=
        std::string::npos);
  fs::remove(dir.path / "model-00002-of-00003.safetensors");
  CHECK(error_of([&] { safetensors_checkpoint c(dir.path); }).find("model-00002-of-00003.safetensors: cannot open") !=
        std::string::npos);
  CHECK(error_of([&] { safetensors_checkpoint c(dir.path / "nowhere"); }).find("no such file") != std::string::npos);
}

// ======================================================================================== config

namespace {

// config.json of deepseek-ai/DeepSeek-R1-Distill-Llama-8B, as published.
const char* r1_llama_8b_config = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// config.json of deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B, as published.
const char* r1_qwen_1_5b_config = R"({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 1536,
  "initializer_range": 0.02,
  "intermediate_size": 8960,
  "max_position_embeddings": 131072,
  "max_window_layers": 21,
  "model_type": "qwen2",
  "num_attention_heads": 12,
  "num_hidden_layers": 28,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000,
  "sliding_window": 4096,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.44.0",
  "use_cache": true,
  "use_mrope": false,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// transformers' _compute_llama3_parameters for the R1-Distill-Llama-8B config (head_dim 128),
// computed with numpy op by op in float32 as torch evaluates it, from correctly rounded powers
// (torch's own, with SLEEF's 1-ulp powf, is in tests/data/hf-fixtures/rope_llama3_8b.json).
// Entries 29..34 are the smoothed band, below it the frequencies are kept, above divided by 8.
const float llama3_8b_inv_freq[64] = {
    1.000000000e+00f, 8.146172166e-01f, 6.636012793e-01f, 5.405809879e-01f, 4.403666258e-01f, 3.587302268e-01f,
    2.922278345e-01f, 2.380538136e-01f, 1.939227581e-01f, 1.579728127e-01f, 1.286873817e-01f, 1.048309505e-01f,
    8.539710194e-02f, 6.956595182e-02f, 5.666961893e-02f, 4.616405070e-02f, 3.760603070e-02f, 3.063452058e-02f,
    2.495540865e-02f, 2.032910474e-02f, 1.656044088e-02f, 1.349041983e-02f, 1.098952908e-02f, 8.952259086e-03f,
    7.292665076e-03f, 5.940730684e-03f, 4.839421250e-03f, 3.942275885e-03f, 3.211446106e-03f, 2.166570630e-03f,
    1.371893683e-03f, 8.567514597e-04f, 5.248460220e-04f, 3.126936499e-04f, 1.785077911e-04f, 9.556212171e-05f,
    7.784655463e-05f, 6.341514381e-05f, 5.165906987e-05f, 4.208236714e-05f, 3.428102355e-05f, 2.792590931e-05f,
    2.274892904e-05f, 1.853166941e-05f, 1.509621779e-05f, 1.229763893e-05f, 1.001786859e-05f, 8.160727702e-06f,
    6.647869668e-06f, 5.415469332e-06f, 4.411534519e-06f, 3.593711881e-06f, 2.927499736e-06f, 2.384791742e-06f,
    1.942692506e-06f, 1.582550794e-06f, 1.289173156e-06f, 1.050182618e-06f, 8.554969213e-07f, 6.969025321e-07f,
    5.677088097e-07f, 4.624653798e-07f, 3.767322596e-07f, 3.068925878e-07f};

}  // namespace

TEST_CASE("config: the published R1-Distill-Llama-8B config.json parses to its shape") {
  const transformer_config c = parse_hf_config(r1_llama_8b_config, "llama8b/config.json");
  CHECK(c.arch == "llama");
  CHECK(c.hidden_size == 4096);
  CHECK(c.intermediate_size == 14336);
  CHECK(c.num_hidden_layers == 32);
  CHECK(c.num_attention_heads == 32);
  CHECK(c.num_key_value_heads == 8);
  CHECK(c.head_dim == 128);
  CHECK(c.vocab_size == 128256);
  CHECK(c.max_position_embeddings == 131072);
  CHECK(c.rms_norm_eps == 1e-5);
  CHECK(c.rope_theta == 500000.0);
  REQUIRE(c.rope_scaling);
  CHECK(c.rope_scaling->rope_type == "llama3");
  CHECK(c.rope_scaling->factor == 8.0);
  CHECK(c.rope_scaling->low_freq_factor == 1.0);
  CHECK(c.rope_scaling->high_freq_factor == 4.0);
  CHECK(c.rope_scaling->original_max_position_embeddings == 8192);
  CHECK(!c.tie_word_embeddings);
  CHECK(!c.qkv_bias);
  CHECK(!c.o_bias);
  CHECK(c.bos_token_id == 128000);
  CHECK(c.eos_token_ids == std::vector<int32_t>{128001});
  CHECK(c.torch_dtype == "bfloat16");
}

TEST_CASE("config: the published R1-Distill-Qwen-1.5B config.json parses, with q/k/v biases") {
  const transformer_config c = parse_hf_config(r1_qwen_1_5b_config, "qwen/config.json");
  CHECK(c.arch == "qwen2");
  CHECK(c.hidden_size == 1536);
  CHECK(c.num_attention_heads == 12);
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.head_dim == 128);  // hidden / heads
  CHECK(c.intermediate_size == 8960);
  CHECK(c.vocab_size == 151936);
  CHECK(c.rope_theta == 10000.0);  // an integer in the file
  CHECK(!c.rope_scaling);
  CHECK(c.qkv_bias);
  CHECK(!c.o_bias);
  CHECK(c.rms_norm_eps == 1e-6);
  CHECK(c.eos_token_ids == std::vector<int32_t>{151643});
}

TEST_CASE("config: eos lists, an explicit head_dim, rope_scaling 'type' and transformers 5 rope_parameters") {
  json j = json::parse(r1_llama_8b_config);
  j["eos_token_id"] = {128001, 128008, 128009};
  j["head_dim"] = 64;
  j["rope_scaling"].erase("rope_type");
  j["rope_scaling"]["type"] = "llama3";
  transformer_config c = parse_hf_config(j.dump(), "x");
  CHECK(c.eos_token_ids == std::vector<int32_t>{128001, 128008, 128009});
  CHECK(c.head_dim == 64);
  CHECK(c.q_dim() == 2048);
  CHECK(c.rope_scaling->rope_type == "llama3");

  j = json::parse(r1_llama_8b_config);
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0},
                          {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                          {"original_max_position_embeddings", 8192}};
  c = parse_hf_config(j.dump(), "x");
  CHECK(c.rope_theta == 500000.0);
  CHECK(c.rope_scaling->factor == 8.0);

  j = json::parse(r1_llama_8b_config);
  j["rope_scaling"] = nullptr;
  j["attention_bias"] = true;
  c = parse_hf_config(j.dump(), "x");
  CHECK(!c.rope_scaling);
  CHECK(c.qkv_bias);
  CHECK(c.o_bias);
}

TEST_CASE("config: unsupported architectures and features are refused by name") {
  auto error_for = [](const std::function<void(json&)>& edit) {
    json j = json::parse(r1_llama_8b_config);
    edit(j);
    return error_of([&] { (void)parse_hf_config(j.dump(), "m/config.json"); });
  };
  std::string e = error_for([](json& j) { j["architectures"] = {"MistralForCausalLM"}; });
  CHECK(e.find("m/config.json") != std::string::npos);
  CHECK(e.find("architecture 'MistralForCausalLM' is not supported") != std::string::npos);
  CHECK(error_for([](json& j) { j.erase("hidden_size"); }).find("key 'hidden_size': missing") != std::string::npos);
  CHECK(error_for([](json& j) { j["hidden_size"] = "big"; }).find("key 'hidden_size': expected an integer") !=
        std::string::npos);
  CHECK(error_for([](json& j) { j["rope_scaling"]["rope_type"] = "yarn"; }).find("rope scaling type 'yarn'") !=
        std::string::npos);
  CHECK(error_for([](json& j) { j["rope_scaling"].erase("low_freq_factor"); }).find("key 'low_freq_factor': missing") !=
        std::string::npos);
  CHECK(error_for([](json& j) { j["hidden_act"] = "gelu"; }).find("activation 'gelu'") != std::string::npos);
  CHECK(error_for([](json& j) { j["mlp_bias"] = true; }).find("mlp_bias") != std::string::npos);
  CHECK(error_for([](json& j) { j["num_key_value_heads"] = 5; }).find("not a multiple of num_key_value_heads") !=
        std::string::npos);
  CHECK(error_for([](json& j) { j["eos_token_id"] = 200000; }).find("outside the vocabulary") != std::string::npos);
  CHECK(error_of([] { (void)parse_hf_config("{", "c.json"); }).find("not valid JSON") != std::string::npos);
  CHECK(error_of([] { (void)load_hf_config("/nonexistent/model"); }).find("no such file or directory") != std::string::npos);
}

TEST_CASE("config: hf_config_json writes a config that parses back to the same values") {
  for (const char* text : {r1_llama_8b_config, r1_qwen_1_5b_config}) {
    transformer_config a = parse_hf_config(text, "a");
    a.eos_token_ids = {7, 9};
    const transformer_config b = parse_hf_config(hf_config_json(a), "b");
    CHECK(b.arch == a.arch);
    CHECK(b.hidden_size == a.hidden_size);
    CHECK(b.head_dim == a.head_dim);
    CHECK(b.num_key_value_heads == a.num_key_value_heads);
    CHECK(b.rms_norm_eps == a.rms_norm_eps);
    CHECK(b.rope_theta == a.rope_theta);
    CHECK(b.rope_scaling.has_value() == a.rope_scaling.has_value());
    CHECK(b.qkv_bias == a.qkv_bias);
    CHECK(b.eos_token_ids == a.eos_token_ids);
    CHECK(b.bos_token_id == a.bos_token_id);
  }
}

// ========================================================================================= RoPE

TEST_CASE("rope: llama3 inverse frequencies equal transformers' _compute_llama3_parameters") {
  const transformer_config c = parse_hf_config(r1_llama_8b_config, "x");
  const std::vector<float> inv = rope_inv_freq(c);
  REQUIRE(inv.size() == 64);
  for (std::size_t i = 0; i < 64; ++i) {
    INFO("i = " << i << ": " << inv[i] << " vs " << llama3_8b_inv_freq[i]);
    CHECK(inv[i] == llama3_8b_inv_freq[i]);
  }
  // The three regimes: high frequencies kept, low ones divided by the factor, a smooth band.
  CHECK(inv[0] == 1.0f);
  CHECK(inv[63] == doctest::Approx(std::pow(500000.0, -126.0 / 128) / 8).epsilon(1e-6));
  if (fs::exists(fixture_dir / "rope_llama3_8b.json")) {  // torch's own values
    const json hf = json::parse(std::ifstream(fixture_dir / "rope_llama3_8b.json"));
    const auto ref = hf.at("inv_freq").get<std::vector<float>>();
    REQUIRE(ref.size() == 64);
    // torch's powf (SLEEF, 1 ulp) may round a power differently; the llama3 arithmetic after
    // it may carry that to 2 ulp.
    for (std::size_t i = 0; i < 64; ++i) CHECK(ulp_distance(inv[i], ref[i]) <= 2);
    // torch's cos/sin tables hold cos(float32(inv_freq * position)).
    const auto positions = hf.at("positions").get<std::vector<uint32_t>>();
    for (std::size_t k = 0; k < positions.size(); ++k) {
      const auto cos_row = hf.at("cos")[k].get<std::vector<float>>();
      const auto sin_row = hf.at("sin")[k].get<std::vector<float>>();
      for (std::size_t i = 0; i < 64; ++i) {
        const float angle = ref[i] * static_cast<float>(positions[k]);
        CHECK(std::abs(cos_row[i] - std::cos(double(angle))) < 2e-7);
        CHECK(std::abs(sin_row[i] - std::sin(double(angle))) < 2e-7);
      }
    }
  }
}

TEST_CASE("rope: default frequencies, and cos/sin tables hold float32(inv_freq * position)") {
  const transformer_config c = parse_hf_config(r1_qwen_1_5b_config, "x");
  const std::vector<float> inv = rope_inv_freq(c);
  const float expected[8] = {1.000000000e+00f, 8.659643531e-01f, 7.498942018e-01f, 6.493816376e-01f,
                             5.623413324e-01f, 4.869675338e-01f, 4.216965139e-01f, 3.651741445e-01f};
  for (int i = 0; i < 8; ++i) CHECK(inv[i] == expected[i]);

  const rope_table table(c, 5000);
  CHECK(table.positions() == 5000);
  CHECK(table.half() == 64);
  for (uint32_t pos : {0u, 1u, 17u, 4999u}) {
    for (uint32_t i : {0u, 5u, 63u}) {
      const float angle = inv[i] * static_cast<float>(pos);
      CHECK(table.cos(pos)[i] == static_cast<float>(std::cos(static_cast<double>(angle))));
      CHECK(table.sin(pos)[i] == static_cast<float>(std::sin(static_cast<double>(angle))));
    }
  }
  // apply() is x * cos + rotate_half(x) * sin, with pairs (i, i + half).
  std::vector<float> x(128), y(128);
  std::mt19937 rng(3);
  std::normal_distribution<float> dist;
  for (auto& v : x) v = dist(rng);
  y = x;
  table.apply(y.data(), 0);
  CHECK(y == x);
  table.apply(y.data(), 1234);
  for (uint32_t i = 0; i < 64; ++i) {
    CHECK(y[i] == x[i] * table.cos(1234)[i] + (-x[i + 64]) * table.sin(1234)[i]);
    CHECK(y[i + 64] == x[i + 64] * table.cos(1234)[i] + x[i] * table.sin(1234)[i]);
  }
}

// ==================================================================================== attention

TEST_CASE("paged attention equals dense causal attention for random shapes and block tables") {
  const char* forced = std::getenv("DUET_CPU_KERNELS");
  if (forced && std::string(forced) == "generic") CHECK(std::string(cpu_engine::kernel_name()) == "generic");
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  struct shape {
    uint32_t layers, heads, kv_heads, head_dim, block_tokens, start, tokens;
  };
  for (const shape s : {shape{1, 4, 4, 8, 4, 0, 9}, shape{2, 8, 2, 16, 16, 5, 1}, shape{3, 6, 3, 12, 7, 30, 11},
                        shape{2, 4, 1, 64, 16, 100, 33}, shape{1, 2, 2, 130, 3, 0, 1}}) {
    CAPTURE(s.heads);
    CAPTURE(s.head_dim);
    CAPTURE(s.block_tokens);
    const kv_block_layout layout = kv_block_layout::make(s.layers, s.kv_heads, s.head_dim, s.block_tokens);
    CHECK(layout.block_bytes % 256 == 0);
    CHECK(layout.block_bytes >= 2ull * s.layers * s.kv_heads * s.head_dim * s.block_tokens * 4);
    const uint32_t length = s.start + s.tokens;
    const uint32_t n_blocks = (length + s.block_tokens - 1) / s.block_tokens;
    // A shuffled table over a pool with spare blocks.
    std::vector<uint32_t> table(n_blocks + 3);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    table.resize(n_blocks);
    std::vector<float> pool(layout.block_floats() * (n_blocks + 3), NAN);  // poison: unused bytes are NaN
    const uint32_t layer = s.layers - 1;
    std::vector<float> keys(std::size_t{length} * s.kv_heads * s.head_dim), values(keys.size());
    for (auto& v : keys) v = normal(rng);
    for (auto& v : values) v = normal(rng);
    for (uint32_t p = 0; p < length; ++p) {
      for (uint32_t h = 0; h < s.kv_heads; ++h) {
        for (uint32_t kv = 0; kv < 2; ++kv) {
          float* dst = pool.data() + table[p / s.block_tokens] * layout.block_floats() +
                       layout.offset(layer, kv, h, p % s.block_tokens);
          const auto& src = kv == 0 ? keys : values;
          std::copy_n(&src[(std::size_t{p} * s.kv_heads + h) * s.head_dim], s.head_dim, dst);
        }
      }
    }
    std::vector<float> q(std::size_t{s.tokens} * s.heads * s.head_dim), out(q.size(), NAN);
    for (auto& v : q) v = normal(rng);
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    paged_attention_params p{q.data(), out.data(), pool.data(), layout, table.data(), layer, s.heads, s.start, scale};
    std::vector<float> scratch(length);
    for (uint32_t t = 0; t < s.tokens; ++t) {
      for (uint32_t h = 0; h < s.heads; ++h) paged_attention(p, t, h, scratch.data());
    }
    // Dense reference in double.
    const uint32_t group = s.heads / s.kv_heads;
    double worst = 0;
    for (uint32_t t = 0; t < s.tokens; ++t) {
      for (uint32_t h = 0; h < s.heads; ++h) {
        const uint32_t g = h / group;
        const uint32_t n = s.start + t + 1;
        std::vector<double> w(n);
        double max_w = -1e300, sum = 0;
        for (uint32_t j = 0; j < n; ++j) {
          double d = 0;
          for (uint32_t i = 0; i < s.head_dim; ++i) {
            d += double(q[(std::size_t{t} * s.heads + h) * s.head_dim + i]) *
                 keys[(std::size_t{j} * s.kv_heads + g) * s.head_dim + i];
          }
          w[j] = d * scale;
          max_w = std::max(max_w, w[j]);
        }
        for (auto& v : w) sum += (v = std::exp(v - max_w));
        for (uint32_t i = 0; i < s.head_dim; ++i) {
          double o = 0;
          for (uint32_t j = 0; j < n; ++j) o += w[j] / sum * values[(std::size_t{j} * s.kv_heads + g) * s.head_dim + i];
          const float got = out[(std::size_t{t} * s.heads + h) * s.head_dim + i];
          REQUIRE(!std::isnan(got));
          worst = std::max(worst, std::abs(got - o));
        }
      }
    }
    CHECK(worst < 2e-5);
  }
}

TEST_CASE("worker_pool runs every task exactly once and rethrows a task's exception") {
  worker_pool pool(3);
  CHECK(pool.size() == 3);
  std::vector<std::atomic<int>> hits(1000);
  std::atomic<unsigned> max_worker{0};
  pool.run(hits.size(), [&](std::size_t t, unsigned worker) {
    hits[t]++;
    unsigned seen = max_worker.load();
    while (worker > seen && !max_worker.compare_exchange_weak(seen, worker)) {
    }
  });
  for (auto& h : hits) CHECK(h.load() == 1);
  CHECK(max_worker.load() < 3);
  CHECK_THROWS_WITH_AS(pool.run(50, [](std::size_t t, unsigned) { if (t == 17) throw std::runtime_error("task 17"); }),
                       "task 17", std::runtime_error);
  std::atomic<int> after{0};
  pool.run(10, [&](std::size_t, unsigned) { after++; });
  CHECK(after.load() == 10);
}

// ====================================================================================== sampler

TEST_CASE("sampler: greedy takes the first maximum; no params means greedy") {
  sampler s;
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  CHECK(s.sample(logits, nullptr, {}, 0, 0).token == 1);
  msg::sampling_params p;  // temperature 0
  CHECK(s.sample(logits, &p, {}, 0, 0).token == 1);
  p.top_k = 1;
  p.temperature = 1.0f;
  CHECK(s.sample(logits, &p, {}, 5, 9).token == 1);  // ties at the k-th are kept: 1 or 3
  std::set<int32_t> seen;
  for (uint64_t pos = 0; pos < 64; ++pos) seen.insert(s.sample(logits, &p, {}, 5, pos).token);
  CHECK(seen == std::set<int32_t>{1, 3});
}

TEST_CASE("sampler: the same seed and position give the same token; draws follow the softmax") {
  sampler s;
  msg::sampling_params p;
  p.temperature = 1.0f;
  const std::vector<float> logits = {0.0f, std::log(2.0f), std::log(3.0f), std::log(4.0f)};  // probs 0.1..0.4
  std::vector<int32_t> a, b, c;
  for (uint64_t pos = 0; pos < 200; ++pos) {
    a.push_back(s.sample(logits, &p, {}, 11, pos).token);
    b.push_back(s.sample(logits, &p, {}, 11, pos).token);
    c.push_back(s.sample(logits, &p, {}, 12, pos).token);
  }
  CHECK(a == b);
  CHECK(a != c);
  CHECK(sampler_uniform(11, 5) == sampler_uniform(11, 5));
  CHECK(sampler_uniform(11, 5) != sampler_uniform(11, 6));
  // The seed of a sequence: the request's when it has one, else one derived from the id.
  p.seed = 99;
  p.has_seed = true;
  CHECK(sampler_seed(&p, 1) == 99);
  CHECK(sampler_seed(&p, 2) == 99);
  p.has_seed = false;
  CHECK(sampler_seed(&p, 1) != sampler_seed(&p, 2));
  CHECK(sampler_seed(nullptr, 1) == sampler_seed(&p, 1));

  std::vector<int> counts(4);
  const int n = 20000;
  for (int pos = 0; pos < n; ++pos) counts[s.sample(logits, &p, {}, 3, pos).token]++;
  for (int t = 0; t < 4; ++t) {
    const double expected = n * (t + 1) / 10.0;
    CHECK(std::abs(counts[t] - expected) < 4 * std::sqrt(expected));
  }
  // Temperature sharpens: at 0.25 the top token's share is 4^4 / (1 + 16 + 81 + 256).
  p.temperature = 0.25f;
  int top = 0;
  for (int pos = 0; pos < n; ++pos) top += s.sample(logits, &p, {}, 4, pos).token == 3;
  CHECK(std::abs(top - n * 256.0 / 354.0) < 4 * std::sqrt(n * 0.2));
}

TEST_CASE("sampler: top-k, top-p and min-p keep exactly the tokens Hugging Face keeps") {
  sampler s;
  const std::vector<float> logits = {std::log(0.05f), std::log(0.5f), std::log(0.15f), std::log(0.3f)};
  auto support = [&](const msg::sampling_params& p) {
    std::set<int32_t> seen;
    for (uint64_t pos = 0; pos < 400; ++pos) seen.insert(s.sample(logits, &p, {}, 1, pos).token);
    return seen;
  };
  msg::sampling_params p;
  p.temperature = 1.0f;
  CHECK(support(p) == std::set<int32_t>{0, 1, 2, 3});
  p.top_k = 2;
  CHECK(support(p) == std::set<int32_t>{1, 3});
  p.top_k = 0;
  p.top_p = 0.7f;  // 0.5 before token 3 is under 0.7: keep; 0.8 before token 2 is not
  CHECK(support(p) == std::set<int32_t>{1, 3});
  p.top_p = 0.45f;  // HF removes tokens whose ascending cumulative mass is <= 1 - top_p
  CHECK(support(p) == std::set<int32_t>{1});
  p.top_p = 0.85f;
  CHECK(support(p) == std::set<int32_t>{1, 2, 3});
  p.top_p = 1.0f;
  p.min_p = 0.4f;  // threshold 0.2: 0.5 and 0.3 stay
  CHECK(support(p) == std::set<int32_t>{1, 3});
  p.min_p = 0.25f;  // threshold 0.125
  CHECK(support(p) == std::set<int32_t>{1, 2, 3});
  p.min_p = 5.0f;  // over 1: only the top token
  CHECK(support(p) == std::set<int32_t>{1});
  p.min_p = 0.0f;
  p.top_k = 3;
  p.top_p = 0.6f;  // over the top-3 (renormalised 0.5/0.95, ...): 0.526 before token 3 is under 0.6
  CHECK(support(p) == std::set<int32_t>{1, 3});

  // top-p over a large vocabulary (the sorted prefix must grow): exactly the smallest set.
  std::vector<float> big(5000);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = -static_cast<float>(i) * 0.001f;
  double total = 0;
  for (float l : big) total += std::exp(double(l));
  msg::sampling_params q;
  q.temperature = 1.0f;
  q.top_p = 0.9f;
  double before = 0;
  std::size_t keep = 0;
  while (before < 0.9 * total) before += std::exp(double(big[keep++]));
  int32_t largest = 0;
  for (uint64_t pos = 0; pos < 3000; ++pos) largest = std::max(largest, s.sample(big, &q, {}, 2, pos).token);
  CHECK(largest < static_cast<int32_t>(keep));
  CHECK(largest > static_cast<int32_t>(keep) * 9 / 10);
}

TEST_CASE("sampler: repetition penalty has HF semantics; frequency and presence penalties OpenAI's") {
  sampler s;
  msg::sampling_params p;
  p.repetition_penalty = 2.0f;
  std::vector<float> logits = {2.0f, -2.0f, 1.0f, 0.5f};
  const std::vector<int32_t> context = {0, 1, 1, 1, 7000 /* out of range: ignored */};
  s.apply_penalties(logits, p, context);
  CHECK(logits == std::vector<float>{1.0f, -4.0f, 1.0f, 0.5f});  // once per token, whatever the count
  // Penalised token 0 (now 1.0) ties with token 2: greedy keeps the first.
  CHECK(s.sample(std::vector<float>{2.0f, -2.0f, 1.0f, 0.5f}, &p, context, 0, 0).token == 0);
  p.repetition_penalty = 4.0f;
  CHECK(s.sample(std::vector<float>{2.0f, -2.0f, 1.0f, 0.5f}, &p, context, 0, 0).token == 2);

  msg::sampling_params q;
  q.frequency_penalty = 0.5f;
  q.presence_penalty = 0.25f;
  logits = {1.0f, 1.0f, 1.0f};
  s.apply_penalties(logits, q, std::vector<int32_t>{0, 0, 2});
  CHECK(logits == std::vector<float>{1.0f - 1.0f - 0.25f, 1.0f, 1.0f - 0.5f - 0.25f});
}

TEST_CASE("sampler: log-probabilities are log_softmax of the raw logits, top-N most likely first") {
  sampler s;
  msg::sampling_params p;
  p.temperature = 0.7f;
  p.repetition_penalty = 1.3f;
  p.top_logprobs = 3;
  const std::vector<float> logits = {0.1f, 3.0f, -1.0f, 2.5f, 2.5f};
  const sample_result r = s.sample(logits, &p, std::vector<int32_t>{1}, 8, 2);
  double lse = 0;
  for (float l : logits) lse += std::exp(double(l));
  lse = std::log(lse);
  CHECK(r.logprob == doctest::Approx(logits[r.token] - lse).epsilon(1e-6));
  REQUIRE(r.top.size() == 3);
  CHECK(r.top[0].token == 1);
  CHECK(r.top[1].token == 3);  // tie with 4: lower id first
  CHECK(r.top[2].token == 4);
  CHECK(r.top[0].logprob == doctest::Approx(3.0 - lse).epsilon(1e-6));
  CHECK(r.top[1].logprob == r.top[2].logprob);
  p.top_logprobs = 0;
  CHECK(s.sample(logits, &p, {}, 8, 2).top.empty());
}

TEST_CASE("load_hf_model_shared: one copy per directory while held, by any spelling of its path") {
  temp_dir dir;
  (void)write_random_checkpoint(dir.path, tiny_params("llama"));
  auto first = load_hf_model_shared(dir.path);
  auto same = load_hf_model_shared(dir.path / "." / ".." / dir.path.filename());
  CHECK(first.get() == same.get());
  std::vector<std::shared_ptr<const model_weights>> seen(4);
  std::vector<std::thread> threads;
  for (auto& slot : seen) threads.emplace_back([&] { slot = load_hf_model_shared(dir.path); });
  for (auto& t : threads) t.join();
  for (const auto& w : seen) CHECK(w.get() == first.get());
  std::weak_ptr<const model_weights> gone = first;
  first.reset();
  same.reset();
  seen.clear();
  CHECK(gone.expired());  // freed with its last holder, not kept by the registry
  auto again = load_hf_model_shared(dir.path);
  CHECK(again->config.hidden_size == 64);
  CHECK(error_of([&] { (void)load_hf_model_shared(dir.path / "missing"); }) != "(no error)");
}

// ============================================================================ random checkpoints

TEST_CASE("random checkpoints: real shapes by default, tiny preset, overrides, tokenizer copied") {
  random_checkpoint_params p;
  transformer_config c = random_checkpoint_config(p);
  CHECK(c.num_hidden_layers == 32);
  CHECK(c.hidden_size == 4096);
  CHECK(c.num_attention_heads == 32);
  CHECK(c.num_key_value_heads == 8);
  CHECK(c.head_dim == 128);
  CHECK(c.intermediate_size == 14336);
  CHECK(c.vocab_size == 128256);
  CHECK(c.rope_theta == 500000.0);
  REQUIRE(c.rope_scaling);
  CHECK(c.rope_scaling->factor == 8.0);
  CHECK(c.rope_scaling->original_max_position_embeddings == 8192);
  p.arch = "qwen2";
  c = random_checkpoint_config(p);
  CHECK(c.num_hidden_layers == 28);
  CHECK(c.hidden_size == 1536);
  CHECK(c.num_attention_heads == 12);
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.intermediate_size == 8960);
  CHECK(c.vocab_size == 151936);
  CHECK(c.rope_theta == 10000.0);
  CHECK(c.qkv_bias);
  CHECK(!c.tie_word_embeddings);
  p.size = "tiny";
  c = random_checkpoint_config(p);
  CHECK(c.num_hidden_layers == 2);
  CHECK(c.hidden_size == 64);
  CHECK(c.vocab_size == 151936);
  p.overrides.vocab = 1000;  // eos/bos ids beyond the vocabulary are dropped
  CHECK(random_checkpoint_config(p).eos_token_ids.empty());
  p.arch = "gpt2";
  CHECK(error_of([&] { (void)random_checkpoint_config(p); }).find("unknown arch 'gpt2'") != std::string::npos);
  p.arch = "llama";
  p.dtype = "q4";
  CHECK(error_of([&] { (void)random_checkpoint_config(p); }).find("unknown dtype 'q4'") != std::string::npos);

  temp_dir dir;
  shape_overrides o;
  o.layers = 1;
  o.hidden = 32;
  o.heads = 2;
  o.kv_heads = 1;
  o.ffn = 48;
  o.vocab = 300;
  o.tie_word_embeddings = true;
  const fs::path tokenizers = fs::path(DUET_TEST_DATA) / "tokenizers" / "llama3_1";
  const auto r = write_random_checkpoint(dir.path, "llama", o, 5, "f32", tokenizers);
  CHECK(r.weight_bytes == 4ull * (300 * 32 + 32 + 32 * 32 + 16 * 32 * 2 + 32 * 32 + 32 + 48 * 32 * 3 + 32));
  CHECK(fs::exists(dir.path / "tokenizer.json"));
  CHECK(fs::exists(dir.path / "tokenizer_config.json"));
  const model_weights w = load_hf_model(dir.path);
  CHECK(w.lm_head.empty());
  CHECK(&w.output_weights() == &w.embedding);
  CHECK(w.layers[0].input_norm == std::vector<float>(32, 1.0f));  // norms are 1, as HF initialises them
  double sum = 0, sum2 = 0;
  for (float v : w.embedding) {
    sum += v;
    sum2 += double(v) * v;
  }
  CHECK(std::abs(sum / w.embedding.size()) < 0.002);
  CHECK(std::sqrt(sum2 / w.embedding.size()) == doctest::Approx(0.02).epsilon(0.05));
  CHECK(w.embedding[17] == random_tensor_value(random_tensor_key(5, "model.embed_tokens.weight"), 17, 0.0, 0.02));
}

TEST_CASE("loading refuses a checkpoint with a missing or misshapen tensor, naming it") {
  temp_dir dir;
  random_checkpoint_params p = tiny_params("qwen2");
  p.overrides.vocab = 256;
  (void)write_random_checkpoint(dir.path, p);
  const transformer_config c = load_hf_config(dir.path);
  auto rewrite_without = [&](const std::string& drop, const std::string& reshape) {
    std::vector<st_write_entry> entries;
    for (const auto& spec : hf_tensor_specs(c)) {
      if (spec.name == drop) continue;
      auto shape = spec.shape;
      if (spec.name == reshape) shape[0] += 1;
      entries.push_back({spec.name, st_dtype::bf16, shape, nullptr});
    }
    (void)write_safetensors_checkpoint(dir.path, entries, 1u << 30);
  };
  rewrite_without("model.layers.1.self_attn.k_proj.bias", "");
  std::string e = error_of([&] { (void)load_hf_model(dir.path); });
  CHECK(e.find("missing tensor 'model.layers.1.self_attn.k_proj.bias'") != std::string::npos);
  CHECK(e.find(dir.path.string()) != std::string::npos);
  rewrite_without("", "model.layers.0.mlp.up_proj.weight");
  e = error_of([&] { (void)load_hf_model(dir.path); });
  CHECK(e.find("tensor 'model.layers.0.mlp.up_proj.weight': wrong shape [129, 64], expected [128, 64]") !=
        std::string::npos);
  CHECK(e.find("model.safetensors") != std::string::npos);
}

// ======================================================================================== engine

TEST_CASE("engine_info: vocabulary, eos ids, context, block bytes and layout hash") {
  const cpu_engine e = make_tiny_engine("llama");
  const engine_info& info = e.info();
  CHECK(info.engine == "cpu");
  CHECK(info.model == "tiny-llama");
  CHECK(info.vocab_size == 128256);
  CHECK(info.eos_ids == std::vector<int32_t>{128001});
  CHECK(info.max_context == 4096);
  CHECK(info.block_tokens == 16);
  CHECK(info.block_bytes == 2ull * 2 * 2 * 16 * 16 * 4);  // layers * K/V * kv_heads * head_dim * tokens * f32
  CHECK(info.block_bytes % 256 == 0);
  CHECK(info.layout_hash == layout_hash("tiny-llama", "f32", 2, 2, 16, 16));
  CHECK(make_tiny_engine("qwen2").info().eos_ids == std::vector<int32_t>{151643});
}

TEST_CASE("chunked prefill with chunks of 1, 7 and 2048 tokens gives the logits of a one-shot prefill") {
  cpu_engine e = make_tiny_engine("llama");
  const auto prompt = random_tokens(2100, 1);
  const auto blocks = block_range(0, 132);
  const prefill_result whole = prefill_in_chunks(e, 1, prompt, blocks, prompt.size());
  for (std::size_t chunk : {std::size_t{1}, std::size_t{7}, std::size_t{2048}}) {
    CAPTURE(chunk);
    const prefill_result part = prefill_in_chunks(e, 2, prompt, block_range(200, 132), chunk);
    CHECK(part.token == whole.token);
    CHECK(bitwise_equal(part.logits, whole.logits));
  }
  // The same on the qwen2 architecture (biases), with a shorter prompt.
  cpu_engine q = make_tiny_engine("qwen2");
  const auto short_prompt = random_tokens(150, 2, 151000);
  const prefill_result q_whole = prefill_in_chunks(q, 1, short_prompt, block_range(0, 10), 150);
  for (std::size_t chunk : {std::size_t{1}, std::size_t{7}}) {
    CHECK(bitwise_equal(prefill_in_chunks(q, 2, short_prompt, block_range(20, 10), chunk).logits, q_whole.logits));
  }
}

TEST_CASE("decode after prefill gives the logits of prefilling the longer prompt") {
  for (const std::string arch : {"llama", "qwen2"}) {
    CAPTURE(arch);
    cpu_engine e = make_tiny_engine(arch, 1);
    std::vector<int32_t> history = random_tokens(37, 3, 128000);
    const auto blocks = block_range(10, 4);
    history.push_back(prefill_in_chunks(e, 1, history, blocks, 16).token);
    for (int step = 0; step < 12; ++step) {
      const prefill_result d = decode_one(e, 1, history, blocks);
      const prefill_result p = prefill_in_chunks(e, 2, history, block_range(100, 4), history.size());
      CHECK(d.token == p.token);
      CHECK(bitwise_equal(d.logits, p.logits));
      history.push_back(d.token);
    }
  }
}

TEST_CASE("a batched decode step equals decoding each sequence alone; a multi-sequence prefill step too") {
  cpu_engine e = make_tiny_engine("llama");
  std::vector<std::vector<int32_t>> histories;
  std::vector<std::vector<uint32_t>> tables;
  std::vector<prefill_chunk> chunks;
  for (uint32_t s = 0; s < 8; ++s) {
    histories.push_back(random_tokens(5 + 9 * s, 10 + s));
    tables.push_back(block_range(s * 8, 8));
  }
  for (uint32_t s = 0; s < 8; ++s) {
    chunks.push_back({s, histories[s], 0, tables[s], true, nullptr});
  }
  const step_output together = e.prefill(chunks);
  std::vector<std::vector<float>> together_logits;
  for (uint32_t s = 0; s < 8; ++s) together_logits.emplace_back(e.last_logits(s).begin(), e.last_logits(s).end());
  for (uint32_t s = 0; s < 8; ++s) {
    const prefill_result alone = prefill_in_chunks(e, 100 + s, histories[s], block_range(100 + 8 * s, 8), 1000);
    CHECK(alone.token == together.tokens[s]);
    CHECK(bitwise_equal(alone.logits, together_logits[s]));
    histories[s].push_back(together.tokens[s]);
  }
  for (int step = 0; step < 3; ++step) {
    std::vector<decode_slot> slots;
    for (uint32_t s = 0; s < 8; ++s) slots.push_back({s, histories[s], tables[s], nullptr});
    const step_output out = e.decode(slots);
    REQUIRE(out.tokens.size() == 8);
    std::vector<std::vector<float>> batched;
    for (uint32_t s = 0; s < 8; ++s) batched.emplace_back(e.last_logits(s).begin(), e.last_logits(s).end());
    for (uint32_t s = 0; s < 8; ++s) {
      // Alone, on a copy of the sequence in other blocks.
      const prefill_result alone = prefill_in_chunks(e, 100 + s, histories[s], block_range(100 + 8 * s, 8), 1000);
      CHECK(alone.token == out.tokens[s]);
      CHECK(bitwise_equal(alone.logits, batched[s]));
      histories[s].push_back(out.tokens[s]);
    }
  }
}

TEST_CASE("read_blocks/write_blocks move a sequence's KV to a second engine, which continues identically") {
  cpu_engine a = make_tiny_engine("llama", 2, 64);
  cpu_engine b = make_tiny_engine("llama", 1, 128);
  REQUIRE(a.info().layout_hash == b.info().layout_hash);
  msg::sampling_params sp;
  sp.temperature = 0.9f;
  sp.top_p = 0.95f;
  sp.repetition_penalty = 1.1f;
  sp.seed = 1234;
  sp.has_seed = true;
  sp.top_logprobs = 2;
  std::vector<int32_t> history = random_tokens(50, 7);
  const std::vector<uint32_t> blocks_a = {9, 3, 40, 17, 22, 5};  // room for 96 tokens
  const std::vector<uint32_t> blocks_b = {100, 0, 77, 1, 64, 65};
  history.push_back(prefill_in_chunks(a, 5, history, blocks_a, 20, &sp).token);

  std::vector<std::byte> bytes(4 * a.info().block_bytes);
  const std::vector<uint32_t> used_a(blocks_a.begin(), blocks_a.begin() + 4);  // 51 positions in 4 blocks
  const std::vector<uint32_t> used_b(blocks_b.begin(), blocks_b.begin() + 4);
  REQUIRE(a.read_blocks(used_a, bytes));
  REQUIRE(b.write_blocks(used_b, bytes));
  CHECK(!a.read_blocks(used_a, std::span(bytes).first(10)));             // wrong size
  CHECK(!b.write_blocks(std::vector<uint32_t>{500}, std::span(bytes).first(b.info().block_bytes)));  // outside the pool

  std::vector<int32_t> history_b = history;
  for (int step = 0; step < 20; ++step) {
    const prefill_result ra = decode_one(a, 5, history, blocks_a, &sp);
    const prefill_result rb = decode_one(b, 5, history_b, blocks_b, &sp);
    CHECK(ra.token == rb.token);
    CHECK(bitwise_equal(ra.logits, rb.logits));
    CHECK(a.last_samples()[0].top == b.last_samples()[0].top);
    REQUIRE(b.last_samples()[0].top.size() == 2);
    history.push_back(ra.token);
    history_b.push_back(rb.token);
  }
}

TEST_CASE("import_blocks copies a sequence's KV out of another engine's shared-memory pool") {
  cpu_engine a = make_tiny_engine("llama", 2, 64);
  cpu_engine b = make_tiny_engine("llama", 1, 128);
  msg::sampling_params sp;  // greedy
  std::vector<int32_t> history = random_tokens(50, 9);
  const std::vector<uint32_t> blocks_a = {9, 3, 40, 17, 22, 5};
  const std::vector<uint32_t> blocks_b = {100, 0, 77, 1, 64, 65};
  history.push_back(prefill_in_chunks(a, 5, history, blocks_a, 20, &sp).token);

  // Room for these pools in /dev/shm (so they are shared), none for an absurd one (so such a
  // pool would stay private rather than die of SIGBUS when touched).
  CHECK(shm_region::fits(1 << 20));
  CHECK_FALSE(shm_region::fits(uint64_t{1} << 60));
  const auto pool = a.export_pool();
  REQUIRE(pool.path == msg::kv_path::host_shm);
  CHECK(pool.handle.starts_with("/duet-kv-"));
  CHECK(pool.pool_bytes == 64 * a.info().block_bytes);
  CHECK(b.can_import() == msg::kv_path::host_shm);
  std::string error;
  const std::vector<uint32_t> used_a(blocks_a.begin(), blocks_a.begin() + 4);
  const std::vector<uint32_t> used_b(blocks_b.begin(), blocks_b.begin() + 4);
  REQUIRE(b.import_blocks(pool, used_a, used_b, error));
  // Refusals name the problem and copy nothing.
  CHECK_FALSE(b.import_blocks(pool, std::vector<uint32_t>{64}, std::vector<uint32_t>{0}, error));
  CHECK(error.find("outside the exported pool") != std::string::npos);
  CHECK_FALSE(b.import_blocks(pool, std::vector<uint32_t>{0}, std::vector<uint32_t>{128}, error));
  CHECK(error.find("outside this pool") != std::string::npos);
  auto elsewhere = pool;
  elsewhere.host = "another-host";
  CHECK_FALSE(b.import_blocks(elsewhere, used_a, used_b, error));
  auto gone = pool;
  gone.handle = "/duet-kv-1-0-0";
  CHECK_FALSE(b.import_blocks(gone, used_a, used_b, error));
  CHECK(error.find("cannot open shared memory") != std::string::npos);

  std::vector<int32_t> history_b = history;
  for (int step = 0; step < 10; ++step) {
    const prefill_result ra = decode_one(a, 5, history, blocks_a, &sp);
    const prefill_result rb = decode_one(b, 5, history_b, blocks_b, &sp);
    CHECK(ra.token == rb.token);
    CHECK(bitwise_equal(ra.logits, rb.logits));
    history.push_back(ra.token);
    history_b.push_back(rb.token);
  }
}

TEST_CASE("a seeded request samples the same tokens whether prefilled in one chunk or many") {
  cpu_engine e = make_tiny_engine("qwen2");
  msg::sampling_params sp;
  sp.temperature = 1.5f;
  sp.top_k = 50;
  sp.frequency_penalty = 0.3f;
  sp.seed = 77;
  sp.has_seed = true;
  const auto prompt = random_tokens(40, 9, 151000);
  auto run = [&](uint64_t seq, std::size_t chunk, uint32_t first_block) {
    std::vector<int32_t> h = prompt;
    const auto blocks = block_range(first_block, 6);
    h.push_back(prefill_in_chunks(e, seq, prompt, blocks, chunk, &sp).token);
    for (int i = 0; i < 10; ++i) h.push_back(decode_one(e, seq, h, blocks, &sp).token);
    e.release(seq);
    return h;
  };
  const auto one = run(1, 40, 0);
  CHECK(run(2, 3, 10) == one);
  CHECK(run(3, 40, 20) == one);  // another sequence id, same seed
  sp.seed = 78;
  CHECK(run(4, 40, 30) != one);
}

TEST_CASE("bad input throws std::invalid_argument and leaves the engine usable") {
  cpu_engine e = make_tiny_engine("llama", 1, 8);
  const auto blocks = block_range(0, 4);
  const std::vector<int32_t> good = {1, 2, 3};
  auto prefill_error = [&](std::vector<int32_t> tokens, std::vector<uint32_t> table, uint32_t start = 0) {
    prefill_chunk c{1, tokens, start, table, true, nullptr};
    return error_of([&] { (void)e.prefill(std::span(&c, 1)); });
  };
  CHECK(prefill_error({1, 128256}, blocks).find("token 128256 of sequence 1 is outside the vocabulary") != std::string::npos);
  CHECK(prefill_error({1, -5}, blocks).find("token -5") != std::string::npos);
  CHECK(prefill_error({}, blocks).find("is empty") != std::string::npos);
  CHECK(prefill_error(good, {}).find("3 positions need 1 blocks, the block table has 0") != std::string::npos);
  CHECK(prefill_error(good, {8}).find("block 8 is outside the pool of 8") != std::string::npos);
  CHECK(prefill_error(good, blocks, 4095).find("over the context limit of 4096") != std::string::npos);
  CHECK_THROWS_AS(prefill_in_chunks(e, 1, std::vector<int32_t>{128300}, blocks, 1), std::invalid_argument);
  decode_slot empty{1, {}, blocks, nullptr};
  CHECK_THROWS_AS((void)e.decode(std::span(&empty, 1)), std::invalid_argument);
  // Still works, and gives what a fresh engine gives.
  cpu_engine fresh = make_tiny_engine("llama", 1, 8);
  CHECK(bitwise_equal(prefill_in_chunks(e, 1, good, blocks, 3).logits, prefill_in_chunks(fresh, 1, good, blocks, 3).logits));
}

TEST_CASE("make_engine builds the cpu engine from config.model.path with the actor's kv_blocks") {
  deployment_config config;
  config.engine.kind = "cpu";
  config.engine.threads = 1;
  config.model.name = "tiny";
  config.model.path = tiny("llama").dir.path.string();
  config.model.max_context = 1024;
  actor_config actor;
  actor.kv_blocks = 32;
  const auto e = make_engine(config, actor);
  CHECK(e->info().engine == "cpu");
  CHECK(e->info().max_context == 1024);
  CHECK(e->info().vocab_size == 128256);
  std::vector<std::byte> out(32 * e->info().block_bytes);
  CHECK(e->read_blocks(block_range(0, 32), out));
  std::vector<std::byte> too_many(33 * e->info().block_bytes);
  CHECK(!e->read_blocks(block_range(0, 33), too_many));  // block 32 is outside the pool
  config.model.path.clear();
  CHECK(error_of([&] { (void)make_engine(config, actor); }).find("needs model.path") != std::string::npos);
  config.model.path = "/nonexistent/model";
  CHECK(error_of([&] { (void)make_engine(config, actor); }).find("/nonexistent/model: no such file or directory") !=
        std::string::npos);
  config.model.path = tiny("llama").dir.path.parent_path().string();  // a directory without config.json
  CHECK(error_of([&] { (void)make_engine(config, actor); }).find("config.json: cannot read") != std::string::npos);
}

// ============================================================================ HF transformers

namespace {

void check_against_hf_fixture(const fs::path& file) {
  const json fx = json::parse(std::ifstream(file));
  const json& ck = fx.at("checkpoint");
  random_checkpoint_params p;
  p.arch = ck.at("arch");
  p.size = ck.at("size");
  p.seed = ck.at("seed");
  p.dtype = ck.at("dtype");
  p.stddev = ck.at("stddev");
  p.norm_stddev = ck.at("norm_stddev");
  temp_dir dir;
  (void)write_random_checkpoint(dir.path, p);
  model_weights loaded = load_hf_model(dir.path);

  // The fixture was made from these very weights (its writer is the Python twin of ours).
  for (const auto& b : bind_weights(loaded)) {
    const json& t = fx.at("tensors").at(b.spec.name);
    double sum = 0;
    for (float v : *b.data) sum += v;
    INFO(b.spec.name);
    CHECK(sum == doctest::Approx(t.at("sum").get<double>()).epsilon(1e-9));
    const auto first = t.at("first").get<std::vector<float>>();
    CHECK(std::equal(first.begin(), first.end(), b.data->begin()));
  }
  const auto weights = std::make_shared<const model_weights>(std::move(loaded));
  const auto hf_inv = fx.at("inv_freq").get<std::vector<float>>();
  const auto inv = rope_inv_freq(weights->config);
  REQUIRE(hf_inv.size() == inv.size());
  for (std::size_t i = 0; i < inv.size(); ++i) CHECK(ulp_distance(inv[i], hf_inv[i]) <= 1);

  cpu_engine_params ep;
  ep.kv_blocks = 64;
  ep.max_context = 4096;
  ep.threads = 2;
  cpu_engine e(weights, ep);
  const uint32_t slice_start = fx.at("slice_start");
  uint64_t seq = 0;
  double worst_of_all = 0;
  for (const json& prompt : fx.at("prompts")) {
    const auto ids = prompt.at("ids").get<std::vector<int32_t>>();
    CAPTURE(ids.size());
    const auto blocks = block_range(0, 64);
    std::vector<int32_t> history = ids;
    const prefill_result r = prefill_in_chunks(e, ++seq, ids, blocks, 64);
    // Last-position logits: the top 64, the norm and a slice, within 1e-4 relative (to the
    // larger of the value and the logits' RMS, so values near zero are not over-weighted).
    const auto top_ids = prompt.at("top_ids").get<std::vector<int32_t>>();
    const auto top_values = prompt.at("top_values").get<std::vector<float>>();
    const double l2 = prompt.at("l2");
    const double rms = l2 / std::sqrt(static_cast<double>(r.logits.size()));
    double ours_l2 = 0;
    for (float v : r.logits) ours_l2 += double(v) * v;
    CHECK(std::sqrt(ours_l2) == doctest::Approx(l2).epsilon(1e-4));
    double worst = 0;
    for (std::size_t i = 0; i < top_ids.size(); ++i) {
      worst = std::max(worst, std::abs(r.logits[top_ids[i]] - top_values[i]) / std::max<double>(std::abs(top_values[i]), rms));
    }
    const auto slice = prompt.at("slice").get<std::vector<float>>();
    for (std::size_t i = 0; i < slice.size(); ++i) {
      worst = std::max(worst, std::abs(r.logits[slice_start + i] - slice[i]) / std::max<double>(std::abs(slice[i]), rms));
    }
    CHECK(worst < 1e-4);
    worst_of_all = std::max(worst_of_all, worst);
    CHECK(r.token == top_ids[0]);
    // Greedy continuation, token for token.
    const auto greedy = prompt.at("greedy").get<std::vector<int32_t>>();
    std::vector<int32_t> ours = {r.token};
    history.push_back(r.token);
    while (ours.size() < greedy.size()) {
      const int32_t t = decode_one(e, seq, history, blocks).token;
      ours.push_back(t);
      history.push_back(t);
    }
    CHECK(ours == greedy);
    e.release(seq);
  }
  MESSAGE(file.filename().string() << ": worst relative logit error " << worst_of_all << " (limit 1e-4)");
}

}  // namespace

TEST_CASE("the tiny llama and qwen2 models agree with Hugging Face transformers (fp32, eager)") {
  const std::vector<std::string> names = {"llama_tiny.json", "qwen2_tiny.json"};
  for (const auto& name : names) {
    if (!fs::exists(fixture_dir / name)) {
      FAIL("missing fixture " << (fixture_dir / name).string()
                              << ": run tests/tools/make_hf_fixtures.py on a machine with torch + transformers "
                                 "(docs/cpu-engine.md says how)");
    }
    check_against_hf_fixture(fixture_dir / name);
  }
}
