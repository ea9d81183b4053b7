#pragma once
// Hugging Face model directories: config.json to a transformer_config, and the fp32 weights
// of a Llama- or Qwen2-architecture model (model_weights), loaded from safetensors.
//
// model_weights is loader-neutral: any loader (safetensors here, GGUF elsewhere) fills the same
// struct in Hugging Face's conventions (row-major [out, in] matrices, rotate-half RoPE pairing
// of q/k rows) and calls validate(). docs/cpu-engine.md describes the conventions.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace duet {

/// rope_scaling of config.json. Only rope_type "llama3" changes the frequencies; a config
/// without rope_scaling (or rope_type "default") uses plain RoPE.
struct rope_scaling_config {
  std::string rope_type = "llama3";
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  uint32_t original_max_position_embeddings = 8192;
};

/// The hyper-parameters of a decoder-only transformer, named as config.json names them.
struct transformer_config {
  std::string arch;          // "llama" | "qwen2"
  std::string architecture;  // "LlamaForCausalLM" | "Qwen2ForCausalLM"
  uint32_t hidden_size = 0;
  uint32_t intermediate_size = 0;
  uint32_t num_hidden_layers = 0;
  uint32_t num_attention_heads = 0;
  uint32_t num_key_value_heads = 0;  // default: num_attention_heads
  uint32_t head_dim = 0;             // default: hidden_size / num_attention_heads
  uint32_t vocab_size = 0;
  uint32_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<rope_scaling_config> rope_scaling;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // q/k/v projections have biases (qwen2; llama with attention_bias)
  bool o_bias = false;    // the output projection has a bias (llama with attention_bias)
  std::optional<int32_t> bos_token_id;
  std::vector<int32_t> eos_token_ids;  // eos_token_id, an int or a list
  std::string torch_dtype;             // "bfloat16", "float16", "float32" ("" when absent)

  /// Checks the values against each other (heads divide, head_dim even, ...). Throws
  /// std::runtime_error("hf config: <source>: ...").
  void validate(std::string_view source) const;
  [[nodiscard]] uint32_t q_dim() const { return num_attention_heads * head_dim; }
  [[nodiscard]] uint32_t kv_dim() const { return num_key_value_heads * head_dim; }
};

/// Parses config.json text. Refuses architectures other than LlamaForCausalLM and
/// Qwen2ForCausalLM by name, and features the CPU engine does not implement (other rope
/// scaling types, mlp_bias, sliding windows, activations other than silu). Accepts both the
/// classic keys (rope_theta, rope_scaling) and transformers 5's rope_parameters.
/// Errors: std::runtime_error("hf config: <source>: key '<key>': <what>").
[[nodiscard]] transformer_config parse_hf_config(std::string_view json_text, std::string_view source);
/// Reads `<dir>/config.json` (or `path` itself when it is a file).
[[nodiscard]] transformer_config load_hf_config(const std::filesystem::path& path);
/// config.json text for `config` (two-space indent, keys sorted, trailing newline), in the
/// form the published R1-Distill checkpoints use.
[[nodiscard]] std::string hf_config_json(const transformer_config& config);

/// What a tensor is for; loaders and writers treat the kinds differently (norms are ones).
enum class weight_kind : uint8_t { embedding, norm, linear, bias };

/// One tensor of a checkpoint, named and shaped as Hugging Face stores it.
struct hf_tensor_spec {
  std::string name;             // "model.layers.0.self_attn.q_proj.weight"
  std::vector<uint64_t> shape;  // [rows, cols] of a matrix, [n] of a vector
  weight_kind kind = weight_kind::linear;
  [[nodiscard]] uint64_t n_elements() const;
};

/// Every tensor a checkpoint of `config` holds, in model order (lm_head.weight only when the
/// embeddings are not tied; biases only when the config has them).
[[nodiscard]] std::vector<hf_tensor_spec> hf_tensor_specs(const transformer_config& config);

/// One layer's weights; matrices are row-major [out, in].
struct layer_weights {
  std::vector<float> input_norm;      // [hidden]
  std::vector<float> q, k, v;         // [heads*head_dim, hidden], [kv_heads*head_dim, hidden] x2
  std::vector<float> q_bias, k_bias, v_bias;  // [heads*head_dim], [kv_dim] x2; empty when none
  std::vector<float> o;               // [hidden, heads*head_dim]
  std::vector<float> o_bias;          // [hidden]; empty when none
  std::vector<float> post_attention_norm;  // [hidden]
  std::vector<float> gate, up;        // [ffn, hidden]
  std::vector<float> down;            // [hidden, ffn]
};

/// fp32 weights of a whole model, by role.
struct model_weights {
  transformer_config config;
  std::vector<float> embedding;   // [vocab, hidden]
  std::vector<layer_weights> layers;
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> lm_head;     // [vocab, hidden]; empty when tie_word_embeddings

  /// The LM head matrix: lm_head, or the embedding when tied.
  [[nodiscard]] const std::vector<float>& output_weights() const {
    return config.tie_word_embeddings ? embedding : lm_head;
  }
  /// Checks every tensor's size against the config; throws naming the tensor.
  void validate() const;
  /// Bytes of fp32 data held.
  [[nodiscard]] uint64_t bytes() const;
};

/// A tensor spec with the vector of `weights` that holds it.
struct weight_binding {
  hf_tensor_spec spec;
  std::vector<float>* data = nullptr;
};
/// hf_tensor_specs(weights.config), each bound to its vector in `weights` (layers sized first).
[[nodiscard]] std::vector<weight_binding> bind_weights(model_weights& weights);

/// Loads config.json and the safetensors weights of a Hugging Face model directory, converting
/// BF16/F16/F32 to float. Every tensor must be present with its exact shape (errors name the
/// file and tensor); a tied model may omit lm_head.weight.
[[nodiscard]] model_weights load_hf_model(const std::filesystem::path& dir);
/// load_hf_model, shared: one copy per process while any user holds it (weights are
/// read-only), keyed by the canonical path.
[[nodiscard]] std::shared_ptr<const model_weights> load_hf_model_shared(const std::filesystem::path& dir);

}  // namespace duet
