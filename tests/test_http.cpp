// The OpenAI-compatible API's pure parts: request parsing and validation, error shapes,
// response and chunk shapes, SSE and chunked framing, stop strings across token boundaries,
// the byte codec, and the <think> splitter. The server itself is tested end to end by
// tests/http/test_openai_api.py with the official openai SDK.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/config.hpp"
#include "runtime/http_api.hpp"
#include "runtime/http_frontend.hpp"

using duet::api_error;
using duet::api_kind;
using duet::api_request;
using json = nlohmann::json;

namespace {

duet::api_parse_options options() {
  duet::api_parse_options o;
  o.model_name = "m";
  return o;
}

api_request parse_ok(api_kind kind, const std::string& body) {
  auto r = duet::parse_api_request(kind, body, options());
  if (auto* e = std::get_if<api_error>(&r)) FAIL("unexpected error: " << e->message);
  return std::get<api_request>(r);
}

api_error parse_err(api_kind kind, const std::string& body) {
  auto r = duet::parse_api_request(kind, body, options());
  if (!std::holds_alternative<api_error>(r)) FAIL("accepted: " << body);
  return std::get<api_error>(r);
}

api_request completion(const std::string& fields) {
  return parse_ok(api_kind::completion, R"({"model":"m","prompt":"hi")" + fields + "}");
}

api_error completion_err(const std::string& fields) {
  return parse_err(api_kind::completion, R"({"model":"m","prompt":"hi")" + fields + "}");
}

/// Runs `tokens` through the byte codec's decoder and a stop matcher, as the front end does.
std::string generate_with_stop(const std::vector<int32_t>& tokens, std::vector<std::string> stops, bool* stopped) {
  duet::byte_text_codec codec;
  auto decoder = codec.decoder();
  duet::stop_matcher stop(std::move(stops));
  std::string out;
  *stopped = false;
  for (int32_t t : tokens) {
    auto o = stop.feed(decoder->push(t));
    out += o.text;
    if (o.stopped) {
      *stopped = true;
      return out;
    }
  }
  out += stop.feed(decoder->flush()).text;
  out += stop.flush();
  return out;
}

std::vector<int32_t> bytes(const std::string& s) { return duet::byte_text_codec{}.encode(s, true); }

}  // namespace

TEST_SUITE("http request parsing") {
  TEST_CASE("a completion request with a text prompt and sampling fields parses into its parts") {
    auto r = completion(R"(,"max_tokens":7,"temperature":0.5,"top_p":0.9,"top_k":40,"min_p":0.05,
        "presence_penalty":0.5,"frequency_penalty":-0.5,"seed":42,"ignore_eos":true,"user":"u1",
        "stop":"\n\n","stream":true,"stream_options":{"include_usage":true})");
    CHECK(r.prompt == "hi");
    CHECK_FALSE(r.prompt_is_tokens);
    CHECK(r.max_tokens == 7u);
    CHECK(r.sampling.temperature == doctest::Approx(0.5));
    CHECK(r.sampling.top_p == doctest::Approx(0.9));
    CHECK(r.sampling.top_k == 40);
    CHECK(r.sampling.min_p == doctest::Approx(0.05));
    CHECK(r.sampling.presence_penalty == doctest::Approx(0.5));
    CHECK(r.sampling.frequency_penalty == doctest::Approx(-0.5));
    CHECK(r.sampling.has_seed);
    CHECK(r.sampling.seed == 42u);
    CHECK(r.sampling.ignore_eos);
    CHECK(r.user == "u1");
    CHECK(r.stop == std::vector<std::string>{"\n\n"});
    CHECK(r.stream);
    CHECK(r.include_usage);
  }

  TEST_CASE("a prompt may be token ids, or a list holding one string or one list of ids") {
    auto a = parse_ok(api_kind::completion, R"({"prompt":[1,2,3]})");
    CHECK(a.prompt_is_tokens);
    CHECK(a.prompt_tokens == std::vector<int32_t>{1, 2, 3});
    auto b = parse_ok(api_kind::completion, R"({"prompt":["text"]})");
    CHECK(b.prompt == "text");
    auto c = parse_ok(api_kind::completion, R"({"prompt":[[4,5]]})");
    CHECK(c.prompt_tokens == std::vector<int32_t>{4, 5});
  }

  TEST_CASE("a missing model means the served one; another model is a 404 model_not_found") {
    CHECK(parse_ok(api_kind::completion, R"({"prompt":"x"})").model == "m");
    auto e = parse_err(api_kind::completion, R"({"model":"gpt-4","prompt":"x"})");
    CHECK(e.status == 404);
    CHECK(e.code == "model_not_found");
    CHECK(e.param == "model");
  }

  TEST_CASE("unknown fields are ignored and null means not given") {
    auto r = completion(R"(,"frobnicate":{"a":[1,2]},"temperature":null,"stop":null,"max_tokens":null)");
    CHECK(r.sampling.temperature == doctest::Approx(1.0));  // OpenAI's default
    CHECK(r.stop.empty());
    CHECK_FALSE(r.max_tokens.has_value());
  }

  TEST_CASE("bodies that are not a JSON object are 400s") {
    CHECK(parse_err(api_kind::completion, R"({"prompt":"x",)").status == 400);  // truncated
    CHECK(parse_err(api_kind::completion, "").status == 400);
    CHECK(parse_err(api_kind::completion, "[1,2]").status == 400);
    CHECK(parse_err(api_kind::completion, "\"text\"").status == 400);
    CHECK(parse_err(api_kind::completion, std::string(10000, '[') + std::string(10000, ']')).status == 400);
  }

  TEST_CASE("wrong types are 400s that name the parameter") {
    struct bad {
      const char* fields;
      const char* param;
    };
    for (const auto& b : {bad{R"(,"temperature":"hot")", "temperature"}, bad{R"(,"max_tokens":"10")", "max_tokens"},
                          bad{R"(,"max_tokens":1.5)", "max_tokens"}, bad{R"(,"stream":"yes")", "stream"},
                          bad{R"(,"stop":5)", "stop"}, bad{R"(,"stop":["a",1])", "stop"}, bad{R"(,"seed":"s")", "seed"},
                          bad{R"(,"top_k":0.5)", "top_k"}, bad{R"(,"user":7)", "user"},
                          bad{R"(,"ignore_eos":1)", "ignore_eos"}, bad{R"(,"logprobs":"x")", "logprobs"}}) {
      CAPTURE(b.fields);
      auto e = completion_err(b.fields);
      CHECK(e.status == 400);
      CHECK(e.type == "invalid_request_error");
      CHECK(e.param == b.param);
    }
    CHECK(parse_err(api_kind::completion, R"({"prompt":5})").param == "prompt");
    CHECK(parse_err(api_kind::completion, R"({"prompt":[1,"a"]})").param == "prompt");
    CHECK(parse_err(api_kind::completion, R"({"prompt":[-1]})").param == "prompt");
    CHECK(parse_err(api_kind::completion, R"({"model":5,"prompt":"x"})").param == "model");
  }

  TEST_CASE("values out of range are 400s") {
    for (const char* fields : {R"(,"max_tokens":-1)", R"(,"max_tokens":0)", R"(,"temperature":2.5)",
                               R"(,"temperature":-0.1)", R"(,"top_p":0)", R"(,"top_p":1.5)", R"(,"top_k":-2)",
                               R"(,"min_p":1.1)", R"(,"presence_penalty":3)", R"(,"frequency_penalty":-2.5)",
                               R"(,"logprobs":6)", R"(,"n":2)", R"(,"best_of":3)", R"(,"echo":true)",
                               R"(,"logit_bias":{"1":5})", R"(,"stream_options":{"include_usage":true})"}) {
      CAPTURE(fields);
      CHECK(completion_err(fields).status == 400);
    }
  }

  TEST_CASE("a negative max_tokens names max_tokens in the message and the param") {
    auto e = completion_err(R"(,"max_tokens":-5)");
    CHECK(e.param == "max_tokens");
    CHECK(e.message.find("at least 1") != std::string::npos);
  }

  TEST_CASE("max_new_tokens is accepted beside OpenAI's two names; names that disagree are a 400") {
    auto r = completion(R"(,"max_new_tokens":5,"temperature":0)");
    CHECK(r.max_tokens == 5u);
    CHECK(r.max_tokens_param == "max_new_tokens");
    auto same = completion(R"(,"max_tokens":6,"max_new_tokens":6)");
    CHECK(same.max_tokens == 6u);
    CHECK(same.max_tokens_param == "max_tokens");
    auto chat = parse_ok(api_kind::chat, R"({"messages":[{"role":"user","content":"hi"}],"max_new_tokens":7})");
    CHECK(chat.max_tokens == 7u);
    auto e = completion_err(R"(,"max_tokens":6,"max_new_tokens":9)");
    CHECK(e.status == 400);
    CHECK(e.param == "max_new_tokens");
    CHECK(e.message.find("disagree") != std::string::npos);
    auto c = parse_err(api_kind::chat, R"({"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":3,"max_tokens":4})");
    CHECK(c.param == "max_completion_tokens");
    auto neg = completion_err(R"(,"max_new_tokens":0)");
    CHECK(neg.param == "max_new_tokens");
  }

  TEST_CASE("a max_new_tokens over the context names max_new_tokens in the error") {
    auto r = completion(R"(,"max_new_tokens":950)");
    auto e = std::get<api_error>(duet::resolve_max_tokens(r, 100, 1000, 16, 5000));
    CHECK(e.code == "context_length_exceeded");
    CHECK(e.param == "max_new_tokens");
  }

  TEST_CASE("batched prompts are refused: one prompt per request") {
    auto e = parse_err(api_kind::completion, R"({"prompt":["a","b"]})");
    CHECK(e.status == 400);
    CHECK(e.message.find("batched") != std::string::npos);
  }

  TEST_CASE("chat messages flatten text parts and map developer to system") {
    auto r = parse_ok(api_kind::chat, R"({"model":"m","messages":[
        {"role":"developer","content":"be brief"},
        {"role":"user","content":[{"type":"text","text":"hello "},{"type":"text","text":"there"}]},
        {"role":"assistant","content":null},
        {"role":"user","content":"again","name":"bob"}],"max_completion_tokens":9,"logprobs":true,"top_logprobs":3})");
    REQUIRE(r.messages.size() == 4);
    CHECK(r.messages[0].role == "system");
    CHECK(r.messages[1].content == "hello there");
    CHECK(r.messages[2].content.empty());
    CHECK(r.max_tokens == 9u);
    CHECK(r.logprobs);
    CHECK(r.sampling.top_logprobs == 3u);
  }

  TEST_CASE("bad chat messages are 400s naming the message") {
    CHECK(parse_err(api_kind::chat, R"({"messages":[]})").param == "messages");
    CHECK(parse_err(api_kind::chat, R"({"messages":"hi"})").param == "messages");
    CHECK(parse_err(api_kind::chat, R"({})").param == "messages");
    CHECK(parse_err(api_kind::chat, R"({"messages":[{"role":"wizard","content":"x"}]})").param == "messages[0].role");
    CHECK(parse_err(api_kind::chat, R"({"messages":[{"content":"x"}]})").param == "messages[0].role");
    CHECK(parse_err(api_kind::chat, R"({"messages":[{"role":"user"}]})").param == "messages[0].content");
    CHECK(parse_err(api_kind::chat, R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})").param ==
          "messages[0].content[0].type");
    CHECK(parse_err(api_kind::chat, R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})").param ==
          "top_logprobs");
    CHECK(parse_err(api_kind::chat, R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})")
              .param == "tools");
  }

  TEST_CASE("stop takes a string or a list; empty strings are dropped; too many are refused") {
    CHECK(completion(R"(,"stop":["a","","bc"])").stop == std::vector<std::string>{"a", "bc"});
    std::string many = R"(,"stop":[)";
    for (int i = 0; i < 17; ++i) many += std::string(i ? "," : "") + "\"s" + std::to_string(i) + "\"";
    CHECK(completion_err(many + "]").param == "stop");
  }

  TEST_CASE("top_k -1 means off; a negative seed is kept as its two's complement") {
    auto r = completion(R"(,"top_k":-1,"seed":-1)");
    CHECK(r.sampling.top_k == 0);
    CHECK(r.sampling.has_seed);
    CHECK(r.sampling.seed == ~uint64_t{0});
  }

  TEST_CASE("reasoning_format selects split or raw; anything else is a 400") {
    CHECK(completion(R"(,"reasoning_format":"raw")").reasoning == duet::reasoning_format::raw);
    CHECK(completion(R"(,"reasoning_format":"deepseek")").reasoning == duet::reasoning_format::split);
    CHECK(completion_err(R"(,"reasoning_format":"xml")").param == "reasoning_format");
  }
}

TEST_SUITE("http max_tokens") {
  TEST_CASE("without max_tokens the default applies, capped by the room the context leaves") {
    api_request r;
    CHECK(std::get<uint32_t>(duet::resolve_max_tokens(r, 100, 1000, 16, 5000)) == 16u);
    CHECK(std::get<uint32_t>(duet::resolve_max_tokens(r, 100, 1000, 0, 5000)) == 900u);
    CHECK(std::get<uint32_t>(duet::resolve_max_tokens(r, 100, 1000, 0, 50)) == 50u);
    CHECK(std::get<uint32_t>(duet::resolve_max_tokens(r, 995, 1000, 16, 5000)) == 5u);
  }

  TEST_CASE("a max_tokens that does not fit beside the prompt is a 400 context_length_exceeded") {
    api_request r;
    r.max_tokens = 950;
    auto e = std::get<api_error>(duet::resolve_max_tokens(r, 100, 1000, 16, 5000));
    CHECK(e.status == 400);
    CHECK(e.code == "context_length_exceeded");
    r.max_tokens = 900;
    CHECK(std::get<uint32_t>(duet::resolve_max_tokens(r, 100, 1000, 16, 5000)) == 900u);
  }

  TEST_CASE("a prompt that alone fills the context is left for the router to refuse") {
    api_request r;
    CHECK(std::get<uint32_t>(duet::resolve_max_tokens(r, 1000, 1000, 16, 5000)) == 1u);
    r.max_tokens = 10;
    CHECK(std::get<uint32_t>(duet::resolve_max_tokens(r, 2000, 1000, 16, 5000)) == 10u);
  }
}

TEST_SUITE("http errors") {
  TEST_CASE("errors have OpenAI's shape with null param and code when absent") {
    auto j = json::parse(duet::bad_request("nope").body());
    CHECK(j["error"]["message"] == "nope");
    CHECK(j["error"]["type"] == "invalid_request_error");
    CHECK(j["error"]["param"].is_null());
    CHECK(j["error"]["code"].is_null());
    auto k = json::parse(duet::bad_request("bad", "temperature").body());
    CHECK(k["error"]["param"] == "temperature");
  }

  TEST_CASE("cluster rejections map to HTTP statuses, with Retry-After where retrying helps") {
    using duet::msg::error_code;
    auto overloaded = duet::error_from_cluster(error_code::overloaded, "busy", 1500);
    CHECK(overloaded.status == 429);
    CHECK(overloaded.retry_after_s == 2u);
    CHECK(overloaded.code == "rate_limit_exceeded");
    auto unavailable = duet::error_from_cluster(error_code::unavailable, "down", 0);
    CHECK(unavailable.status == 503);
    CHECK(unavailable.retry_after_s == 1u);
    auto too_long = duet::error_from_cluster(error_code::prompt_too_long, "long");
    CHECK(too_long.status == 400);
    CHECK(too_long.code == "context_length_exceeded");
    CHECK(duet::error_from_cluster(error_code::bad_request, "x").status == 400);
    CHECK(duet::error_from_cluster(error_code::timeout, "x").status == 504);
    CHECK(duet::error_from_cluster(error_code::internal, "x").status == 500);
    CHECK(duet::error_from_cluster(error_code::internal, "x").retry_after_s == 0u);
  }
}

TEST_SUITE("http responses and framing") {
  const duet::api_response_head completion_head{api_kind::completion, "cmpl-1", 1700000000, "m"};
  const duet::api_response_head chat_head{api_kind::chat, "chatcmpl-1", 1700000000, "m"};

  TEST_CASE("a whole completion response has OpenAI's fields") {
    auto j = duet::full_response(completion_head, "text", std::nullopt, "length", {3, 4});
    CHECK(j["object"] == "text_completion");
    CHECK(j["id"] == "cmpl-1");
    CHECK(j["choices"][0]["text"] == "text");
    CHECK(j["choices"][0]["finish_reason"] == "length");
    CHECK(j["choices"][0]["logprobs"].is_null());
    CHECK(j["usage"]["total_tokens"] == 7);
  }

  TEST_CASE("a whole chat response carries reasoning_content only when there was reasoning") {
    auto with = duet::full_response(chat_head, "answer", std::string("thought"), "stop", {1, 2});
    CHECK(with["object"] == "chat.completion");
    CHECK(with["choices"][0]["message"]["role"] == "assistant");
    CHECK(with["choices"][0]["message"]["content"] == "answer");
    CHECK(with["choices"][0]["message"]["reasoning_content"] == "thought");
    auto without = duet::full_response(chat_head, "answer", std::nullopt, "stop", {1, 2});
    CHECK_FALSE(without["choices"][0]["message"].contains("reasoning_content"));
  }

  TEST_CASE("stream chunks: deltas, a null finish_reason until the end, usage null with include_usage") {
    duet::chunk_delta first;
    first.role = true;
    first.content = "";
    auto a = duet::stream_chunk(chat_head, first, "", true);
    CHECK(a["object"] == "chat.completion.chunk");
    CHECK(a["choices"][0]["delta"]["role"] == "assistant");
    CHECK(a["choices"][0]["finish_reason"].is_null());
    CHECK(a.contains("usage"));
    CHECK(a["usage"].is_null());
    duet::chunk_delta thinking;
    thinking.reasoning = "hmm";
    auto b = duet::stream_chunk(chat_head, thinking, "", false);
    CHECK(b["choices"][0]["delta"]["reasoning_content"] == "hmm");
    CHECK_FALSE(b["choices"][0]["delta"].contains("content"));
    CHECK_FALSE(b.contains("usage"));
    auto c = duet::stream_chunk(completion_head, duet::chunk_delta{}, "stop", false);
    CHECK(c["choices"][0]["text"] == "");
    CHECK(c["choices"][0]["finish_reason"] == "stop");
    auto u = duet::usage_chunk(chat_head, {5, 6});
    CHECK(u["choices"].empty());
    CHECK(u["usage"]["completion_tokens"] == 6);
  }

  TEST_CASE("logprobs requests ask the workers for them through sampling_params") {
    auto chat = parse_ok(api_kind::chat, R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":2})");
    CHECK(chat.sampling.logprobs);
    CHECK(chat.sampling.top_logprobs == 2u);
    CHECK(chat.sampling.wants_logprobs());
    auto plain = parse_ok(api_kind::chat, R"({"messages":[{"role":"user","content":"x"}]})");
    CHECK_FALSE(plain.sampling.wants_logprobs());
    auto zero = completion(R"(,"logprobs":0)");
    CHECK(zero.sampling.logprobs);
    CHECK(zero.sampling.top_logprobs == 0u);
    auto three = completion(R"(,"logprobs":3)");
    CHECK(three.sampling.wants_logprobs());
    CHECK(three.sampling.top_logprobs == 3u);
  }

  TEST_CASE("chat logprobs have OpenAI's shape: token, logprob, bytes and top_logprobs per token") {
    duet::logprobs_writer w(api_kind::chat, std::make_shared<duet::byte_text_codec>());
    CHECK(w.empty());
    CHECK(w.take().is_null());
    w.add('H', {.logprob = -0.25f, .top_ids = {'H', 'h'}, .top_logprobs = {-0.25f, -1.75f}});
    w.add(0xC3, {.logprob = -3.0f, .top_ids = {}, .top_logprobs = {}});  // half of a character: shown as U+FFFD, bytes kept
    w.add(300, {.logprob = -0.5f, .top_ids = {300}, .top_logprobs = {-0.5f}});
    const auto j = w.take();
    REQUIRE(j["content"].size() == 3);
    const auto& h = j["content"][0];
    CHECK(h["token"] == "H");
    CHECK(h["logprob"].get<float>() == -0.25f);
    CHECK(h["bytes"] == nlohmann::json::array({72}));
    REQUIRE(h["top_logprobs"].size() == 2);
    CHECK(h["top_logprobs"][1]["token"] == "h");
    CHECK(h["top_logprobs"][1]["logprob"].get<float>() == -1.75f);
    CHECK(h["top_logprobs"][1]["bytes"] == nlohmann::json::array({104}));
    CHECK(j["content"][1]["token"] == "\xEF\xBF\xBD");
    CHECK(j["content"][1]["bytes"] == nlohmann::json::array({0xC3}));
    CHECK(j["content"][1]["top_logprobs"].empty());
    CHECK(j["content"][2]["token"] == " <300>");
    CHECK(w.empty());
    CHECK(w.take().is_null());

    auto full = duet::full_response(chat_head, "H", std::nullopt, "length", {1, 3}, j);
    CHECK(full["choices"][0]["logprobs"] == j);
    duet::chunk_delta d;
    d.content = "H";
    d.logprobs = j;
    CHECK(duet::stream_chunk(chat_head, d, "", false)["choices"][0]["logprobs"] == j);
    CHECK(duet::stream_chunk(chat_head, duet::chunk_delta{}, "", false)["choices"][0]["logprobs"].is_null());
  }

  TEST_CASE("completion logprobs are parallel arrays; text offsets keep counting across stream chunks") {
    duet::logprobs_writer w(api_kind::completion, std::make_shared<duet::byte_text_codec>());
    w.add('a', {.logprob = -1.0f, .top_ids = {'a', 'b'}, .top_logprobs = {-1.0f, -2.0f}});
    w.add(300, {.logprob = -0.5f, .top_ids = {300, 'a'}, .top_logprobs = {-0.5f, -4.0f}});
    const auto first = w.take();
    CHECK(first["tokens"] == nlohmann::json::array({"a", " <300>"}));
    CHECK(first["token_logprobs"][0].get<float>() == -1.0f);
    CHECK(first["token_logprobs"][1].get<float>() == -0.5f);
    CHECK(first["top_logprobs"][0]["b"].get<float>() == -2.0f);
    CHECK(first["top_logprobs"][1]["a"].get<float>() == -4.0f);
    CHECK(first["text_offset"] == nlohmann::json::array({0, 1}));
    w.add(0xC3, {.logprob = -2.5f, .top_ids = {}, .top_logprobs = {}});
    const auto second = w.take();
    CHECK(second["tokens"] == nlohmann::json::array({"\xEF\xBF\xBD"}));
    CHECK(second["text_offset"] == nlohmann::json::array({7}));  // "a" + " <300>"
    CHECK(second["top_logprobs"][0].empty());
  }

  TEST_CASE("pre-rendered content events are byte for byte the generic chunks") {
    for (const auto& head : {completion_head, chat_head}) {
      for (bool usage_null : {false, true}) {
        const duet::content_event_writer writer(head, usage_null);
        for (const std::string& text : {std::string(" <123>"), std::string("quote \" back\\slash"),
                                       std::string("tab\tnl\ncr\r\x01\x1f\x7f"), std::string("caf\xC3\xA9 \xE2\x82\xAC"),
                                       std::string("bad \xff\xC3 bytes"), std::string()}) {
          CAPTURE(text);
          duet::chunk_delta d;
          d.content = text;
          CHECK(writer.content_event(text) == duet::sse_event(duet::stream_chunk(head, d, "", usage_null)));
        }
      }
    }
  }

  TEST_CASE("an SSE event is one data line and a blank line; newlines in text stay escaped") {
    CHECK(duet::sse_event(json{{"a", "x\ny"}}) == "data: {\"a\":\"x\\ny\"}\n\n");
    CHECK(duet::sse_done() == "data: [DONE]\n\n");
  }

  TEST_CASE("HTTP chunks carry their size in hex; the last chunk is zero") {
    CHECK(duet::http_chunk("hello") == "5\r\nhello\r\n");
    CHECK(duet::http_chunk(std::string(26, 'a')) == "1a\r\n" + std::string(26, 'a') + "\r\n");
    CHECK(duet::http_chunk("").empty());
    CHECK(duet::http_last_chunk() == "0\r\n\r\n");
  }

  TEST_CASE("JSON with invalid UTF-8 is written with replacement characters, never an exception") {
    CHECK(duet::dump_json(json{{"t", std::string("a\xff" "b")}}) == "{\"t\":\"a\xEF\xBF\xBD" "b\"}");
  }

  TEST_CASE("response ids have the kind's prefix") {
    CHECK(duet::make_response_id(api_kind::completion).starts_with("cmpl-"));
    CHECK(duet::make_response_id(api_kind::chat).starts_with("chatcmpl-"));
    CHECK(duet::make_response_id(api_kind::chat) != duet::make_response_id(api_kind::chat));
  }

  TEST_CASE("/v1/models lists the served model") {
    auto j = duet::models_response("m", 5);
    CHECK(j["object"] == "list");
    CHECK(j["data"][0]["id"] == "m");
    CHECK(j["data"][0]["object"] == "model");
  }
}

TEST_SUITE("http stop strings") {
  TEST_CASE("a stop string split across tokens ends the output just before it") {
    bool stopped = false;
    CHECK(generate_with_stop(bytes("hello world"), {"o w"}, &stopped) == "hell");
    CHECK(stopped);
  }

  TEST_CASE("text that only starts like a stop string is released once it cannot match") {
    duet::stop_matcher stop({"abc"});
    auto a = stop.feed("xab");
    CHECK(a.text == "x");
    CHECK(stop.held() == 2);
    auto b = stop.feed("d");
    CHECK(b.text == "abd");
    CHECK_FALSE(b.stopped);
  }

  TEST_CASE("the earliest of several stop strings wins") {
    duet::stop_matcher stop({"world", "lo"});
    auto o = stop.feed("hello world");
    CHECK(o.text == "hel");
    CHECK(o.stopped);
    CHECK(stop.feed("more").text.empty());
    CHECK(stop.flush().empty());
  }

  TEST_CASE("a stop string at the very start leaves an empty output") {
    bool stopped = false;
    CHECK(generate_with_stop(bytes("STOP here"), {"STOP"}, &stopped).empty());
    CHECK(stopped);
  }

  TEST_CASE("held text comes out at the end when no stop string matched") {
    bool stopped = false;
    CHECK(generate_with_stop(bytes("the end"), {"end!"}, &stopped) == "the end");
    CHECK_FALSE(stopped);
  }

  TEST_CASE("without stop strings text passes straight through") {
    duet::stop_matcher stop({});
    CHECK(stop.feed("abc").text == "abc");
    CHECK(stop.held() == 0);
  }

  TEST_CASE("stop strings match on sim placeholders across token boundaries") {
    bool stopped = false;
    CHECK(generate_with_stop({'a', 300, 301, 'b'}, {"0> <3"}, &stopped) == "a <30");
    CHECK(stopped);
  }

  TEST_CASE("a multi-byte stop string split inside a character still matches") {
    bool stopped = false;
    CHECK(generate_with_stop(bytes("café crème"), {"é c"}, &stopped) == "caf");
    CHECK(stopped);
  }
}

TEST_SUITE("http byte codec") {
  TEST_CASE("encode is one token per UTF-8 byte") {
    CHECK(bytes("aé") == std::vector<int32_t>{'a', 0xC3, 0xA9});
  }

  TEST_CASE("decode emits a character once its last byte arrives") {
    auto d = duet::byte_text_codec{}.decoder();
    CHECK(d->push('a') == "a");
    CHECK(d->push(0xC3).empty());
    CHECK(d->push(0xA9) == "é");
    CHECK(d->flush().empty());
  }

  TEST_CASE("ids of 256 and above decode as placeholders") {
    auto d = duet::byte_text_codec{}.decoder();
    CHECK(d->push(300) == " <300>");
    CHECK(d->push(128000) == " <128000>");
  }

  TEST_CASE("bytes that cannot form a character become U+FFFD") {
    auto d = duet::byte_text_codec{}.decoder();
    CHECK(d->push(0xFF) == "\xEF\xBF\xBD");
    CHECK(d->push(0xC3).empty());
    CHECK(d->push(300) == "\xEF\xBF\xBD <300>");
    CHECK(d->push(0xE2).empty());
    CHECK(d->flush() == "\xEF\xBF\xBD");
    CHECK(d->push(0xC3).empty());
    CHECK(d->push('x') == "\xEF\xBF\xBDx");
  }
}

TEST_SUITE("http think splitter") {
  TEST_CASE("text inside <think> is reasoning and the rest is content") {
    duet::think_splitter s;
    auto o = s.feed("<think>let me see</think>The answer is 4.");
    auto f = s.flush();
    CHECK(o.reasoning + f.reasoning == "let me see");
    CHECK(o.content + f.content == "The answer is 4.");
    CHECK(s.saw_reasoning());
  }

  TEST_CASE("tags split across every chunk boundary are still recognised") {
    const std::string text = "\n<think>a<b</think>c</think>d";
    duet::think_splitter s;
    std::string reasoning, content;
    for (char ch : text) {
      auto o = s.feed(std::string(1, ch));
      reasoning += o.reasoning;
      content += o.content;
    }
    auto f = s.flush();
    CHECK(reasoning + f.reasoning == "a<b");
    CHECK(content + f.content == "c</think>d");
  }

  TEST_CASE("output without a think block is all content, even if it mentions <think> later") {
    duet::think_splitter s;
    auto o = s.feed("Use the <think> tag.");
    auto f = s.flush();
    CHECK(o.content + f.content == "Use the <think> tag.");
    CHECK(o.reasoning.empty());
    CHECK_FALSE(s.saw_reasoning());
  }

  TEST_CASE("output that starts in reasoning (the template opened <think>) splits at </think>") {
    duet::think_splitter s(/*start_in_reasoning=*/true);
    auto o = s.feed("hmm</thi");
    CHECK(o.reasoning == "hmm");
    auto p = s.feed("nk>ok");
    CHECK(p.content == "ok");
  }

  TEST_CASE("an unclosed think block ends as reasoning, a partial tag included") {
    duet::think_splitter s;
    auto o = s.feed("<think>still thinking</th");
    auto f = s.flush();
    CHECK(o.reasoning + f.reasoning == "still thinking</th");
    CHECK(o.content + f.content == "");
  }

  TEST_CASE("a partial opening tag that turns out to be text is content") {
    duet::think_splitter s;
    CHECK(s.feed("<thi").content.empty());
    CHECK(s.feed("s is text").content == "<this is text");
  }

  TEST_CASE("a prompt that ends in <think> opens the block") {
    CHECK(duet::think_splitter::prompt_opens_think("<|Assistant|><think>\n"));
    CHECK_FALSE(duet::think_splitter::prompt_opens_think("<|Assistant|>"));
    CHECK_FALSE(duet::think_splitter::prompt_opens_think(""));
  }
}

TEST_SUITE("http chat template and settings") {
  TEST_CASE("the plain template writes each message under its role and opens the assistant's turn") {
    duet::plain_chat_template t;
    std::vector<duet::chat_message> m{{"system", "be brief"}, {"user", "hi"}};
    CHECK(t.render(m, true) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n");
    CHECK(t.render(m, false) == "<|system|>\nbe brief\n<|user|>\nhi\n");
  }

  TEST_CASE("a Jinja chat template renders the messages with bos and the generation prompt") {
    duet::jinja_chat_renderer t(
        "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}",
        "<s>", "</s>");
    std::vector<duet::chat_message> m{{"system", "be brief"}, {"user", "hi"}};
    const std::string prompt = t.render(m, true);
    CHECK(prompt == "<s><system>be brief<user>hi<|Assistant|><think>\n");
    CHECK_FALSE(t.add_special_tokens());
    CHECK(duet::think_splitter::prompt_opens_think(prompt));
  }

  TEST_CASE("a template that raises an exception is a 400-worthy invalid_argument") {
    duet::jinja_chat_renderer t("{{ raise_exception('roles must alternate') }}", "", "");
    std::vector<duet::chat_message> m{{"user", "hi"}};
    CHECK_THROWS_AS((void)t.render(m, true), std::invalid_argument);
  }

  TEST_CASE("the byte codec gets the plain template") {
    CHECK(dynamic_cast<const duet::plain_chat_template*>(duet::make_chat_renderer(duet::byte_text_codec{}).get()));
  }

  TEST_CASE("host:port parses, with IPv6 brackets and localhost") {
    CHECK(duet::parse_host_port("127.0.0.1:8080") == std::pair<std::string, uint16_t>{"127.0.0.1", 8080});
    CHECK(duet::parse_host_port("[::1]:0") == std::pair<std::string, uint16_t>{"::1", 0});
    CHECK(duet::parse_host_port("localhost:1") == std::pair<std::string, uint16_t>{"127.0.0.1", 1});
    CHECK_THROWS_AS((void)duet::parse_host_port("8080"), std::invalid_argument);
    CHECK_THROWS_AS((void)duet::parse_host_port("h:70000"), std::invalid_argument);
    CHECK_THROWS_AS((void)duet::parse_host_port(":80"), std::invalid_argument);
  }

  TEST_CASE("settings from a deployment find the router and the pool actors") {
    const auto config = duet::default_config();
    const auto s = duet::http_settings_from_config(config, "127.0.0.1:0");
    CHECK(s.router_endpoint == config.nodes[0].endpoint);
    CHECK(s.router_address.ends_with("/router"));
    CHECK(s.pool_actors.size() == 3);  // broker, prefill, decode
    CHECK(s.model_name == config.model.name);
    CHECK(s.max_context == config.model.max_context);
    CHECK(duet::http_host_node(config) == config.nodes[0].name);
  }

  TEST_CASE("the sim engine gets the byte codec") {
    CHECK(duet::make_text_codec(duet::default_config())->name() == "bytes");
  }
}

// ------------------------------------------------------------------ mutated bodies

namespace {

/// A value of some JSON type, often one a field does not take: what a careless or hostile
/// client sends.
json odd_value(std::mt19937& rng) {
  switch (rng() % 14) {
    case 0: return nullptr;
    case 1: return true;
    case 2: return -1;
    case 3: return 0;
    case 4: return 1e300;
    case 5: return -4294967296.0;
    case 6: return 18446744073709551615ull;
    case 7: return 0.5;
    case 8: return "";
    case 9: return std::string(300, 'x');
    case 10: return json::array({1, "a", nullptr});
    case 11: return json::object({{"type", "text"}, {"text", 7}});
    case 12: return json::array();
    default: return json::array({json::object({{"role", "user"}, {"content", json::array({42})}})});
  }
}

/// One field of `body` (nested ones included) replaced, removed, or a new one added.
void mutate(json& body, std::mt19937& rng) {
  static const char* names[] = {"model", "prompt", "messages", "max_tokens", "max_new_tokens",
                                "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
                                "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
                                "stop", "stop_token_ids", "stream", "stream_options", "logprobs",
                                "top_logprobs", "n", "best_of", "echo", "suffix", "logit_bias",
                                "tools", "response_format", "reasoning_format", "user", "ignore_eos"};
  json* target = &body;
  if (body.contains("messages") && body["messages"].is_array() && !body["messages"].empty() && rng() % 3 == 0) {
    json& m = body["messages"][rng() % body["messages"].size()];
    if (m.is_object()) target = &m;
  }
  const std::string key = target == &body ? names[rng() % std::size(names)] : (rng() % 2 ? "role" : "content");
  if (rng() % 5 == 0) target->erase(key);
  else (*target)[key] = odd_value(rng);
}

}  // namespace

TEST_SUITE("http mutated bodies") {
  TEST_CASE("20,000 mutated bodies: never a throw, every refusal says why, every acceptance is in range") {
    const json seeds[] = {
        json::parse(R"({"model":"m","prompt":"hi","max_tokens":5,"temperature":0.7,"top_p":0.9,"stop":["\n"],"logprobs":2})"),
        json::parse(R"({"model":"m","prompt":[1,2,3],"max_new_tokens":3,"seed":4,"stream":true,"stream_options":{"include_usage":true}})"),
        json::parse(R"({"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":9,"logprobs":true,"top_logprobs":3})")};
    std::mt19937 rng(2026);
    int accepted = 0, refused = 0;
    for (int i = 0; i < 20000; ++i) {
      const auto kind = rng() % 2 ? api_kind::chat : api_kind::completion;
      json body = seeds[rng() % std::size(seeds)];
      for (int m = 1 + rng() % 3; m > 0; --m) mutate(body, rng);
      std::string text = body.dump();
      if (rng() % 8 == 0) text.resize(rng() % (text.size() + 1));         // cut short
      if (rng() % 8 == 0 && !text.empty()) text[rng() % text.size()] ^= 0x20;  // one byte off
      std::variant<api_request, api_error> r;
      REQUIRE_NOTHROW(r = duet::parse_api_request(kind, text, options()));
      if (const auto* e = std::get_if<api_error>(&r)) {
        ++refused;
        if (e->message.empty() || (e->status != 400 && e->status != 404)) FAIL("bad refusal of " << text);
        continue;
      }
      ++accepted;
      const auto& q = std::get<api_request>(r);
      const auto& s = q.sampling;
      const bool in_range = s.temperature >= 0 && s.temperature <= 2 && s.top_p > 0 && s.top_p <= 1 &&
                            s.top_k >= 0 && s.min_p >= 0 && s.min_p <= 1 && s.repetition_penalty > 0 &&
                            (!q.max_tokens || *q.max_tokens >= 1) && s.top_logprobs <= 20 &&
                            (kind == api_kind::completion || !q.messages.empty());
      if (!in_range) FAIL("accepted out of range: " << text);
      const auto max_new = duet::resolve_max_tokens(q, rng() % 3000, 2048, 16, 1000);
      if (const auto* n = std::get_if<uint32_t>(&max_new); n && (*n < 1 || *n > std::max<uint32_t>(q.max_tokens.value_or(0), 1000))) {
        FAIL("resolved " << *n << " tokens for " << text);
      }
    }
    MESSAGE(accepted << " accepted, " << refused << " refused");
    // Both outcomes are exercised, not only one of them.
    CHECK(accepted > 1000);
    CHECK(refused > 1000);
  }
}
