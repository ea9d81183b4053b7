#include "runtime/hf_model.hpp"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "runtime/safetensors.hpp"
#include "runtime/shared_loads.hpp"

namespace duet {

namespace {

using nlohmann::json;

class config_reader {
 public:
  config_reader(const json& root, std::string_view source) : root_(root), source_(source) {}

  [[noreturn]] void fail(std::string_view key, const std::string& what) const {
    std::string msg = "hf config: " + source_ + ": ";
    if (!key.empty()) msg += "key '" + std::string(key) + "': ";
    throw std::runtime_error(msg + what);
  }

  [[nodiscard]] const json* find(const json& object, std::string_view key) const {
    auto it = object.find(std::string(key));
    if (it == object.end() || it->is_null()) return nullptr;
    return &*it;
  }

  [[nodiscard]] uint32_t get_u32(const json& object, std::string_view key, std::optional<uint32_t> fallback) const {
    const json* v = find(object, key);
    if (!v) {
      if (fallback) return *fallback;
      fail(key, "missing");
    }
    if (!v->is_number_integer()) fail(key, "expected an integer, got " + v->dump());
    const int64_t x = v->get<int64_t>();
    if (x < 0 || x > int64_t{UINT32_MAX}) fail(key, "out of range: " + v->dump());
    return static_cast<uint32_t>(x);
  }

  [[nodiscard]] double get_f64(const json& object, std::string_view key, std::optional<double> fallback) const {
    const json* v = find(object, key);
    if (!v) {
      if (fallback) return *fallback;
      fail(key, "missing");
    }
    if (!v->is_number()) fail(key, "expected a number, got " + v->dump());
    return v->get<double>();
  }

  [[nodiscard]] bool get_bool(const json& object, std::string_view key, bool fallback) const {
    const json* v = find(object, key);
    if (!v) return fallback;
    if (!v->is_boolean()) fail(key, "expected true or false, got " + v->dump());
    return v->get<bool>();
  }

  [[nodiscard]] std::string get_string(const json& object, std::string_view key, std::string fallback) const {
    const json* v = find(object, key);
    if (!v) return fallback;
    if (!v->is_string()) fail(key, "expected a string, got " + v->dump());
    return v->get<std::string>();
  }

  [[nodiscard]] std::vector<int32_t> get_ids(std::string_view key) const {
    const json* v = find(root_, key);
    std::vector<int32_t> out;
    if (!v) return out;
    auto one = [&](const json& x) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > INT32_MAX) {
        fail(key, "expected a token id or a list of them, got " + v->dump());
      }
      out.push_back(static_cast<int32_t>(x.get<int64_t>()));
    };
    if (v->is_array()) {
      for (const json& x : *v) one(x);
    } else {
      one(*v);
    }
    return out;
  }

  [[nodiscard]] const json& root() const { return root_; }

 private:
  const json& root_;
  std::string source_;
};

std::optional<rope_scaling_config> read_rope_scaling(const config_reader& r, const json& scaling,
                                                     std::string_view key) {
  if (!scaling.is_object()) r.fail(key, "expected an object or null, got " + scaling.dump());
  std::string type = r.get_string(scaling, "rope_type", "");
  if (type.empty()) type = r.get_string(scaling, "type", "");
  if (type.empty() || type == "default") return std::nullopt;
  if (type != "llama3") {
    r.fail(key, "rope scaling type '" + type + "' is not supported (supported: llama3, default)");
  }
  rope_scaling_config s;
  s.rope_type = type;
  s.factor = r.get_f64(scaling, "factor", std::nullopt);
  s.low_freq_factor = r.get_f64(scaling, "low_freq_factor", std::nullopt);
  s.high_freq_factor = r.get_f64(scaling, "high_freq_factor", std::nullopt);
  s.original_max_position_embeddings = r.get_u32(scaling, "original_max_position_embeddings", std::nullopt);
  if (!(s.factor > 0)) r.fail(key, "factor must be positive");
  if (!(s.low_freq_factor > 0) || !(s.high_freq_factor > s.low_freq_factor)) {
    r.fail(key, "llama3 scaling needs 0 < low_freq_factor < high_freq_factor");
  }
  if (s.original_max_position_embeddings == 0) r.fail(key, "original_max_position_embeddings must be positive");
  return s;
}

}  // namespace

void transformer_config::validate(std::string_view source) const {
  auto fail = [&](const std::string& what) {
    throw std::runtime_error("hf config: " + std::string(source) + ": " + what);
  };
  if (hidden_size == 0 || intermediate_size == 0 || num_hidden_layers == 0 || num_attention_heads == 0 ||
      num_key_value_heads == 0 || head_dim == 0 || vocab_size == 0) {
    fail("hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
         "head_dim and vocab_size must all be positive");
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    fail("num_attention_heads (" + std::to_string(num_attention_heads) + ") is not a multiple of num_key_value_heads (" +
         std::to_string(num_key_value_heads) + ")");
  }
  if (head_dim % 2 != 0) fail("head_dim " + std::to_string(head_dim) + " is odd; RoPE rotates pairs");
  if (!(rms_norm_eps > 0)) fail("rms_norm_eps must be positive");
  if (!(rope_theta > 0)) fail("rope_theta must be positive");
  if (max_position_embeddings == 0) fail("max_position_embeddings must be positive");
  for (int32_t id : eos_token_ids) {
    if (static_cast<uint32_t>(id) >= vocab_size) fail("eos_token_id " + std::to_string(id) + " is outside the vocabulary");
  }
}

transformer_config parse_hf_config(std::string_view json_text, std::string_view source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    throw std::runtime_error("hf config: " + std::string(source) + ": not valid JSON: " + e.what());
  }
  const config_reader r(root, source);
  if (!root.is_object()) r.fail("", "not a JSON object");

  transformer_config c;
  const json* archs = r.find(root, "architectures");
  if (!archs || !archs->is_array() || archs->empty() || !(*archs)[0].is_string()) {
    r.fail("architectures", "missing (expected [\"LlamaForCausalLM\"] or [\"Qwen2ForCausalLM\"])");
  }
  c.architecture = (*archs)[0].get<std::string>();
  if (c.architecture == "LlamaForCausalLM") {
    c.arch = "llama";
  } else if (c.architecture == "Qwen2ForCausalLM") {
    c.arch = "qwen2";
  } else {
    r.fail("architectures", "architecture '" + c.architecture +
                                "' is not supported (supported: LlamaForCausalLM, Qwen2ForCausalLM)");
  }

  c.hidden_size = r.get_u32(root, "hidden_size", std::nullopt);
  c.intermediate_size = r.get_u32(root, "intermediate_size", std::nullopt);
  c.num_hidden_layers = r.get_u32(root, "num_hidden_layers", std::nullopt);
  c.num_attention_heads = r.get_u32(root, "num_attention_heads", std::nullopt);
  if (c.num_attention_heads == 0) r.fail("num_attention_heads", "must be positive");
  c.num_key_value_heads = r.get_u32(root, "num_key_value_heads", c.num_attention_heads);
  if (r.find(root, "head_dim")) {
    c.head_dim = r.get_u32(root, "head_dim", std::nullopt);
  } else {
    if (c.hidden_size % c.num_attention_heads != 0) {
      r.fail("head_dim", "absent, and hidden_size is not a multiple of num_attention_heads");
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.vocab_size = r.get_u32(root, "vocab_size", std::nullopt);
  c.max_position_embeddings = r.get_u32(root, "max_position_embeddings", 2048);
  c.rms_norm_eps = r.get_f64(root, "rms_norm_eps", 1e-6);
  c.tie_word_embeddings = r.get_bool(root, "tie_word_embeddings", false);

  c.rope_theta = r.get_f64(root, "rope_theta", 10000.0);
  if (const json* scaling = r.find(root, "rope_scaling")) c.rope_scaling = read_rope_scaling(r, *scaling, "rope_scaling");
  if (const json* params = r.find(root, "rope_parameters")) {  // transformers 5
    if (!params->is_object()) r.fail("rope_parameters", "expected an object");
    c.rope_theta = r.get_f64(*params, "rope_theta", c.rope_theta);
    c.rope_scaling = read_rope_scaling(r, *params, "rope_parameters");
  }
  if (r.find(root, "partial_rotary_factor") && r.get_f64(root, "partial_rotary_factor", 1.0) != 1.0) {
    r.fail("partial_rotary_factor", "partial rotary embeddings are not supported");
  }

  const std::string act = r.get_string(root, "hidden_act", "silu");
  if (act != "silu") r.fail("hidden_act", "activation '" + act + "' is not supported (supported: silu)");
  if (r.get_bool(root, "mlp_bias", false)) r.fail("mlp_bias", "MLP biases are not supported");
  if (c.arch == "llama") {
    c.qkv_bias = c.o_bias = r.get_bool(root, "attention_bias", false);
  } else {
    c.qkv_bias = true;  // Qwen2 always has q/k/v biases and none on o_proj
    if (r.get_bool(root, "use_sliding_window", false)) {
      r.fail("use_sliding_window", "sliding-window attention is not supported");
    }
  }

  if (const json* bos = r.find(root, "bos_token_id")) {
    const auto ids = r.get_ids("bos_token_id");
    if (ids.size() != 1) r.fail("bos_token_id", "expected one token id, got " + bos->dump());
    c.bos_token_id = ids[0];
  }
  c.eos_token_ids = r.get_ids("eos_token_id");
  c.torch_dtype = r.get_string(root, "torch_dtype", "");
  if (c.torch_dtype.empty()) c.torch_dtype = r.get_string(root, "dtype", "");
  c.validate(source);
  return c;
}

transformer_config load_hf_config(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    throw std::runtime_error("hf config: " + path.string() + ": no such file or directory (expected a Hugging Face model directory)");
  }
  const std::filesystem::path file = std::filesystem::is_directory(path, ec) ? path / "config.json" : path;
  std::ifstream in(file);
  if (!in) throw std::runtime_error("hf config: " + file.string() + ": cannot read (is this a Hugging Face model directory?)");
  std::stringstream text;
  text << in.rdbuf();
  return parse_hf_config(text.str(), file.string());
}

std::string hf_config_json(const transformer_config& c) {
  json j;
  j["architectures"] = json::array({c.architecture});
  j["model_type"] = c.arch;
  j["attention_dropout"] = 0.0;
  if (c.bos_token_id) j["bos_token_id"] = *c.bos_token_id;
  if (c.eos_token_ids.size() == 1) {
    j["eos_token_id"] = c.eos_token_ids[0];
  } else if (!c.eos_token_ids.empty()) {
    j["eos_token_id"] = c.eos_token_ids;
  }
  j["hidden_act"] = "silu";
  j["hidden_size"] = c.hidden_size;
  j["initializer_range"] = 0.02;
  j["intermediate_size"] = c.intermediate_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_key_value_heads"] = c.num_key_value_heads;
  if (c.head_dim * c.num_attention_heads != c.hidden_size) j["head_dim"] = c.head_dim;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_scaling) {
    j["rope_scaling"] = {{"rope_type", c.rope_scaling->rope_type},
                         {"factor", c.rope_scaling->factor},
                         {"low_freq_factor", c.rope_scaling->low_freq_factor},
                         {"high_freq_factor", c.rope_scaling->high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling->original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  if (!c.torch_dtype.empty()) j["torch_dtype"] = c.torch_dtype;
  j["use_cache"] = true;
  j["vocab_size"] = c.vocab_size;
  if (c.arch == "llama") {
    j["attention_bias"] = c.qkv_bias;
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  } else {
    j["max_window_layers"] = c.num_hidden_layers;
    j["sliding_window"] = 4096;
    j["use_mrope"] = false;
    j["use_sliding_window"] = false;
  }
  return j.dump(2) + "\n";
}

uint64_t hf_tensor_spec::n_elements() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

std::vector<hf_tensor_spec> hf_tensor_specs(const transformer_config& c) {
  const uint64_t hidden = c.hidden_size, ffn = c.intermediate_size, q = c.q_dim(), kv = c.kv_dim();
  std::vector<hf_tensor_spec> out;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, hidden}, weight_kind::embedding});
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    out.push_back({p + "input_layernorm.weight", {hidden}, weight_kind::norm});
    out.push_back({p + "self_attn.q_proj.weight", {q, hidden}, weight_kind::linear});
    if (c.qkv_bias) out.push_back({p + "self_attn.q_proj.bias", {q}, weight_kind::bias});
    out.push_back({p + "self_attn.k_proj.weight", {kv, hidden}, weight_kind::linear});
    if (c.qkv_bias) out.push_back({p + "self_attn.k_proj.bias", {kv}, weight_kind::bias});
    out.push_back({p + "self_attn.v_proj.weight", {kv, hidden}, weight_kind::linear});
    if (c.qkv_bias) out.push_back({p + "self_attn.v_proj.bias", {kv}, weight_kind::bias});
    out.push_back({p + "self_attn.o_proj.weight", {hidden, q}, weight_kind::linear});
    if (c.o_bias) out.push_back({p + "self_attn.o_proj.bias", {hidden}, weight_kind::bias});
    out.push_back({p + "post_attention_layernorm.weight", {hidden}, weight_kind::norm});
    out.push_back({p + "mlp.gate_proj.weight", {ffn, hidden}, weight_kind::linear});
    out.push_back({p + "mlp.up_proj.weight", {ffn, hidden}, weight_kind::linear});
    out.push_back({p + "mlp.down_proj.weight", {hidden, ffn}, weight_kind::linear});
  }
  out.push_back({"model.norm.weight", {hidden}, weight_kind::norm});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {c.vocab_size, hidden}, weight_kind::linear});
  return out;
}

namespace {

// Calls f(spec, vector) for every tensor of `w` in hf_tensor_specs order; W is model_weights or
// const model_weights.
template <class W, class F>
void visit_weights(W& w, F&& f) {
  const transformer_config& c = w.config;
  auto specs = hf_tensor_specs(c);
  std::size_t i = 0;
  auto one = [&](auto& v) { f(specs.at(i++), v); };
  one(w.embedding);
  for (auto& l : w.layers) {
    one(l.input_norm);
    one(l.q);
    if (c.qkv_bias) one(l.q_bias);
    one(l.k);
    if (c.qkv_bias) one(l.k_bias);
    one(l.v);
    if (c.qkv_bias) one(l.v_bias);
    one(l.o);
    if (c.o_bias) one(l.o_bias);
    one(l.post_attention_norm);
    one(l.gate);
    one(l.up);
    one(l.down);
  }
  one(w.final_norm);
  if (!c.tie_word_embeddings) one(w.lm_head);
}

}  // namespace

std::vector<weight_binding> bind_weights(model_weights& w) {
  w.layers.resize(w.config.num_hidden_layers);
  std::vector<weight_binding> out;
  visit_weights(w, [&](hf_tensor_spec& spec, std::vector<float>& v) { out.push_back({std::move(spec), &v}); });
  return out;
}

void model_weights::validate() const {
  config.validate("model_weights");
  if (layers.size() != config.num_hidden_layers) {
    throw std::runtime_error("model_weights: " + std::to_string(layers.size()) + " layers, the config says " +
                             std::to_string(config.num_hidden_layers));
  }
  visit_weights(*this, [](const hf_tensor_spec& spec, const std::vector<float>& v) {
    if (v.size() != spec.n_elements()) {
      throw std::runtime_error("model_weights: tensor '" + spec.name + "' holds " + std::to_string(v.size()) +
                               " values, expected " + shape_to_string(spec.shape));
    }
  });
  auto must_be_empty = [](const std::vector<float>& v, const std::string& what) {
    if (!v.empty()) throw std::runtime_error("model_weights: " + what + " is set but the config has none");
  };
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const std::string p = "layer " + std::to_string(l) + " ";
    if (!config.qkv_bias) {
      must_be_empty(layers[l].q_bias, p + "q bias");
      must_be_empty(layers[l].k_bias, p + "k bias");
      must_be_empty(layers[l].v_bias, p + "v bias");
    }
    if (!config.o_bias) must_be_empty(layers[l].o_bias, p + "o bias");
  }
}

uint64_t model_weights::bytes() const {
  uint64_t n = embedding.size() + final_norm.size() + lm_head.size();
  for (const auto& l : layers) {
    for (const auto* v : {&l.input_norm, &l.q, &l.k, &l.v, &l.q_bias, &l.k_bias, &l.v_bias, &l.o, &l.o_bias,
                          &l.post_attention_norm, &l.gate, &l.up, &l.down}) {
      n += v->size();
    }
  }
  return n * sizeof(float);
}

model_weights load_hf_model(const std::filesystem::path& dir) {
  model_weights w;
  w.config = load_hf_config(dir);
  const safetensors_checkpoint checkpoint(dir);
  for (const auto& b : bind_weights(w)) {
    b.data->resize(b.spec.n_elements());
    checkpoint.read_floats_into(b.spec.name, *b.data, b.spec.shape);
  }
  w.validate();
  return w;
}

std::shared_ptr<const model_weights> load_hf_model_shared(const std::filesystem::path& dir) {
  static shared_loads<model_weights> loads;
  return loads.get(canonical_key(dir), [&] { return std::make_shared<const model_weights>(load_hf_model(dir)); });
}

}  // namespace duet
