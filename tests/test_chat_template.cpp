// The Jinja chat-template renderer against HF transformers: every fixture of
// tests/data/chat-templates/ (real model templates through apply_chat_template, and one short
// template per language feature through transformers' Jinja environment) must render
// byte-identical; plus errors, the API and behaviour of its own.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "runtime/chat_template.hpp"

namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

const fs::path data_dir = fs::path(DUET_TEST_DATA) / "chat-templates";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

ojson read_json(const fs::path& path) {
  return ojson::parse(read_file(path));
}

// Where two renderings first differ, for a readable failure.
std::string first_difference(const std::string& got, const std::string& want) {
  const auto mismatch = std::mismatch(got.begin(), got.end(), want.begin(), want.end());
  const auto at = static_cast<std::size_t>(mismatch.first - got.begin());
  const std::size_t from = at > 40 ? at - 40 : 0;
  return "first difference at byte " + std::to_string(at) + "\n  got:  ..." +
         ojson(got.substr(from, 80)).dump() + "\n  want: ..." + ojson(want.substr(from, 80)).dump();
}

std::string render(std::string_view source, const ojson& context = ojson::object()) {
  return duet::chat_template(std::string(source)).render(context);
}

// The context transformers' render_jinja_template hands the template.
ojson fixture_context(const ojson& f) {
  ojson context = ojson::object();
  context["messages"] = f.at("messages");
  context["tools"] = f.at("tools");
  context["documents"] = nullptr;
  context["add_generation_prompt"] = f.at("add_generation_prompt");
  for (const auto& [k, v] : f.at("special_tokens").items()) context[k] = v;
  for (const auto& [k, v] : f.at("kwargs").items()) context[k] = v;
  return context;
}

const duet::chat_template& model_template(const std::string& name) {
  static std::map<std::string, duet::chat_template> cache;
  auto it = cache.find(name);
  if (it == cache.end())
    it = cache.emplace(name, duet::chat_template(read_file(data_dir / (name + ".jinja")))).first;
  return it->second;
}

template <typename F>
duet::chat_template_syntax_error syntax_error_of(F&& f) {
  try {
    f();
  } catch (const duet::chat_template_syntax_error& e) {
    return e;
  }
  FAIL("no syntax error");
  return duet::chat_template_syntax_error("", 0, 0);
}

template <typename F>
duet::chat_template_render_error render_error_of(F&& f) {
  try {
    f();
  } catch (const duet::chat_template_render_error& e) {
    return e;
  }
  FAIL("no render error");
  return duet::chat_template_render_error("", 0);
}

}  // namespace

TEST_CASE("every model-template fixture renders byte-identical to HF apply_chat_template") {
  const ojson doc = read_json(data_dir / "fixtures.json");
  const ojson& fixtures = doc.at("fixtures");
  REQUIRE(fixtures.size() >= 60);
  std::map<std::string, int> per_template;
  for (const auto& f : fixtures) {
    const std::string name = f.at("name");
    INFO("fixture " << name);
    const duet::chat_template& tpl = model_template(f.at("template"));
    const ojson context = fixture_context(f);
    if (f.contains("error")) {
      try {
        (void)tpl.render(context);
        FAIL_CHECK("expected raise_exception(" << f.at("error").dump() << ")");
      } catch (const duet::chat_template_exception& e) {
        CHECK(std::string(e.what()) == f.at("error").get<std::string>());
      }
    } else {
      const std::string want = f.at("expected");
      const std::string got = tpl.render(context);
      CHECK_MESSAGE(got == want, first_difference(got, want));
    }
    ++per_template[f.at("template")];
  }
  for (const char* name : {"llama3_1", "llama3_1_tools", "qwen3", "deepseek_r1_distill", "smollm2"})
    CHECK_MESSAGE(per_template[name] >= 10, name);
}

TEST_CASE("every language-feature case renders byte-identical to transformers' Jinja") {
  const ojson doc = read_json(data_dir / "language.json");
  const ojson& cases = doc.at("cases");
  REQUIRE(cases.size() >= 40);
  for (const auto& c : cases) {
    INFO(c.at("name").get<std::string>() << "\n  template: " << c.at("template").dump());
    const std::string want = c.at("expected");
    std::string got;
    CHECK_NOTHROW(got = render(c.at("template").get<std::string>(), c.at("context")));
    CHECK_MESSAGE(got == want, first_difference(got, want));
  }
}

TEST_CASE("render_chat passes messages, the generation flag and bos/eos as apply_chat_template") {
  const ojson doc = read_json(data_dir / "fixtures.json");
  int checked = 0;
  for (const auto& f : doc.at("fixtures")) {
    if (f.at("template") != "llama3_1" && f.at("template") != "smollm2") continue;
    if (!f.at("kwargs").empty() || f.contains("error")) continue;
    const ojson& tokens = f.at("special_tokens");
    INFO("fixture " << f.at("name").get<std::string>());
    CHECK(model_template(f.at("template"))
              .render_chat(f.at("messages"), f.at("add_generation_prompt"),
                           tokens.value("bos_token", ""),
                           tokens.value("eos_token", "")) == f.at("expected").get<std::string>());
    ++checked;
  }
  CHECK(checked >= 20);
}

TEST_CASE("R1-Distill drops the reasoning of earlier assistant turns") {
  const ojson messages = ojson::parse(R"([
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nsecret plan\n</think>\n\nHello!"},
    {"role": "user", "content": "Bye"}])");
  const std::string out =
      model_template("deepseek_r1_distill")
          .render_chat(messages, true, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>");
  CHECK(out.find("secret plan") == std::string::npos);
  CHECK(out ==
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>\n\nHello!<｜end▁of▁sentence｜>"
        "<｜User｜>Bye<｜Assistant｜><think>\n");
}

TEST_CASE("raise_exception throws chat_template_exception with the message unchanged") {
  try {
    (void)render("a{{ raise_exception('Conversation roles must alternate: ' ~ n) }}b", {{"n", 3}});
    FAIL("no exception");
  } catch (const duet::chat_template_exception& e) {
    CHECK(std::string(e.what()) == "Conversation roles must alternate: 3");
  }
}

TEST_CASE("syntax errors name the line and column of the offending token") {
  {
    const auto e = syntax_error_of([] { (void)render("ok\n{% for x in xs %}\n{{ x }}\n"); });
    CHECK(e.line() == 3);
    CHECK(std::string(e.what()).find("looking for the following tags: 'endfor' or 'else'") !=
          std::string::npos);
  }
  {
    const auto e = syntax_error_of([] { (void)render("{% if a %}\n  {% endfor %}{% endif %}"); });
    CHECK(e.line() == 2);
    CHECK(e.column() == 6);
    CHECK(std::string(e.what()) ==
          "line 2, column 6: Encountered unknown tag 'endfor'. Jinja was looking for the "
          "following tags: 'elif' or 'else' or 'endif'. The innermost block that needs to be "
          "closed is 'if'.");
  }
  {
    const auto e = syntax_error_of([] { (void)render("{{ 1 + }}"); });
    CHECK(e.line() == 1);
    CHECK(e.column() == 8);
  }
  {
    const auto e = syntax_error_of([] { (void)render("x\n  {{ 'never closed }}"); });
    CHECK(e.line() == 2);
    CHECK(e.column() == 6);
  }
  {
    const auto e = syntax_error_of([] { (void)render("{{ a $ b }}"); });
    CHECK(e.column() == 6);
    CHECK(std::string(e.what()).find("unexpected char '$'") != std::string::npos);
  }
  {
    const auto e = syntax_error_of([] { (void)render("é {# no end"); });
    CHECK(e.column() == 3);  // columns count characters, not bytes
    CHECK(std::string(e.what()).find("Missing end of comment tag") != std::string::npos);
  }
  CHECK_THROWS_AS((void)render("{{ [1, 2 }}"), duet::chat_template_syntax_error);
  CHECK_THROWS_AS((void)render("{{ x }"), duet::chat_template_syntax_error);
  CHECK_THROWS_AS((void)render("{% break %}"), duet::chat_template_syntax_error);
  CHECK_THROWS_AS((void)render("{% include 'x' %}"), duet::chat_template_syntax_error);
  CHECK_THROWS_AS((void)render("{% set = 1 %}"), duet::chat_template_syntax_error);
  CHECK_THROWS_AS((void)render("{{ }}"), duet::chat_template_syntax_error);
  CHECK_THROWS_AS((void)render("{% endif %}"), duet::chat_template_syntax_error);
}

TEST_CASE("undefined values print empty but fail when used as objects, naming the variable") {
  CHECK(render("[{{ missing }}][{{ missing | length }}][{{ missing is defined }}]") ==
        "[][0][False]");
  const auto e = render_error_of([] { (void)render("line one\n{{ missing.attr }}"); });
  CHECK(e.line() == 2);
  CHECK(std::string(e.what()) == "line 2: 'missing' is undefined");
  CHECK_THROWS_AS((void)render("{{ missing + 1 }}"), duet::chat_template_render_error);
  CHECK_THROWS_AS((void)render("{{ m.content.strip() }}", {{"m", ojson::object()}}),
                  duet::chat_template_render_error);
}

TEST_CASE("type errors follow Python and report the line") {
  const auto e = render_error_of([] { (void)render("\n\n{{ 'a' + 1 }}"); });
  CHECK(e.line() == 3);
  CHECK(std::string(e.what()) == "line 3: can only concatenate str (not \"int\") to str");
  CHECK_THROWS_AS((void)render("{{ 1 / 0 }}"), duet::chat_template_render_error);
  CHECK_THROWS_AS((void)render("{{ 1 < 'a' }}"), duet::chat_template_render_error);
  CHECK_THROWS_AS((void)render("{{ x | nosuchfilter }}"), duet::chat_template_render_error);
  CHECK_THROWS_AS((void)render("{{ x is nosuchtest }}"), duet::chat_template_render_error);
  CHECK_THROWS_AS((void)render("{% set x = 1 %}{% set x.a = 2 %}"),
                  duet::chat_template_render_error);
  CHECK_THROWS_AS((void)render("{% set ns = namespace() %}{% set ns._hidden = 1 %}"),
                  duet::chat_template_render_error);
  CHECK_THROWS_AS((void)render("{{ [1].append(2) }}"), duet::chat_template_render_error);
  CHECK_THROWS_AS((void)render("{{ range(1000000) | length }}"), duet::chat_template_render_error);
  CHECK_THROWS_AS((void)render("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"),
                  duet::chat_template_render_error);
}

TEST_CASE("an ordered_json context keeps key order; a json context is sorted") {
  const duet::chat_template tpl("{{ tool | tojson }}");
  const ojson ordered = ojson::parse(R"({"tool": {"name": "f", "description": "d"}})");
  CHECK(tpl.render(ordered) == R"({"name": "f", "description": "d"})");
  const nlohmann::json sorted =
      nlohmann::json::parse(R"({"tool": {"name": "f", "description": "d"}})");
  CHECK(tpl.render(sorted) == R"({"description": "d", "name": "f"})");
}

TEST_CASE("a non-object context is a render error") {
  CHECK_THROWS_AS((void)duet::chat_template("x").render(ojson::array()),
                  duet::chat_template_render_error);
}

TEST_CASE("strings are UTF-8 throughout; undecodable bytes pass through unchanged") {
  const std::string bad = std::string("a\xff") + "b";
  CHECK(render("{{ s }}|{{ s | length }}|{{ s[::-1] }}", {{"s", "héllo"}}) == "héllo|5|olléh");
  CHECK(render("{{ s ~ '' }}", ojson{{"s", bad}}) == bad);
}

TEST_CASE("one parsed template renders from several threads at once") {
  const duet::chat_template& tpl = model_template("qwen3");
  const ojson messages = ojson::parse(R"([{"role": "user", "content": "Hello"}])");
  const std::string want = tpl.render_chat(messages, true, "", "<|im_end|>");
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i)
        ok[static_cast<std::size_t>(t)] +=
            tpl.render_chat(messages, true, "", "<|im_end|>") == want;
    });
  }
  for (auto& th : threads) th.join();
  for (int n : ok) CHECK(n == 200);
}

TEST_CASE("the template source is kept as given") {
  const duet::chat_template tpl("a\r\n{{ 1 }}\n");
  CHECK(tpl.source() == "a\r\n{{ 1 }}\n");
  CHECK(tpl.render(ojson::object()) == "a\n1");
}

TEST_CASE("hostile templates end in errors, not crashes or unbounded memory") {
  const std::string deep = std::string(2000, '(') + "1" + std::string(2000, ')');
  const auto e = syntax_error_of([&] { (void)render("{{ " + deep + " }}"); });
  CHECK(std::string(e.what()).find("nested too deeply") != std::string::npos);
  CHECK(render("{{ " + std::string(40, '(') + "1" + std::string(40, ')') + " }}") == "1");
  std::string blocks;
  for (int i = 0; i < 1000; ++i) blocks += "{% if true %}";
  CHECK_THROWS_AS((void)render(blocks), duet::chat_template_syntax_error);
  CHECK_THROWS_AS((void)render("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                               "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}"),
                  duet::chat_template_render_error);
  CHECK_THROWS_AS((void)render("{{ 'x' * 100000000 }}"), duet::chat_template_render_error);
}
