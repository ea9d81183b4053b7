#include "runtime/random_checkpoint.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <thread>

#include "runtime/safetensors.hpp"
#include "runtime/tokenizer.hpp"

namespace duet {

namespace {

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

transformer_config preset(std::string_view arch, std::string_view size) {
  transformer_config c;
  if (arch == "llama") {
    c.arch = "llama";
    c.architecture = "LlamaForCausalLM";
    if (size == "small") {  // SmolLM2-135M
      c.hidden_size = 576;
      c.intermediate_size = 1536;
      c.num_hidden_layers = 30;
      c.num_attention_heads = 9;
      c.num_key_value_heads = 3;
      c.vocab_size = 49152;
      c.max_position_embeddings = 8192;
      c.rms_norm_eps = 1e-5;
      c.rope_theta = 100000.0;
      c.tie_word_embeddings = true;
      c.bos_token_id = 1;
      c.eos_token_ids = {2};
    } else {  // DeepSeek-R1-Distill-Llama-8B
      c.hidden_size = 4096;
      c.intermediate_size = 14336;
      c.num_hidden_layers = 32;
      c.num_attention_heads = 32;
      c.num_key_value_heads = 8;
      c.vocab_size = 128256;
      c.max_position_embeddings = 131072;
      c.rms_norm_eps = 1e-5;
      c.rope_theta = 500000.0;
      c.rope_scaling = rope_scaling_config{"llama3", 8.0, 1.0, 4.0, 8192};
      c.tie_word_embeddings = false;
      c.bos_token_id = 128000;
      c.eos_token_ids = {128001};
    }
  } else if (arch == "qwen2") {
    c.arch = "qwen2";
    c.architecture = "Qwen2ForCausalLM";
    c.qkv_bias = true;
    c.bos_token_id = 151643;
    c.eos_token_ids = {151643};
    c.vocab_size = 151936;
    c.rms_norm_eps = 1e-6;
    if (size == "small") {  // Qwen2.5-0.5B
      c.hidden_size = 896;
      c.intermediate_size = 4864;
      c.num_hidden_layers = 24;
      c.num_attention_heads = 14;
      c.num_key_value_heads = 2;
      c.max_position_embeddings = 32768;
      c.rope_theta = 1000000.0;
      c.tie_word_embeddings = true;
    } else {  // DeepSeek-R1-Distill-Qwen-1.5B
      c.hidden_size = 1536;
      c.intermediate_size = 8960;
      c.num_hidden_layers = 28;
      c.num_attention_heads = 12;
      c.num_key_value_heads = 2;
      c.max_position_embeddings = 131072;
      c.rope_theta = 10000.0;
      c.tie_word_embeddings = false;
    }
  } else {
    throw std::invalid_argument("random checkpoint: unknown arch '" + std::string(arch) + "' (llama, qwen2)");
  }
  if (size == "tiny") {
    c.hidden_size = 64;
    c.intermediate_size = 128;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
  } else if (size != "full" && size != "small") {
    throw std::invalid_argument("random checkpoint: unknown size '" + std::string(size) + "' (full, small, tiny)");
  }
  c.head_dim = c.hidden_size / c.num_attention_heads;
  return c;
}

st_dtype dtype_of(std::string_view name) {
  if (name == "bf16") return st_dtype::bf16;
  if (name == "f16") return st_dtype::f16;
  if (name == "f32") return st_dtype::f32;
  throw std::invalid_argument("random checkpoint: unknown dtype '" + std::string(name) + "' (bf16, f16, f32)");
}

std::string torch_dtype_of(st_dtype t) {
  switch (t) {
    case st_dtype::bf16: return "bfloat16";
    case st_dtype::f16: return "float16";
    default: return "float32";
  }
}

void store(st_dtype type, float value, std::byte* out) {
  if (type == st_dtype::f32) {
    std::memcpy(out, &value, 4);
    return;
  }
  const uint16_t h = type == st_dtype::bf16 ? float_to_bf16(value) : float_to_f16(value);
  std::memcpy(out, &h, 2);
}

}  // namespace

uint64_t random_tensor_key(uint64_t seed, std::string_view tensor_name) { return mix64(fnv1a64(tensor_name) ^ mix64(seed)); }

float random_tensor_value(uint64_t key, uint64_t index, double mean, double stddev) {
  const uint64_t z = mix64(key + (index + 1) * 0x9e3779b97f4a7c15ull);
  const uint64_t s = (z & 0xffff) + ((z >> 16) & 0xffff) + ((z >> 32) & 0xffff) + (z >> 48);
  const double k = stddev * std::sqrt(3.0) / 65536.0;
  const double deviate = (static_cast<double>(s) - 131070.0) * k;
  return static_cast<float>(mean == 0.0 ? deviate : mean + deviate);
}

transformer_config random_checkpoint_config(const random_checkpoint_params& p) {
  transformer_config c = preset(p.arch, p.size);
  const shape_overrides& o = p.overrides;
  if (o.layers) c.num_hidden_layers = *o.layers;
  if (o.hidden) c.hidden_size = *o.hidden;
  if (o.heads) c.num_attention_heads = *o.heads;
  if (o.kv_heads) c.num_key_value_heads = *o.kv_heads;
  if (o.ffn) c.intermediate_size = *o.ffn;
  if (o.vocab) c.vocab_size = *o.vocab;
  if (o.max_position) c.max_position_embeddings = *o.max_position;
  if (o.tie_word_embeddings) c.tie_word_embeddings = *o.tie_word_embeddings;
  if (c.num_attention_heads == 0) throw std::runtime_error("random checkpoint: heads must be positive");
  c.head_dim = o.head_dim ? *o.head_dim : c.hidden_size / c.num_attention_heads;
  if (c.bos_token_id && static_cast<uint32_t>(*c.bos_token_id) >= c.vocab_size) c.bos_token_id.reset();
  std::erase_if(c.eos_token_ids, [&](int32_t id) { return static_cast<uint32_t>(id) >= c.vocab_size; });
  if (p.special_ids_from_tokenizer && !p.tokenizer_dir.empty()) {
    const tokenizer_spec tok = load_tokenizer_json(p.tokenizer_dir);
    auto inside = [&](std::optional<int32_t> id) { return id && *id >= 0 && static_cast<uint32_t>(*id) < c.vocab_size; };
    if (inside(tok.bos_id)) c.bos_token_id = tok.bos_id;
    if (inside(tok.eos_id) && std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), *tok.eos_id) == c.eos_token_ids.end()) {
      c.eos_token_ids.push_back(*tok.eos_id);
    }
  }
  if (p.bos_token_id) {
    if (*p.bos_token_id < 0 || static_cast<uint32_t>(*p.bos_token_id) >= c.vocab_size) {
      throw std::runtime_error("random checkpoint: bos_token_id " + std::to_string(*p.bos_token_id) +
                               " is outside the vocabulary");
    }
    c.bos_token_id = p.bos_token_id;
  }
  if (!p.eos_token_ids.empty()) c.eos_token_ids = p.eos_token_ids;
  c.torch_dtype = torch_dtype_of(dtype_of(p.dtype));
  c.validate("random checkpoint");
  return c;
}

random_checkpoint_result write_random_checkpoint(const std::filesystem::path& dir, const random_checkpoint_params& p) {
  namespace fs = std::filesystem;
  random_checkpoint_result result;
  result.config = random_checkpoint_config(p);
  const st_dtype type = dtype_of(p.dtype);
  const uint32_t element = st_dtype_size(type);
  if (!p.tokenizer_dir.empty() && !fs::exists(p.tokenizer_dir / "tokenizer.json")) {
    throw std::runtime_error("random checkpoint: no tokenizer.json in " + p.tokenizer_dir.string());
  }
  fs::create_directories(dir);

  std::vector<st_write_entry> entries;
  uint64_t bytes_done = 0;
  const uint64_t* total_bytes = &result.weight_bytes;
  const auto* progress = p.progress ? &p.progress : nullptr;
  uint64_t* done = &bytes_done;
  const unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  for (const hf_tensor_spec& spec : hf_tensor_specs(result.config)) {
    const uint64_t key = random_tensor_key(p.seed, spec.name);
    const bool norm = spec.kind == weight_kind::norm;
    const double mean = norm ? 1.0 : 0.0;
    const double stddev = norm ? p.norm_stddev : p.stddev;
    result.weight_bytes += spec.n_elements() * element;
    auto generate = [=](uint64_t first, std::span<std::byte> out) {
      const uint64_t n = out.size() / element;
      auto fill = [&](uint64_t begin, uint64_t end) {
        for (uint64_t i = begin; i < end; ++i) {
          const float v = stddev == 0.0 ? static_cast<float>(mean)
                                        : random_tensor_value(key, first + i, mean, stddev);
          store(type, v, out.data() + i * element);
        }
      };
      if (n < (1u << 18) || threads == 1) {
        fill(0, n);
        return;
      }
      std::vector<std::thread> pool;
      const uint64_t per = (n + threads - 1) / threads;
      for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&fill, t, per, n] { fill(std::min(n, t * per), std::min(n, (t + 1) * per)); });
      }
      for (auto& t : pool) t.join();
    };
    entries.push_back({spec.name, type, spec.shape, [=](uint64_t first, std::span<std::byte> out) {
                         generate(first, out);
                         if (progress) (*progress)(*done += out.size(), *total_bytes);
                       }});
  }

  {
    const fs::path config_path = dir / "config.json";
    std::ofstream out(config_path, std::ios::trunc);
    out << hf_config_json(result.config);
    if (!out) throw std::runtime_error("random checkpoint: cannot write " + config_path.string());
    result.files.push_back(config_path);
  }
  for (auto& f : write_safetensors_checkpoint(dir, entries, p.max_shard_bytes)) result.files.push_back(f);
  if (!p.tokenizer_dir.empty()) {
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) {
      const fs::path from = p.tokenizer_dir / name;
      if (!fs::exists(from)) continue;
      fs::copy_file(from, dir / name, fs::copy_options::overwrite_existing);
      // Sources may be read-only (a shared checkout); the copy belongs to the user.
      fs::permissions(dir / name, fs::perms::owner_read | fs::perms::owner_write, fs::perm_options::add);
      result.files.push_back(dir / name);
    }
  }
  return result;
}

random_checkpoint_result write_random_checkpoint(const std::filesystem::path& dir, std::string_view arch,
                                                 const shape_overrides& overrides, uint64_t seed, std::string_view dtype,
                                                 const std::filesystem::path& tokenizer_dir) {
  random_checkpoint_params p;
  p.arch = std::string(arch);
  p.overrides = overrides;
  p.seed = seed;
  p.dtype = std::string(dtype);
  p.tokenizer_dir = tokenizer_dir;
  return write_random_checkpoint(dir, p);
}

}  // namespace duet
