#include "runtime/http_api.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <utility>

#include "runtime/chat_template.hpp"
#include "runtime/config.hpp"
#include "runtime/gguf.hpp"
#include "runtime/gguf_model.hpp"
#include "runtime/tokenizer.hpp"
#include "runtime/vocab_check.hpp"

namespace duet {

using json = nlohmann::json;

namespace {

// ------------------------------------------------------------------ UTF-8

enum class utf8_status : uint8_t { ok, invalid, incomplete };
struct utf8_step {
  utf8_status status;
  std::size_t length;  // ok: the character's bytes; invalid: the maximal invalid subpart
};

/// One step of UTF-8 validation at `i` (Unicode 15, table 3-7: no overlongs, no surrogates).
utf8_step utf8_at(std::string_view s, std::size_t i) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char lead = b(i);
  if (lead < 0x80) return {utf8_status::ok, 1};
  std::size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 1;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 2;
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 3;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;
  } else {
    return {utf8_status::invalid, 1};
  }
  for (std::size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return {utf8_status::incomplete, k};
    const unsigned char c = b(i + k);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (c < l || c > h) return {utf8_status::invalid, k};
  }
  return {utf8_status::ok, need + 1};
}

constexpr std::string_view replacement_character = "\xEF\xBF\xBD";

/// Moves the complete characters of `pending` to the result; keeps an incomplete tail unless
/// `final`. Invalid bytes become U+FFFD, one per maximal invalid subpart.
std::string take_utf8(std::string& pending, bool final) {
  std::string out;
  std::size_t i = 0;
  while (i < pending.size()) {
    const auto step = utf8_at(pending, i);
    if (step.status == utf8_status::ok) {
      out.append(pending, i, step.length);
      i += step.length;
    } else if (step.status == utf8_status::invalid) {
      out += replacement_character;
      i += step.length;
    } else if (final) {
      out += replacement_character;
      i = pending.size();
    } else {
      break;
    }
  }
  pending.erase(0, i);
  return out;
}

class byte_decoder final : public text_decoder {
 public:
  std::string push(int32_t id) override {
    if (id >= 0 && id < 256) {
      pending_.push_back(static_cast<char>(id));
      return take_utf8(pending_, false);
    }
    std::string out = take_utf8(pending_, true);
    out += " <" + std::to_string(id) + ">";
    return out;
  }
  std::string flush() override { return take_utf8(pending_, true); }

 private:
  std::string pending_;
};

class tokenizer_decoder final : public text_decoder {
 public:
  explicit tokenizer_decoder(const tokenizer& tok) : decoder_(tok, /*skip_special=*/true) {}
  std::string push(int32_t id) override { return decoder_.push(id); }
  std::string flush() override { return decoder_.flush(); }

 private:
  stream_decoder decoder_;
};

// ------------------------------------------------------------------ request parsing

/// Thrown inside parse_api_request only; turned into its api_error result.
struct invalid_request {
  api_error error;
};

[[noreturn]] void fail(std::string message, std::string param) {
  throw invalid_request{bad_request(std::move(message), std::move(param))};
}

std::string_view type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    default: return "an unsupported value";
  }
}

[[noreturn]] void wrong_type(const std::string& param, std::string_view expected, const json& got) {
  fail("'" + param + "' must be " + std::string(expected) + ", not " + std::string(type_name(got)), param);
}

/// The field, or nullptr when absent or null (null means "not given", as in OpenAI's API).
const json* field(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> get_bool(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(key, "a boolean", *v);
  return v->get<bool>();
}

std::optional<double> get_number(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(key, "a number", *v);
  const double d = v->get<double>();
  if (!std::isfinite(d)) fail("'" + std::string(key) + "' must be finite", key);
  return d;
}

/// An integer (a float with an integral value is accepted too).
std::optional<int64_t> get_integer(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail("'" + std::string(key) + "' is too large", key);
    }
    return static_cast<int64_t>(u);
  }
  if (v->is_number_integer()) return v->get<int64_t>();
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18) return static_cast<int64_t>(d);
  }
  wrong_type(key, "an integer", *v);
}

std::optional<std::string> get_string(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) wrong_type(key, "a string", *v);
  return v->get<std::string>();
}

void check_range(const char* key, double value, double lo, double hi, bool lo_open = false) {
  const bool below = lo_open ? value <= lo : value < lo;
  if (below || value > hi) {
    auto num = [](double d) {
      std::string s = std::to_string(d);
      s.erase(s.find_last_not_of('0') + 1);
      if (!s.empty() && s.back() == '.') s.pop_back();
      return s;
    };
    fail("'" + std::string(key) + "' must be " + (lo_open ? "greater than " : "between ") + num(lo) +
             (lo_open ? " and at most " : " and ") + num(hi) + ", got " + num(value),
         key);
  }
}

int32_t token_id(const json& v, const std::string& param) {
  if (!v.is_number_integer() && !v.is_number_unsigned()) wrong_type(param, "an integer token id", v);
  if (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t(std::numeric_limits<int32_t>::max())
                             : (v.get<int64_t>() < 0 || v.get<int64_t>() > std::numeric_limits<int32_t>::max())) {
    fail("'" + param + "' holds a token id out of range", param);
  }
  return static_cast<int32_t>(v.get<int64_t>());
}

std::vector<int32_t> token_list(const json& arr, const std::string& param) {
  std::vector<int32_t> out;
  out.reserve(arr.size());
  for (std::size_t i = 0; i < arr.size(); ++i) out.push_back(token_id(arr[i], param));
  return out;
}

void parse_prompt(const json& body, api_request& r) {
  const json* p = field(body, "prompt");
  if (!p) fail("'prompt' is required", "prompt");
  if (p->is_string()) {
    r.prompt = p->get<std::string>();
    return;
  }
  if (!p->is_array()) wrong_type("prompt", "a string or an array of token ids", *p);
  if (p->empty()) fail("'prompt' must not be empty", "prompt");
  const json& first = (*p)[0];
  if (first.is_number()) {
    r.prompt_tokens = token_list(*p, "prompt");
    r.prompt_is_tokens = true;
    return;
  }
  if (p->size() > 1) fail("batched prompts are not supported: send one prompt per request", "prompt");
  if (first.is_string()) {
    r.prompt = first.get<std::string>();
  } else if (first.is_array()) {
    if (first.empty()) fail("'prompt' must not be empty", "prompt");
    r.prompt_tokens = token_list(first, "prompt");
    r.prompt_is_tokens = true;
  } else {
    wrong_type("prompt", "a string or an array of token ids", first);
  }
}

std::string message_content(const json& content, const std::string& param) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) wrong_type(param, "a string or an array of text parts", content);
  std::string text;
  for (std::size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string where = param + "[" + std::to_string(i) + "]";
    if (!part.is_object()) wrong_type(where, "an object", part);
    const auto type = get_string(part, "type");
    if (type != "text") {
      fail("only text content parts are supported, got type '" + type.value_or("") + "'", where + ".type");
    }
    const auto t = get_string(part, "text");
    if (!t) fail("'" + where + ".text' is required", where + ".text");
    text += *t;
  }
  return text;
}

void parse_messages(const json& body, api_request& r) {
  const json* m = field(body, "messages");
  if (!m) fail("'messages' is required", "messages");
  if (!m->is_array()) wrong_type("messages", "an array", *m);
  if (m->empty()) fail("'messages' must hold at least one message", "messages");
  for (std::size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!msg.is_object()) wrong_type(where, "an object", msg);
    const json* role = field(msg, "role");
    if (!role) fail("'" + where + ".role' is required", where + ".role");
    if (!role->is_string()) wrong_type(where + ".role", "a string", *role);
    std::string name = role->get<std::string>();
    if (name == "developer") name = "system";
    if (name != "system" && name != "user" && name != "assistant") {
      fail("'" + where + ".role' must be one of system, user, assistant, developer; got '" +
               role->get<std::string>() + "'",
           where + ".role");
    }
    chat_message out;
    out.role = std::move(name);
    if (const json* c = field(msg, "content")) {
      out.content = message_content(*c, where + ".content");
    } else if (out.role != "assistant") {
      fail("'" + where + ".content' is required", where + ".content");
    }
    r.messages.push_back(std::move(out));
  }
}

void parse_stop(const json& body, api_request& r, const api_parse_options& options) {
  const json* s = field(body, "stop");
  if (!s) return;
  std::vector<std::string> stops;
  if (s->is_string()) {
    stops.push_back(s->get<std::string>());
  } else if (s->is_array()) {
    for (const auto& e : *s) {
      if (!e.is_string()) wrong_type("stop", "a string or an array of strings", e);
      stops.push_back(e.get<std::string>());
    }
  } else {
    wrong_type("stop", "a string or an array of strings", *s);
  }
  std::erase_if(stops, [](const std::string& x) { return x.empty(); });
  if (stops.size() > options.max_stop_strings) {
    fail("'stop' may hold at most " + std::to_string(options.max_stop_strings) + " strings", "stop");
  }
  for (const auto& x : stops) {
    if (x.size() > options.max_stop_bytes) {
      fail("each stop string may be at most " + std::to_string(options.max_stop_bytes) + " bytes", "stop");
    }
  }
  r.stop = std::move(stops);
}

/// Parameters of OpenAI's API that this server does not implement: refused clearly rather
/// than silently ignored, when they ask for something other than the default.
void refuse_unsupported(const json& body, api_kind kind) {
  if (auto n = get_integer(body, "n"); n && *n != 1) fail("only n = 1 is supported", "n");
  if (kind == api_kind::completion) {
    if (auto b = get_integer(body, "best_of"); b && *b != 1) fail("only best_of = 1 is supported", "best_of");
    if (get_bool(body, "echo").value_or(false)) fail("echo is not supported", "echo");
    if (auto s = get_string(body, "suffix"); s && !s->empty()) fail("suffix is not supported", "suffix");
  }
  if (const json* lb = field(body, "logit_bias")) {
    if (!lb->is_object()) wrong_type("logit_bias", "an object", *lb);
    if (!lb->empty()) fail("logit_bias is not supported", "logit_bias");
  }
  if (kind == api_kind::chat) {
    if (const json* t = field(body, "tools")) {
      if (!t->is_array()) wrong_type("tools", "an array", *t);
      if (!t->empty()) fail("tool calling is not supported", "tools");
    }
    if (const json* f = field(body, "response_format")) {
      if (!f->is_object()) wrong_type("response_format", "an object", *f);
      const auto type = get_string(*f, "type");
      if (type && *type != "text") fail("only response_format type 'text' is supported", "response_format");
    }
  }
}

void parse_sampling(const json& body, api_request& r) {
  auto& s = r.sampling;
  if (auto v = get_number(body, "temperature")) {
    check_range("temperature", *v, 0, 2);
    s.temperature = static_cast<float>(*v);
  } else {
    s.temperature = 1.0f;  // OpenAI's default
  }
  if (auto v = get_number(body, "top_p")) {
    check_range("top_p", *v, 0, 1, /*lo_open=*/true);
    s.top_p = static_cast<float>(*v);
  }
  if (auto v = get_integer(body, "top_k")) {
    if (*v < -1 || *v > std::numeric_limits<int32_t>::max()) fail("'top_k' must be -1 (off), 0 (off) or positive", "top_k");
    s.top_k = *v < 0 ? 0 : static_cast<int32_t>(*v);
  }
  if (auto v = get_number(body, "min_p")) {
    check_range("min_p", *v, 0, 1);
    s.min_p = static_cast<float>(*v);
  }
  if (auto v = get_number(body, "presence_penalty")) {
    check_range("presence_penalty", *v, -2, 2);
    s.presence_penalty = static_cast<float>(*v);
  }
  if (auto v = get_number(body, "frequency_penalty")) {
    check_range("frequency_penalty", *v, -2, 2);
    s.frequency_penalty = static_cast<float>(*v);
  }
  if (auto v = get_number(body, "repetition_penalty")) {
    check_range("repetition_penalty", *v, 0, 2, /*lo_open=*/true);
    s.repetition_penalty = static_cast<float>(*v);
  }
  if (auto v = get_integer(body, "seed")) {
    s.seed = static_cast<uint64_t>(*v);
    s.has_seed = true;
  }
  if (auto v = get_bool(body, "ignore_eos")) s.ignore_eos = *v;
  if (const json* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) wrong_type("stop_token_ids", "an array of token ids", *ids);
    s.stop_token_ids = token_list(*ids, "stop_token_ids");
  }
}

/// OpenAI's two names for the limit, and `max_new_tokens` (the field the user's field notes
/// and the ZeroMQ protocol use). Any of them may be sent; several must agree.
void parse_max_tokens(const json& body, api_request& r) {
  for (const char* key : {"max_tokens", "max_completion_tokens", "max_new_tokens"}) {
    auto v = get_integer(body, key);
    if (!v) continue;
    if (*v < 1) fail("'" + std::string(key) + "' must be at least 1, got " + std::to_string(*v), key);
    if (*v > std::numeric_limits<uint32_t>::max()) fail("'" + std::string(key) + "' is too large", key);
    if (r.max_tokens && *r.max_tokens != *v) {
      fail("'" + r.max_tokens_param + "' (" + std::to_string(*r.max_tokens) + ") and '" + key + "' (" +
               std::to_string(*v) + ") disagree: send one of them",
           key);
    }
    if (!r.max_tokens) r.max_tokens_param = key;
    r.max_tokens = static_cast<uint32_t>(*v);
  }
}

void parse_logprobs(const json& body, api_request& r) {
  if (r.kind == api_kind::completion) {
    // Completions: logprobs is the number of top alternatives (0..5).
    if (const json* v = field(body, "logprobs")) {
      if (v->is_boolean()) {
        r.logprobs = v->get<bool>();
      } else {
        const auto n = get_integer(body, "logprobs");
        if (*n < 0 || *n > 5) fail("'logprobs' must be between 0 and 5", "logprobs");
        r.logprobs = true;
        r.sampling.top_logprobs = static_cast<uint32_t>(*n);
      }
    }
    r.sampling.logprobs = r.logprobs;
    return;
  }
  r.logprobs = get_bool(body, "logprobs").value_or(false);
  if (auto n = get_integer(body, "top_logprobs")) {
    if (*n < 0 || *n > 20) fail("'top_logprobs' must be between 0 and 20", "top_logprobs");
    if (!r.logprobs && *n > 0) fail("'top_logprobs' requires 'logprobs' to be true", "top_logprobs");
    r.sampling.top_logprobs = static_cast<uint32_t>(*n);
  }
  r.sampling.logprobs = r.logprobs;
}

}  // namespace

// ------------------------------------------------------------------ codecs

std::vector<int32_t> byte_text_codec::encode(std::string_view text, bool) const {
  std::vector<int32_t> out;
  out.reserve(text.size());
  for (unsigned char c : text) out.push_back(c);
  return out;
}

std::unique_ptr<text_decoder> byte_text_codec::decoder() const { return std::make_unique<byte_decoder>(); }

std::string byte_text_codec::token_bytes(int32_t id) const {
  if (id >= 0 && id < 256) return std::string(1, static_cast<char>(id));
  return " <" + std::to_string(id) + ">";
}

std::string text_codec::token_bytes(int32_t id) const {
  auto d = decoder();
  std::string out = d->push(id);
  out += d->flush();
  return out;
}

std::string tokenizer_text_codec::token_bytes(int32_t id) const { return std::string(tok_->token_bytes(id)); }

tokenizer_text_codec::tokenizer_text_codec(std::shared_ptr<const tokenizer> tok) : tok_(std::move(tok)) {
  if (!tok_) throw std::invalid_argument("tokenizer_text_codec: no tokenizer");
}

std::vector<int32_t> tokenizer_text_codec::encode(std::string_view text, bool add_special) const {
  return tok_->encode(text, add_special);
}

std::unique_ptr<text_decoder> tokenizer_text_codec::decoder() const {
  return std::make_unique<tokenizer_decoder>(*tok_);
}

std::shared_ptr<const text_codec> make_text_codec(const deployment_config& config) {
  if (config.engine.kind == "sim") return std::make_shared<byte_text_codec>();
  namespace fs = std::filesystem;
  const fs::path path = config.model.path;
  if (path.empty()) {
    throw std::runtime_error("HTTP front end: engine '" + config.engine.kind +
                             "' needs a tokenizer, but model.path is empty");
  }
  if (is_gguf_file(path)) {
    return std::make_shared<tokenizer_text_codec>(std::make_shared<const tokenizer>(load_gguf_tokenizer(path)));
  }
  std::error_code ec;
  const bool usable = fs::is_directory(path, ec) || path.extension() == ".json";
  if (!usable) {
    throw std::runtime_error("HTTP front end: no tokenizer for model.path '" + path.string() +
                             "' (give the HF checkpoint directory or a .gguf file)");
  }
  return std::make_shared<tokenizer_text_codec>(std::make_shared<const tokenizer>(load_tokenizer_json(path)));
}

std::optional<vocab_check_report> check_model_vocab(const deployment_config& config) {
  if (config.engine.kind == "sim" || config.model.path.empty()) return std::nullopt;
  const std::filesystem::path path = config.model.path;
  if (is_gguf_file(path)) {
    const gguf_file file(path);
    return check_vocab(model_vocab_of(gguf_transformer_config(file), path.string() + " (GGUF metadata)"),
                       gguf_read_tokenizer(file), path.string() + " (tokenizer.ggml.*)");
  }
  return check_model_dir_vocab(path);
}

// ------------------------------------------------------------------ chat

std::string plain_chat_template::render(std::span<const chat_message> messages, bool add_generation_prompt) const {
  std::string out;
  for (const auto& m : messages) {
    out += "<|" + m.role + "|>\n";
    out += m.content;
    out += '\n';
  }
  if (add_generation_prompt) out += "<|assistant|>\n";
  return out;
}

struct jinja_chat_renderer::state {
  chat_template tmpl;
  std::string bos;
  std::string eos;
};

jinja_chat_renderer::jinja_chat_renderer(std::string source, std::string bos_token, std::string eos_token)
    : state_(std::make_unique<const state>(state{chat_template(std::move(source)), std::move(bos_token),
                                                 std::move(eos_token)})) {}

jinja_chat_renderer::~jinja_chat_renderer() = default;

std::string jinja_chat_renderer::render(std::span<const chat_message> messages, bool add_generation_prompt) const {
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const auto& m : messages) list.push_back({{"role", m.role}, {"content", m.content}});
  try {
    return state_->tmpl.render_chat(list, add_generation_prompt, state_->bos, state_->eos);
  } catch (const chat_template_exception& e) {
    throw std::invalid_argument(std::string("the chat template refused the messages: ") + e.what());
  } catch (const chat_template_render_error& e) {
    throw std::invalid_argument(std::string("the chat template failed on the messages: ") + e.what());
  }
}

std::shared_ptr<const chat_template_renderer> make_chat_renderer(const text_codec& codec) {
  if (const auto* t = dynamic_cast<const tokenizer_text_codec*>(&codec)) {
    const tokenizer& tok = t->tok();
    if (!tok.chat_template().empty()) {
      auto token_text = [&](std::optional<int32_t> id) {
        return id ? std::string(tok.id_to_token(*id)) : std::string();
      };
      try {
        return std::make_shared<jinja_chat_renderer>(tok.chat_template(), token_text(tok.bos_id()),
                                                     token_text(tok.eos_id()));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "HTTP front end: the model's chat template does not parse (%s); using the plain one\n",
                     e.what());
      }
    }
  }
  return std::make_shared<plain_chat_template>();
}

// ------------------------------------------------------------------ errors

json api_error::to_json() const {
  json e;
  e["message"] = message;
  e["type"] = type;
  e["param"] = param.empty() ? json(nullptr) : json(param);
  e["code"] = code.empty() ? json(nullptr) : json(code);
  return json{{"error", std::move(e)}};
}

std::string api_error::body() const { return dump_json(to_json()); }

api_error bad_request(std::string message, std::string param) {
  api_error e;
  e.status = 400;
  e.message = std::move(message);
  e.param = std::move(param);
  return e;
}

api_error error_from_cluster(msg::error_code code, std::string message, uint32_t retry_after_ms) {
  api_error e;
  e.message = std::move(message);
  const uint32_t retry_s = std::max<uint32_t>(1, (retry_after_ms + 999) / 1000);
  switch (code) {
    case msg::error_code::bad_request: e.status = 400; break;
    case msg::error_code::prompt_too_long:
      e.status = 400;
      e.code = "context_length_exceeded";
      break;
    case msg::error_code::overloaded:
      e.status = 429;
      e.type = "rate_limit_error";
      e.code = "rate_limit_exceeded";
      e.retry_after_s = retry_s;
      break;
    case msg::error_code::unavailable:
      e.status = 503;
      e.type = "service_unavailable_error";
      e.code = "unavailable";
      e.retry_after_s = retry_s;
      break;
    case msg::error_code::not_found:
      e.status = 404;
      e.code = "not_found";
      break;
    case msg::error_code::unauthorized:
      e.status = 401;
      e.code = "invalid_api_key";
      break;
    case msg::error_code::timeout:
      e.status = 504;
      e.type = "timeout_error";
      e.code = "timeout";
      break;
    default:
      e.status = 500;
      e.type = "server_error";
      e.code = std::string(msg::to_string(code));
      break;
  }
  return e;
}

// ------------------------------------------------------------------ requests

std::size_t json_nesting_depth(std::string_view text) {
  std::size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '[' || c == '{') deepest = std::max(deepest, ++depth);
    else if ((c == ']' || c == '}') && depth > 0) --depth;
  }
  return deepest;
}

std::variant<api_request, api_error> parse_api_request(api_kind kind, std::string_view body,
                                                       const api_parse_options& options) {
  if (json_nesting_depth(body) > options.max_json_depth) {
    return bad_request("the JSON body is nested deeper than " + std::to_string(options.max_json_depth) + " levels");
  }
  json doc = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return bad_request("We could not parse the JSON body of your request. The body must be a valid JSON object.");
  }
  if (!doc.is_object()) return bad_request("the request body must be a JSON object");
  try {
    api_request r;
    r.kind = kind;
    if (const json* m = field(doc, "model")) {
      if (!m->is_string()) wrong_type("model", "a string", *m);
      r.model = m->get<std::string>();
      if (r.model != options.model_name) {
        api_error e;
        e.status = 404;
        e.message = "The model '" + r.model + "' does not exist; this server serves '" + options.model_name + "'.";
        e.param = "model";
        e.code = "model_not_found";
        return e;
      }
    } else {
      r.model = options.model_name;
    }
    if (kind == api_kind::completion) parse_prompt(doc, r);
    else parse_messages(doc, r);
    refuse_unsupported(doc, kind);
    parse_max_tokens(doc, r);
    parse_sampling(doc, r);
    parse_stop(doc, r, options);
    parse_logprobs(doc, r);
    r.stream = get_bool(doc, "stream").value_or(false);
    if (const json* so = field(doc, "stream_options")) {
      if (!so->is_object()) wrong_type("stream_options", "an object", *so);
      if (!r.stream) fail("'stream_options' is only allowed when 'stream' is true", "stream_options");
      r.include_usage = get_bool(*so, "include_usage").value_or(false);
    }
    r.user = get_string(doc, "user").value_or("");
    if (auto f = get_string(doc, "reasoning_format")) {
      if (*f == "split" || *f == "deepseek") r.reasoning = reasoning_format::split;
      else if (*f == "raw" || *f == "none") r.reasoning = reasoning_format::raw;
      else fail("'reasoning_format' must be 'split' or 'raw'", "reasoning_format");
    }
    return r;
  } catch (const invalid_request& e) {
    return e.error;
  } catch (const json::exception& e) {
    return bad_request(std::string("invalid request: ") + e.what());
  }
}

std::variant<uint32_t, api_error> resolve_max_tokens(const api_request& request, std::size_t prompt_tokens,
                                                     uint32_t max_context, uint32_t default_max_tokens,
                                                     uint32_t max_new_tokens_limit) {
  const bool prompt_fits = prompt_tokens + 1 <= max_context;
  const uint64_t room = prompt_fits ? max_context - prompt_tokens : 0;
  if (request.max_tokens) {
    const uint64_t wanted = *request.max_tokens;
    const std::string param = !request.max_tokens_param.empty()     ? request.max_tokens_param
                              : request.kind == api_kind::chat ? "max_completion_tokens"
                                                               : "max_tokens";
    if (prompt_fits && wanted > room) {
      api_error e = bad_request("This model's maximum context length is " + std::to_string(max_context) +
                                    " tokens. However, you requested " + std::to_string(prompt_tokens + wanted) +
                                    " tokens (" + std::to_string(prompt_tokens) + " in the prompt, " +
                                    std::to_string(wanted) + " for the completion).",
                                param);
      e.code = "context_length_exceeded";
      return e;
    }
    if (wanted > max_new_tokens_limit) {
      return bad_request("'" + param + "' must be at most " + std::to_string(max_new_tokens_limit), param);
    }
    return static_cast<uint32_t>(wanted);
  }
  uint64_t n = default_max_tokens > 0 ? default_max_tokens : room;
  n = std::min<uint64_t>({n, room, max_new_tokens_limit});
  return static_cast<uint32_t>(std::max<uint64_t>(n, 1));
}

// ------------------------------------------------------------------ responses

json api_usage::to_json() const {
  return json{{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens}};
}

namespace {

json head_json(const api_response_head& head, bool chunk) {
  json j;
  j["id"] = head.id;
  if (head.kind == api_kind::completion) j["object"] = "text_completion";
  else j["object"] = chunk ? "chat.completion.chunk" : "chat.completion";
  j["created"] = head.created;
  j["model"] = head.model;
  j["system_fingerprint"] = nullptr;
  return j;
}

json finish_json(std::string_view finish_reason) {
  return finish_reason.empty() ? json(nullptr) : json(std::string(finish_reason));
}

}  // namespace

json full_response(const api_response_head& head, const std::string& text, const std::optional<std::string>& reasoning,
                   std::string_view finish_reason, const api_usage& usage, const json& logprobs) {
  json j = head_json(head, false);
  json choice;
  choice["index"] = 0;
  if (head.kind == api_kind::completion) {
    choice["text"] = text;
  } else {
    json message{{"role", "assistant"}, {"content", text}};
    if (reasoning) message["reasoning_content"] = *reasoning;
    choice["message"] = std::move(message);
  }
  choice["logprobs"] = logprobs;
  choice["finish_reason"] = finish_json(finish_reason);
  j["choices"] = json::array({std::move(choice)});
  j["usage"] = usage.to_json();
  return j;
}

json stream_chunk(const api_response_head& head, const chunk_delta& delta, std::string_view finish_reason,
                  bool usage_null) {
  json j = head_json(head, true);
  json choice;
  choice["index"] = 0;
  if (head.kind == api_kind::completion) {
    choice["text"] = delta.content.value_or("");
  } else {
    json d = json::object();
    if (delta.role) d["role"] = "assistant";
    if (delta.content) d["content"] = *delta.content;
    if (delta.reasoning) d["reasoning_content"] = *delta.reasoning;
    choice["delta"] = std::move(d);
  }
  choice["logprobs"] = delta.logprobs;
  choice["finish_reason"] = finish_json(finish_reason);
  j["choices"] = json::array({std::move(choice)});
  if (usage_null) j["usage"] = nullptr;
  return j;
}

namespace {
constexpr std::string_view delta_marker = "@@duet-delta@@";

/// `text` as the inside of a JSON string, as nlohmann's dump writes it; false for invalid UTF-8.
bool escape_json_text(std::string_view text, std::string& out) {
  static constexpr char hex[] = "0123456789abcdef";
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x80) {
      const auto step = utf8_at(text, i);
      if (step.status != utf8_status::ok) return false;
      out.append(text, i, step.length);
      i += step.length;
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += static_cast<char>(c);
        }
    }
    ++i;
  }
  return true;
}
}  // namespace

content_event_writer::content_event_writer(const api_response_head& head, bool usage_null) {
  chunk_delta d;
  d.content = std::string(delta_marker);
  const std::string whole = sse_event(stream_chunk(head, d, "", usage_null));
  const std::size_t at = whole.find(delta_marker);
  prefix_ = whole.substr(0, at);
  suffix_ = whole.substr(at + delta_marker.size());
}

std::string content_event_writer::content_event(std::string_view text) const {
  std::string out;
  out.reserve(prefix_.size() + text.size() + suffix_.size() + 8);
  out += prefix_;
  if (!escape_json_text(text, out)) {
    const std::string quoted = dump_json(json(std::string(text)));  // replaces invalid UTF-8
    out.resize(prefix_.size());
    out.append(quoted, 1, quoted.size() - 2);
  }
  out += suffix_;
  return out;
}

logprobs_writer::logprobs_writer(api_kind kind, std::shared_ptr<const text_codec> codec)
    : kind_(kind), codec_(std::move(codec)) {}

json logprobs_writer::text_json(const std::string& bytes) const {
  // Invalid UTF-8 (a token that is part of a character) becomes U+FFFD here, not at dump time.
  const std::string text = dump_json(json(bytes));
  return json::parse(text);
}

void logprobs_writer::add(int32_t token, const msg::token_logprobs& lp) {
  const std::string bytes = codec_->token_bytes(token);
  const json text = text_json(bytes);
  const std::size_t n = std::min(lp.top_ids.size(), lp.top_logprobs.size());
  if (kind_ == api_kind::chat) {
    if (pending_.is_null()) pending_ = json::array();
    json top = json::array();
    for (std::size_t k = 0; k < n; ++k) {
      const std::string b = codec_->token_bytes(lp.top_ids[k]);
      top.push_back(json{{"token", text_json(b)},
                         {"logprob", lp.top_logprobs[k]},
                         {"bytes", std::vector<uint8_t>(b.begin(), b.end())}});
    }
    pending_.push_back(json{{"token", text},
                            {"logprob", lp.logprob},
                            {"bytes", std::vector<uint8_t>(bytes.begin(), bytes.end())},
                            {"top_logprobs", std::move(top)}});
  } else {
    if (pending_.is_null()) {
      pending_ = json{{"tokens", json::array()},
                      {"token_logprobs", json::array()},
                      {"top_logprobs", json::array()},
                      {"text_offset", json::array()}};
    }
    json top = json::object();
    for (std::size_t k = 0; k < n; ++k) {
      top[text_json(codec_->token_bytes(lp.top_ids[k])).get<std::string>()] = lp.top_logprobs[k];
    }
    pending_["tokens"].push_back(text);
    pending_["token_logprobs"].push_back(lp.logprob);
    pending_["top_logprobs"].push_back(std::move(top));
    pending_["text_offset"].push_back(text_offset_);
  }
  const std::string& shown = text.get_ref<const std::string&>();
  for (unsigned char c : shown) text_offset_ += (c & 0xc0) != 0x80;  // code points
  ++count_;
}

json logprobs_writer::take() {
  if (count_ == 0) return nullptr;
  count_ = 0;
  if (kind_ == api_kind::chat) return json{{"content", std::exchange(pending_, nullptr)}};
  return std::exchange(pending_, nullptr);
}

json usage_chunk(const api_response_head& head, const api_usage& usage) {
  json j = head_json(head, true);
  j["choices"] = json::array();
  j["usage"] = usage.to_json();
  return j;
}

json models_response(const std::string& model, int64_t created) {
  json m{{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "duet"}};
  return json{{"object", "list"}, {"data", json::array({std::move(m)})}};
}

std::string make_response_id(api_kind kind) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static constexpr char hex[] = "0123456789abcdef";
  std::string id = kind == api_kind::chat ? "chatcmpl-" : "cmpl-";
  for (int i = 0; i < 24; ++i) id += hex[rng() & 15];
  return id;
}

std::string_view openai_finish_reason(msg::finish_reason reason) {
  switch (reason) {
    case msg::finish_reason::stop: return "stop";
    case msg::finish_reason::length: return "length";
    default: return "";
  }
}

// ------------------------------------------------------------------ framing

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string sse_event(const json& j) {
  std::string out = "data: ";
  out += dump_json(j);
  out += "\n\n";
  return out;
}

std::string_view sse_done() { return "data: [DONE]\n\n"; }

std::string http_chunk(std::string_view data) {
  if (data.empty()) return {};
  char size[20];
  const int n = std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  std::string out;
  out.reserve(static_cast<std::size_t>(n) + data.size() + 2);
  out.append(size, static_cast<std::size_t>(n));
  out.append(data);
  out += "\r\n";
  return out;
}

std::string_view http_last_chunk() { return "0\r\n\r\n"; }

// ------------------------------------------------------------------ stop strings

namespace {

/// Length of the longest suffix of `text` that is a proper prefix of `pattern`.
std::size_t partial_suffix(std::string_view text, std::string_view pattern) {
  const std::size_t most = std::min(text.size(), pattern.empty() ? 0 : pattern.size() - 1);
  for (std::size_t k = most; k > 0; --k) {
    if (text.substr(text.size() - k) == pattern.substr(0, k)) return k;
  }
  return 0;
}

}  // namespace

stop_matcher::stop_matcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  std::erase_if(stops_, [](const std::string& s) { return s.empty(); });
}

stop_matcher::output stop_matcher::feed(std::string_view text) {
  output out;
  if (stopped_) return out;
  held_.append(text);
  if (stops_.empty()) {
    out.text = std::move(held_);
    held_.clear();
    return out;
  }
  std::size_t first = std::string::npos;
  for (const auto& s : stops_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    out.text = held_.substr(0, first);
    out.stopped = stopped_ = true;
    held_.clear();
    return out;
  }
  std::size_t keep = 0;
  for (const auto& s : stops_) keep = std::max(keep, partial_suffix(held_, s));
  out.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string stop_matcher::flush() {
  if (stopped_) return {};
  return std::exchange(held_, {});
}

// ------------------------------------------------------------------ reasoning

namespace {
constexpr std::string_view think_open = "<think>";
constexpr std::string_view think_close = "</think>";
constexpr std::string_view whitespace = " \t\r\n";
}  // namespace

think_splitter::think_splitter(bool start_in_reasoning)
    : phase_(start_in_reasoning ? phase::inside : phase::before), opened_(start_in_reasoning) {}

think_splitter::output think_splitter::feed(std::string_view text) {
  output out;
  held_.append(text);
  for (;;) {
    if (phase_ == phase::before) {
      // A think block only opens at the very start of the output (after whitespace).
      const std::size_t start = held_.find_first_not_of(whitespace);
      if (start == std::string::npos) return out;  // only whitespace so far: undecided
      const std::string_view rest = std::string_view(held_).substr(start);
      if (rest.starts_with(think_open)) {
        held_.erase(0, start + think_open.size());
        phase_ = phase::inside;
        opened_ = true;
        continue;
      }
      if (think_open.starts_with(rest)) return out;  // a partial tag: wait
      phase_ = phase::after;
      continue;
    }
    if (phase_ == phase::inside) {
      const std::size_t close = held_.find(think_close);
      if (close != std::string::npos) {
        out.reasoning.append(held_, 0, close);
        held_.erase(0, close + think_close.size());
        phase_ = phase::after;
        continue;
      }
      const std::size_t keep = partial_suffix(held_, think_close);
      out.reasoning.append(held_, 0, held_.size() - keep);
      held_.erase(0, held_.size() - keep);
      return out;
    }
    out.content += held_;
    held_.clear();
    return out;
  }
}

think_splitter::output think_splitter::flush() {
  output out;
  if (phase_ == phase::inside) out.reasoning = std::move(held_);
  else out.content = std::move(held_);
  held_.clear();
  return out;
}

bool think_splitter::prompt_opens_think(std::string_view prompt) {
  const std::size_t end = prompt.find_last_not_of(whitespace);
  if (end == std::string_view::npos) return false;
  return prompt.substr(0, end + 1).ends_with(think_open);
}

}  // namespace duet
