#include "runtime/gguf_model.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/shared_loads.hpp"

namespace duet {

namespace {

[[noreturn]] void fail(const gguf_file& f, const std::string& what) {
  throw std::runtime_error("gguf: " + f.path().string() + ": " + what);
}

std::string shape_string(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Dequantizes tensor `name`, which must have GGUF shape `shape` (ggml order: shape[0] is the
// contiguous row, so a matrix [in, out] is out rows of in floats, HF's [out, in] row-major).
std::vector<float> read_tensor(const gguf_file& f, const std::string& name, const std::vector<uint64_t>& shape) {
  const gguf_tensor_info* info = f.find_tensor(name);
  if (!info) fail(f, "no tensor '" + name + "'");
  if (info->shape != shape) {
    fail(f, "tensor '" + name + "': shape " + shape_string(info->shape) + ", expected " + shape_string(shape));
  }
  if (!ggml_type_get(info->type).dequantizable) {
    fail(f, "tensor '" + name + "': type " + std::string(ggml_type_name(info->type)) +
                " is not supported by the CPU engine's loader");
  }
  return dequantize(f.tensor(*info));
}

}  // namespace

bool is_gguf_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  std::array<char, 4> magic{};
  if (!in.read(magic.data(), magic.size())) return false;
  return std::memcmp(magic.data(), "GGUF", 4) == 0;
}

transformer_config gguf_transformer_config(const gguf_file& f) {
  const gguf_model_config g = gguf_read_model_config(f);
  if (g.rope_scaling) {
    fail(f, "rope scaling '" + g.rope_scaling->type + "' (" + g.arch +
                ".rope.scaling.*) is not supported by the CPU engine");
  }
  if (g.rope_freq_factors) {
    fail(f, "tensor 'rope_freqs.weight' (per-dimension rope frequency factors, Llama-3.1 style scaling) is not "
            "supported by the CPU engine's GGUF loader yet");
  }
  if (g.rope_dim != g.head_dim) {
    fail(f, g.arch + ".rope.dimension_count " + std::to_string(g.rope_dim) + " differs from head_dim " +
                std::to_string(g.head_dim) + ": partial rotary embeddings are not supported by the CPU engine");
  }
  if (g.context_length > UINT32_MAX) fail(f, g.arch + ".context_length " + std::to_string(g.context_length) + " is too large");
  transformer_config c;
  c.arch = g.arch;
  c.architecture = g.arch == "qwen2" ? "Qwen2ForCausalLM" : "LlamaForCausalLM";
  c.hidden_size = g.hidden;
  c.intermediate_size = g.ffn;
  c.num_hidden_layers = g.n_layers;
  c.num_attention_heads = g.n_heads;
  c.num_key_value_heads = g.n_kv_heads;
  c.head_dim = g.head_dim;
  c.vocab_size = g.vocab;
  c.max_position_embeddings = static_cast<uint32_t>(g.context_length);
  c.rms_norm_eps = g.rms_eps;  // the float the file holds, as llama.cpp uses it
  c.rope_theta = g.rope_theta;
  c.tie_word_embeddings = g.tied_embeddings;
  c.qkv_bias = g.attn_qkv_bias;
  c.o_bias = f.find_tensor("blk.0.attn_output.bias") != nullptr;
  if (c.arch == "qwen2" && !c.qkv_bias) fail(f, "qwen2 file without 'blk.0.attn_q.bias'");
  if (c.arch == "llama" && c.o_bias != c.qkv_bias) {
    fail(f, "llama file with only some attention biases (q/k/v: " + std::string(c.qkv_bias ? "yes" : "no") +
                ", output: " + (c.o_bias ? "yes" : "no") + "): not supported");
  }
  if (c.arch == "qwen2" && c.o_bias) fail(f, "qwen2 file with 'blk.0.attn_output.bias': not supported");
  auto token_id = [&](const char* key) -> std::optional<int32_t> {
    const auto v = f.find_u64(key);
    if (!v) return std::nullopt;
    if (*v >= c.vocab_size) fail(f, std::string("metadata key '") + key + "': id " + std::to_string(*v) + " is outside the vocabulary");
    return static_cast<int32_t>(*v);
  };
  c.bos_token_id = token_id("tokenizer.ggml.bos_token_id");
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"}) {
    if (const auto id = token_id(key);
        id && std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), *id) == c.eos_token_ids.end()) {
      c.eos_token_ids.push_back(*id);
    }
  }
  c.torch_dtype = "float32";  // what the engine holds; the file's types are per tensor
  c.validate(f.path().string());
  return c;
}

namespace {

// gguf_unpermute_rope_rows on rows of `row_bytes` bytes.
void unpermute_rows(std::byte* rows, uint32_t heads, uint32_t head_dim, std::size_t row_bytes) {
  const std::size_t half = head_dim / 2;
  std::vector<std::byte> head(std::size_t{head_dim} * row_bytes);
  for (uint32_t h = 0; h < heads; ++h) {
    std::byte* base = rows + std::size_t{h} * head_dim * row_bytes;
    std::copy(base, base + head.size(), head.begin());
    for (std::size_t i = 0; i < half; ++i) {
      for (std::size_t j = 0; j < 2; ++j) {
        const std::byte* src = head.data() + (2 * i + j) * row_bytes;
        std::copy(src, src + row_bytes, base + (j * half + i) * row_bytes);
      }
    }
  }
}

}  // namespace

void gguf_unpermute_rope_rows(std::span<float> rows, uint32_t heads, uint32_t head_dim, uint64_t row_length) {
  if (rows.size() != uint64_t{heads} * head_dim * row_length || head_dim % 2 != 0) {
    throw std::invalid_argument("gguf_unpermute_rope_rows: " + std::to_string(rows.size()) + " floats are not " +
                                std::to_string(heads) + " heads of " + std::to_string(head_dim) + " rows of " +
                                std::to_string(row_length));
  }
  unpermute_rows(reinterpret_cast<std::byte*>(rows.data()), heads, head_dim, row_length * sizeof(float));
}

model_weights load_gguf_model(const std::filesystem::path& path) {
  const gguf_file f(path);
  model_weights w;
  w.config = gguf_transformer_config(f);
  const transformer_config& c = w.config;
  const uint64_t hidden = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), ffn = c.intermediate_size;
  const bool permuted = c.arch == "llama";  // convert_hf_to_gguf permutes llama q/k only

  w.embedding = read_tensor(f, "token_embd.weight", {hidden, c.vocab_size});
  if (!c.tie_word_embeddings) w.lm_head = read_tensor(f, "output.weight", {hidden, c.vocab_size});
  w.final_norm = read_tensor(f, "output_norm.weight", {hidden});
  w.layers.resize(c.num_hidden_layers);
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    layer_weights& lw = w.layers[l];
    const std::string b = "blk." + std::to_string(l) + ".";
    lw.input_norm = read_tensor(f, b + "attn_norm.weight", {hidden});
    lw.q = read_tensor(f, b + "attn_q.weight", {hidden, qd});
    lw.k = read_tensor(f, b + "attn_k.weight", {hidden, kvd});
    lw.v = read_tensor(f, b + "attn_v.weight", {hidden, kvd});
    lw.o = read_tensor(f, b + "attn_output.weight", {qd, hidden});
    if (c.qkv_bias) {
      lw.q_bias = read_tensor(f, b + "attn_q.bias", {qd});
      lw.k_bias = read_tensor(f, b + "attn_k.bias", {kvd});
      lw.v_bias = read_tensor(f, b + "attn_v.bias", {kvd});
    }
    if (c.o_bias) lw.o_bias = read_tensor(f, b + "attn_output.bias", {hidden});
    if (permuted) {
      gguf_unpermute_rope_rows(lw.q, c.num_attention_heads, c.head_dim, hidden);
      gguf_unpermute_rope_rows(lw.k, c.num_key_value_heads, c.head_dim, hidden);
      if (c.qkv_bias) {
        gguf_unpermute_rope_rows(lw.q_bias, c.num_attention_heads, c.head_dim, 1);
        gguf_unpermute_rope_rows(lw.k_bias, c.num_key_value_heads, c.head_dim, 1);
      }
    }
    lw.post_attention_norm = read_tensor(f, b + "ffn_norm.weight", {hidden});
    lw.gate = read_tensor(f, b + "ffn_gate.weight", {hidden, ffn});
    lw.up = read_tensor(f, b + "ffn_up.weight", {hidden, ffn});
    lw.down = read_tensor(f, b + "ffn_down.weight", {ffn, hidden});
  }
  w.validate();
  return w;
}

std::shared_ptr<const model_weights> load_gguf_model_shared(const std::filesystem::path& path) {
  static shared_loads<model_weights> loads;
  return loads.get(canonical_key(path), [&] { return std::make_shared<const model_weights>(load_gguf_model(path)); });
}

bool ggml_native_matrix_type(ggml_type type) {
  return type == ggml_type::q4_0 || type == ggml_type::q4_1 || type == ggml_type::q8_0;
}

namespace {

// A matrix for the native path: the tensor's blocks when the type is native, else floats.
ggml_matrix read_matrix(const gguf_file& f, const std::string& name, uint64_t cols, uint64_t rows) {
  const gguf_tensor_info* info = f.find_tensor(name);
  if (!info) fail(f, "no tensor '" + name + "'");
  const std::vector<uint64_t> shape{cols, rows};
  if (info->shape != shape) {
    fail(f, "tensor '" + name + "': shape " + shape_string(info->shape) + ", expected " + shape_string(shape));
  }
  ggml_matrix m;
  m.rows = rows;
  m.cols = cols;
  if (ggml_native_matrix_type(info->type)) {
    m.type = info->type;
    const gguf_tensor t = f.tensor(*info);
    m.data.assign(t.data.begin(), t.data.end());
  } else {
    const std::vector<float> values = read_tensor(f, name, shape);
    m.type = ggml_type::f32;
    m.data.resize(values.size() * sizeof(float));
    std::memcpy(m.data.data(), values.data(), m.data.size());
  }
  return m;
}

void check_matrix(const ggml_matrix& m, const std::string& name, uint64_t rows, uint64_t cols) {
  if (m.rows != rows || m.cols != cols || m.data.size() != rows * m.row_bytes() ||
      !(m.type == ggml_type::f32 || ggml_native_matrix_type(m.type))) {
    throw std::runtime_error("gguf_native_model: matrix '" + name + "' is " + std::string(ggml_type_name(m.type)) +
                             " [" + std::to_string(m.rows) + ", " + std::to_string(m.cols) + "] in " +
                             std::to_string(m.data.size()) + " bytes, expected [" + std::to_string(rows) + ", " +
                             std::to_string(cols) + "]");
  }
}

}  // namespace

void gguf_native_model::validate() const {
  const transformer_config& c = weights.config;
  c.validate("gguf_native_model");
  auto check = [](const std::vector<float>& v, uint64_t n, const std::string& name) {
    if (v.size() != n) {
      throw std::runtime_error("gguf_native_model: tensor '" + name + "' holds " + std::to_string(v.size()) +
                               " values, expected " + std::to_string(n));
    }
  };
  const uint64_t hidden = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), ffn = c.intermediate_size;
  check(weights.embedding, hidden * c.vocab_size, "embedding");
  check(weights.final_norm, hidden, "final norm");
  check_matrix(output, "output", c.vocab_size, hidden);
  if (weights.layers.size() != c.num_hidden_layers || layers.size() != c.num_hidden_layers) {
    throw std::runtime_error("gguf_native_model: " + std::to_string(layers.size()) + " layers, the config says " +
                             std::to_string(c.num_hidden_layers));
  }
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "layer " + std::to_string(l) + " ";
    const layer_weights& lw = weights.layers[l];
    check(lw.input_norm, hidden, p + "input norm");
    check(lw.post_attention_norm, hidden, p + "post-attention norm");
    check(lw.q_bias, c.qkv_bias ? qd : 0, p + "q bias");
    check(lw.k_bias, c.qkv_bias ? kvd : 0, p + "k bias");
    check(lw.v_bias, c.qkv_bias ? kvd : 0, p + "v bias");
    check(lw.o_bias, c.o_bias ? hidden : 0, p + "o bias");
    for (const auto* v : {&lw.q, &lw.k, &lw.v, &lw.o, &lw.gate, &lw.up, &lw.down}) check(*v, 0, p + "fp32 matrix");
    const ggml_layer_matrices& m = layers[l];
    check_matrix(m.q, p + "q", qd, hidden);
    check_matrix(m.k, p + "k", kvd, hidden);
    check_matrix(m.v, p + "v", kvd, hidden);
    check_matrix(m.o, p + "o", hidden, qd);
    check_matrix(m.gate, p + "gate", ffn, hidden);
    check_matrix(m.up, p + "up", ffn, hidden);
    check_matrix(m.down, p + "down", hidden, ffn);
  }
}

uint64_t gguf_native_model::bytes() const {
  uint64_t n = (weights.embedding.size() + weights.final_norm.size()) * sizeof(float) + output.data.size();
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const layer_weights& lw = weights.layers[l];
    for (const auto* v : {&lw.input_norm, &lw.post_attention_norm, &lw.q_bias, &lw.k_bias, &lw.v_bias, &lw.o_bias}) {
      n += v->size() * sizeof(float);
    }
    const ggml_layer_matrices& m = layers[l];
    for (const auto* x : {&m.q, &m.k, &m.v, &m.o, &m.gate, &m.up, &m.down}) n += x->data.size();
  }
  return n;
}

gguf_native_model load_gguf_native(const std::filesystem::path& path) {
  const gguf_file f(path);
  gguf_native_model model;
  model_weights& w = model.weights;
  w.config = gguf_transformer_config(f);
  const transformer_config& c = w.config;
  const uint64_t hidden = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), ffn = c.intermediate_size;
  const bool permuted = c.arch == "llama";

  w.embedding = read_tensor(f, "token_embd.weight", {hidden, c.vocab_size});
  model.output = read_matrix(f, c.tie_word_embeddings ? "token_embd.weight" : "output.weight", hidden, c.vocab_size);
  w.final_norm = read_tensor(f, "output_norm.weight", {hidden});
  w.layers.resize(c.num_hidden_layers);
  model.layers.resize(c.num_hidden_layers);
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    layer_weights& lw = w.layers[l];
    ggml_layer_matrices& m = model.layers[l];
    const std::string b = "blk." + std::to_string(l) + ".";
    lw.input_norm = read_tensor(f, b + "attn_norm.weight", {hidden});
    lw.post_attention_norm = read_tensor(f, b + "ffn_norm.weight", {hidden});
    m.q = read_matrix(f, b + "attn_q.weight", hidden, qd);
    m.k = read_matrix(f, b + "attn_k.weight", hidden, kvd);
    m.v = read_matrix(f, b + "attn_v.weight", hidden, kvd);
    m.o = read_matrix(f, b + "attn_output.weight", qd, hidden);
    m.gate = read_matrix(f, b + "ffn_gate.weight", hidden, ffn);
    m.up = read_matrix(f, b + "ffn_up.weight", hidden, ffn);
    m.down = read_matrix(f, b + "ffn_down.weight", ffn, hidden);
    if (c.qkv_bias) {
      lw.q_bias = read_tensor(f, b + "attn_q.bias", {qd});
      lw.k_bias = read_tensor(f, b + "attn_k.bias", {kvd});
      lw.v_bias = read_tensor(f, b + "attn_v.bias", {kvd});
    }
    if (c.o_bias) lw.o_bias = read_tensor(f, b + "attn_output.bias", {hidden});
    if (permuted) {
      unpermute_rows(m.q.data.data(), c.num_attention_heads, c.head_dim, m.q.row_bytes());
      unpermute_rows(m.k.data.data(), c.num_key_value_heads, c.head_dim, m.k.row_bytes());
      if (c.qkv_bias) {
        gguf_unpermute_rope_rows(lw.q_bias, c.num_attention_heads, c.head_dim, 1);
        gguf_unpermute_rope_rows(lw.k_bias, c.num_key_value_heads, c.head_dim, 1);
      }
    }
  }
  model.validate();
  return model;
}

std::shared_ptr<const gguf_native_model> load_gguf_native_shared(const std::filesystem::path& path) {
  static shared_loads<gguf_native_model> loads;
  return loads.get(canonical_key(path),
                   [&] { return std::make_shared<const gguf_native_model>(load_gguf_native(path)); });
}

tokenizer_spec load_gguf_tokenizer(const std::filesystem::path& path) {
  const gguf_file f(path);
  return gguf_read_tokenizer(f);
}

}  // namespace duet
