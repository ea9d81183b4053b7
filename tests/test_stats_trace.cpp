// Latency statistics, request traces and the run report.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/latency_stats.hpp"
#include "sim/report.hpp"
#include "sim/trace.hpp"

namespace fs = std::filesystem;
using namespace duet;
using doctest::Approx;

namespace {

const fs::path fixtures = fs::path(DUET_TEST_DATA) / "traces";
const fs::path shared_traces = fs::path(DUET_SOURCE_DIR) / ".." / "shared" / "traces";

/// The exception message of `f()`, or "" when it does not throw E.
template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

size_t count_of(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = haystack.find(needle); pos != std::string::npos;
       pos = haystack.find(needle, pos + needle.size())) {
    ++n;
  }
  return n;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

fs::path scratch_dir(const std::string& name) {
  const fs::path dir = fs::path(DUET_BINARY_DIR) / "test-output" / name;
  fs::remove_all(dir);
  return dir;
}

/// The crafted set of the summary tests; every time is a binary fraction, so it is exact.
///   r1: TTFT 0.125, 10 tokens, 9 gaps of 0.125, E2E 1.25, TPOT 0.125
///   r2: TTFT 0.5, 5 tokens, 4 gaps of 0.25, E2E 1.5, TPOT 0.25
///   r3: TTFT 0.25, a single token, E2E 0.25, no TPOT
///   r4: timed out at t = 4 without a token
std::vector<request_record> crafted_records() {
  std::vector<request_record> rs(4);
  rs[0] = {1, 0.0, 0.125, std::vector<double>(9, 0.125), 1.25, 100, 10, "ok"};
  rs[1] = {2, 1.0, 1.5, std::vector<double>(4, 0.25), 2.5, 200, 5, "ok"};
  rs[2] = {3, 2.0, 2.25, {}, 2.25, 300, 1, "ok"};
  rs[3] = {4, 3.0, std::nullopt, {}, 4.0, 400, 0, "timeout"};
  return rs;
}

}  // namespace

// ============================================================================ percentiles

TEST_CASE("linear percentiles interpolate between the two closest ranks") {
  const std::vector<double> ten = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  CHECK(percentile_sorted(ten, 50) == Approx(5.5));
  CHECK(percentile_sorted(ten, 90) == Approx(9.1));
  CHECK(percentile_sorted(ten, 99) == Approx(9.91));
  CHECK(percentile_sorted(ten, 0) == 1);
  CHECK(percentile_sorted(ten, 100) == 10);
  const std::vector<double> five = {15, 20, 35, 40, 50};
  CHECK(percentile_sorted(five, 40) == Approx(29));
  CHECK(percentile_sorted(five, 50) == Approx(35));
  CHECK(percentile_sorted(five, 90) == Approx(46));
  CHECK(percentile_sorted(five, 99) == Approx(49.6));
}

TEST_CASE("nearest-rank percentiles always return an observed sample") {
  const auto nr = percentile_method::nearest_rank;
  const std::vector<double> five = {15, 20, 35, 40, 50};  // the textbook example
  CHECK(percentile_sorted(five, 5, nr) == 15);
  CHECK(percentile_sorted(five, 30, nr) == 20);
  CHECK(percentile_sorted(five, 40, nr) == 20);
  CHECK(percentile_sorted(five, 50, nr) == 35);
  CHECK(percentile_sorted(five, 100, nr) == 50);
  const std::vector<double> ten = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  CHECK(percentile_sorted(ten, 50, nr) == 5);
  CHECK(percentile_sorted(ten, 90, nr) == 9);
  CHECK(percentile_sorted(ten, 99, nr) == 10);
}

TEST_CASE("percentiles of unsorted samples sort them first and ignore NaN") {
  const std::vector<double> shuffled = {7, 3, std::nan(""), 10, 1, 5, 9, 2, 8, 4, 6};
  CHECK(percentile(shuffled, 50) == Approx(5.5));
  const auto s = summarize_samples(shuffled);
  CHECK(s.count == 10);
  CHECK(s.mean == Approx(5.5));
  CHECK(s.min == 1);
  CHECK(s.max == 10);
  CHECK(s.p90 == Approx(9.1));
}

TEST_CASE("an empty sample set summarizes to zeros and a single sample to itself") {
  const auto empty = summarize_samples({});
  CHECK(empty.count == 0);
  CHECK(empty.p99 == 0);
  CHECK(percentile(std::vector<double>{}, 50) == 0);
  const std::vector<double> one = {0.042};
  const auto s = summarize_samples(one);
  CHECK(s.count == 1);
  CHECK(s.p50 == 0.042);
  CHECK(s.p99 == 0.042);
  CHECK(s.mean == Approx(0.042));
}

// ============================================================================ histogram

TEST_CASE("the histogram counts cumulatively with inclusive upper bounds") {
  latency_histogram h({0.1, 0.5, 1.0});
  for (double v : {0.05, 0.1, 0.3, 0.5, 0.7, 2.0, 5.0}) h.observe(v);
  h.observe(std::nan(""));
  CHECK(h.count() == 7);
  CHECK(h.dropped() == 1);
  CHECK(h.sum() == Approx(8.65));
  CHECK(h.cumulative_counts() == std::vector<uint64_t>{2, 4, 5, 7});
  CHECK(h.estimate_quantile(0.5) == Approx(0.4));  // rank 3.5: halfway-and-a-quarter in (0.1, 0.5]
  CHECK(h.estimate_quantile(1.0) == Approx(1.0));  // in +Inf: the highest finite bound
}

TEST_CASE("the histogram writes the Prometheus text format with escaped labels") {
  latency_histogram h({0.005, 0.25, 1});
  h.observe(0.001);
  h.observe(0.2);
  h.observe(3);
  const std::vector<std::pair<std::string, std::string>> labels = {{"model", "a\"b"}};
  const std::string text = h.to_prometheus("duet_ttft_seconds", "Time to first token.", labels);
  CHECK(text ==
        "# HELP duet_ttft_seconds Time to first token.\n"
        "# TYPE duet_ttft_seconds histogram\n"
        "duet_ttft_seconds_bucket{model=\"a\\\"b\",le=\"0.005\"} 1\n"
        "duet_ttft_seconds_bucket{model=\"a\\\"b\",le=\"0.25\"} 2\n"
        "duet_ttft_seconds_bucket{model=\"a\\\"b\",le=\"1\"} 2\n"
        "duet_ttft_seconds_bucket{model=\"a\\\"b\",le=\"+Inf\"} 3\n"
        "duet_ttft_seconds_sum{model=\"a\\\"b\"} 3.201\n"
        "duet_ttft_seconds_count{model=\"a\\\"b\"} 3\n");
  const std::string bare = latency_histogram({1}).to_prometheus("x", "y");
  CHECK(contains(bare, "x_bucket{le=\"+Inf\"} 0\n"));
  CHECK(contains(bare, "x_sum 0\nx_count 0\n"));
}

TEST_CASE("histograms with bad bounds are refused and merge only with equal bounds") {
  CHECK_THROWS_AS(latency_histogram({0.5, 0.1}), std::invalid_argument);
  CHECK_THROWS_AS(latency_histogram({0.1, std::numeric_limits<double>::infinity()}),
                  std::invalid_argument);
  latency_histogram a({1, 2}), b({1, 2}), c({1, 3});
  a.observe(0.5);
  b.observe(1.5);
  a.merge(b);
  CHECK(a.cumulative_counts() == std::vector<uint64_t>{1, 2, 2});
  CHECK_THROWS_AS(a.merge(c), std::invalid_argument);
  const auto exp = latency_histogram::exponential_buckets(0.001, 2, 4);
  CHECK(exp == std::vector<double>{0.001, 0.002, 0.004, 0.008});
  CHECK(latency_histogram::default_latency_buckets_s().front() == 0.001);
  CHECK(latency_histogram().upper_bounds().size() ==
        latency_histogram::default_latency_buckets_s().size());
}

// ============================================================================ summary

TEST_CASE("a request record derives TTFT, TPOT, E2E and token times") {
  const auto rs = crafted_records();
  CHECK(*rs[0].ttft_s() == 0.125);
  CHECK(*rs[0].tpot_s() == 0.125);
  CHECK(rs[0].e2e_s() == 1.25);
  const auto times = rs[1].token_times_s();
  CHECK(times == std::vector<double>{1.5, 1.75, 2.0, 2.25, 2.5});
  CHECK_FALSE(rs[2].tpot_s().has_value());
  CHECK_FALSE(rs[3].ttft_s().has_value());
  CHECK(rs[3].token_times_s().empty());
}

TEST_CASE("summarize computes TTFT, TPOT, ITL, E2E and throughput over completed requests") {
  const auto rs = crafted_records();
  const auto s = summarize(rs);
  CHECK(s.requests == 4);
  CHECK(s.completed == 3);
  CHECK(s.failed == 1);
  CHECK(s.outcomes.at("ok") == 3);
  CHECK(s.outcomes.at("timeout") == 1);
  CHECK(s.duration_s == 4.0);
  CHECK(s.input_tokens == 600);
  CHECK(s.output_tokens == 16);
  CHECK(s.request_throughput == Approx(0.75));
  CHECK(s.output_token_throughput == Approx(4.0));
  CHECK(s.total_token_throughput == Approx(154.0));

  CHECK(s.ttft_s.count == 3);
  CHECK(s.ttft_s.mean == Approx(0.875 / 3));
  CHECK(s.ttft_s.p50 == Approx(0.25));
  CHECK(s.ttft_s.p90 == Approx(0.45));
  CHECK(s.ttft_s.p99 == Approx(0.495));
  CHECK(s.ttft_s.max == 0.5);

  CHECK(s.tpot_s.count == 2);  // r3 has one token, so no TPOT
  CHECK(s.tpot_s.p50 == Approx(0.1875));
  CHECK(s.tpot_s.max == 0.25);

  CHECK(s.itl_s.count == 13);
  CHECK(s.itl_s.mean == Approx(2.125 / 13));
  CHECK(s.itl_s.p50 == 0.125);
  CHECK(s.itl_s.p90 == 0.25);

  CHECK(s.second_token_s.count == 2);  // r1's and r2's first gaps
  CHECK(s.second_token_s.p50 == Approx(0.1875));
  CHECK(s.second_token_s.max == 0.25);

  CHECK(s.e2e_s.count == 3);
  CHECK(s.e2e_s.p50 == 1.25);
  CHECK(s.e2e_s.min == 0.25);
  CHECK(s.e2e_s.max == 1.5);

  // No SLO: every completed request is good.
  CHECK(s.good == 3);
  CHECK(s.goodput == Approx(0.75));
  CHECK(s.slo_attainment == Approx(0.75));

  const auto over_8s = summarize(rs, {}, 8.0);
  CHECK(over_8s.duration_s == 8.0);
  CHECK(over_8s.request_throughput == Approx(0.375));
}

TEST_CASE("goodput counts completed requests meeting both the TTFT and the TPOT limits") {
  const auto rs = crafted_records();
  // Limits equal to r1's and r3's values: "<=" keeps them; r2 misses TTFT; r4 failed.
  auto s = summarize(rs, latency_slo{0.25, 0.125});
  CHECK(s.good == 2);
  CHECK(s.goodput == Approx(0.5));
  CHECK(s.slo_attainment == Approx(0.5));
  // TPOT alone: r2's 0.25 misses; r3 has no TPOT and meets that half.
  s = summarize(rs, latency_slo{std::numeric_limits<double>::infinity(), 0.2});
  CHECK(s.good == 2);
  // TTFT alone, tight: only r1.
  s = summarize(rs, latency_slo{0.2, std::numeric_limits<double>::infinity()});
  CHECK(s.good == 1);
  CHECK(s.goodput == Approx(0.25));
  // Loose enough for all completed ones; the failed one never counts.
  s = summarize(rs, latency_slo{1.0, 1.0});
  CHECK(s.good == 3);
  CHECK_FALSE(meets_slo(rs[3], latency_slo{}));
  // A completed request without any token is judged on its E2E.
  request_record silent{9, 0.0, std::nullopt, {}, 0.5, 10, 0, "ok"};
  CHECK(meets_slo(silent, latency_slo{0.5, 0.01}));
  CHECK_FALSE(meets_slo(silent, latency_slo{0.4, 0.01}));
}

TEST_CASE("summarize with nearest-rank percentiles reports observed samples") {
  const auto s = summarize(crafted_records(), {}, percentile_method::nearest_rank);
  CHECK(s.method == percentile_method::nearest_rank);
  CHECK(s.ttft_s.p50 == 0.25);
  CHECK(s.ttft_s.p90 == 0.5);
  CHECK(s.tpot_s.p50 == 0.125);
}

TEST_CASE("an empty run summarizes to zeros without dividing by zero") {
  const auto s = summarize(std::vector<request_record>{}, latency_slo{0.1, 0.1});
  CHECK(s.requests == 0);
  CHECK(s.duration_s == 0);
  CHECK(s.goodput == 0);
  CHECK(s.slo_attainment == 0);
  CHECK(s.ttft_s.count == 0);
  CHECK_FALSE(format_summary_table(s).empty());
}

TEST_CASE("the summary table shows every metric in milliseconds within 80 columns") {
  const auto s = summarize(crafted_records(), latency_slo{0.25, 0.125});
  const std::string table = format_summary_table(s, "1P1D on H200");
  INFO(table);
  for (const char* word : {"1P1D on H200", "TTFT", "TPOT", "ITL", "2nd token", "E2E", "P50", "P90", "P99",
                           "goodput", "timeout 1", "TTFT <= 250.0 ms", "TPOT <= 125.0 ms"}) {
    CHECK(contains(table, word));
  }
  CHECK(contains(table, "291.7"));  // TTFT mean in ms
  std::istringstream lines(table);
  for (std::string line; std::getline(lines, line);) CHECK(line.size() <= 80);

  const std::vector<std::pair<std::string, latency_summary>> runs = {{"colocated", s}, {"1P1D", s}};
  const std::string cmp = format_comparison_table(runs);
  CHECK(contains(cmp, "colocated"));
  CHECK(contains(cmp, "1P1D"));
  CHECK(contains(cmp, "TTFT P99 (ms)"));
  CHECK(contains(cmp, "goodput (req/s)"));
}

TEST_CASE("the summary JSON carries every field and reads back unchanged") {
  const auto s =
      summarize(crafted_records(), latency_slo{0.25, std::numeric_limits<double>::infinity()});
  const nlohmann::json j = to_json(s);
  const auto parsed = nlohmann::json::parse(j.dump());
  CHECK(parsed["completed"] == 3);
  CHECK(parsed["goodput_rps"].get<double>() == Approx(s.goodput));
  CHECK(parsed["slo"]["ttft_s"].get<double>() == 0.25);
  CHECK(parsed["slo"]["tpot_s"].is_null());
  CHECK(parsed["ttft_s"]["p90"].get<double>() == Approx(0.45));
  CHECK(parsed["outcomes"]["timeout"] == 1);
  CHECK(parsed["percentile_method"] == "linear");
  const auto back = parsed.get<latency_summary>();
  CHECK(back.requests == s.requests);
  CHECK(back.good == s.good);
  CHECK(std::isinf(back.slo.tpot_s));
  CHECK(back.slo.ttft_s == 0.25);
  CHECK(back.itl_s.p50 == s.itl_s.p50);
  CHECK(back.second_token_s.p50 == s.second_token_s.p50);
  CHECK(back.e2e_s.max == s.e2e_s.max);
  // A summary written before the second-token figure existed still reads.
  auto older = parsed;
  older.erase("second_token_s");
  CHECK(older.get<latency_summary>().second_token_s.count == 0);
  CHECK(back.outcomes == s.outcomes);
  nlohmann::json implicit = s;  // ADL to_json
  CHECK(implicit == j);
}

// ============================================================================ trace loaders

TEST_CASE("the Azure loader reads timestamps as seconds since the first row, across midnight") {
  const auto t = load_azure_csv(fixtures / "azure_conv_sample.csv");
  REQUIRE(t.size() == 12);
  const double expected[] = {0, 0.5, 0.75, 0.8734567, 1.75, 2.25, 3.0, 3.75, 3.75, 5.5, 6.75, 10.0};
  for (size_t i = 0; i < t.size(); ++i) CHECK(t[i].arrival_s == Approx(expected[i]).epsilon(1e-12));
  CHECK(t[0].input_tokens == 374);
  CHECK(t[0].output_tokens == 44);
  CHECK(t[9].input_tokens == 12000);
  CHECK(t[9].output_tokens == 900);
  CHECK(t[11].output_tokens == 320);
  CHECK(t[0].prefix_hashes.empty());
  const auto st = compute_trace_stats(t);
  CHECK(st.count == 12);
  CHECK(st.duration_s == Approx(10.0));
  CHECK(st.mean_rate == Approx(1.1));
}

TEST_CASE("the Azure loader finds columns by name and accepts CRLF, offsets and blank lines") {
  std::istringstream in(
      "GeneratedTokens,TIMESTAMP,ContextTokens,Extra\r\n"
      "10,2024-05-10 00:00:01.5+00:00,100,x\r\n"
      "\r\n"
      "20,2024-05-10T00:00:00Z,200,y\r\n"
      "30,2024-05-10 02:00:03.25+02:00,300,z\r\n");
  const auto t = parse_azure_csv(in, "inline.csv");
  REQUIRE(t.size() == 3);
  // Sorted by time: 00:00:00 (200), 00:00:01.5 (100), 00:00:03.25 UTC (300).
  CHECK(t[0].input_tokens == 200);
  CHECK(t[0].output_tokens == 20);
  CHECK(t[1].arrival_s == Approx(1.5));
  CHECK(t[2].arrival_s == Approx(3.25));
  CHECK(t[2].input_tokens == 300);
}

TEST_CASE("a malformed Azure row is reported with its file and line") {
  const std::string err =
      error_of<trace_error>([] { (void)load_azure_csv(fixtures / "azure_malformed.csv"); });
  INFO(err);
  CHECK(contains(err, "azure_malformed.csv:5:"));
  CHECK(contains(err, "GeneratedTokens"));
  CHECK(contains(err, "abc"));

  auto parse_error = [](const std::string& text) {
    return error_of<trace_error>([&] {
      std::istringstream in(text);
      (void)parse_azure_csv(in, "t.csv");
    });
  };
  const std::string header = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
  CHECK(contains(parse_error(header + "2023-11-16 18:15:46.68,1,2\n2023-11-16 18:15:47,1\n"),
                 "t.csv:3: expected 3 columns, got 2"));
  CHECK(contains(parse_error(header + "2023-13-16 18:15:46.68,1,2\n"), "t.csv:2: bad TIMESTAMP"));
  CHECK(contains(parse_error(header + "2023-02-30 18:15:46.68,1,2\n"), "t.csv:2: bad TIMESTAMP"));
  CHECK(contains(parse_error(header + "2023-11-16 18:15:46.68,-5,2\n"),
                 "t.csv:2: bad ContextTokens"));
  CHECK(contains(parse_error(header + "2023-11-16 18:15:46.68,5,2.5\n"),
                 "t.csv:2: bad GeneratedTokens"));
  CHECK(contains(parse_error("time,in,out\n"), "t.csv:1: expected a header"));
  CHECK(contains(parse_error(""), "t.csv:1: empty trace file"));
  CHECK(contains(error_of<trace_error>([] { (void)load_azure_csv(fixtures / "missing.csv"); }),
                 "missing.csv: cannot open"));
}

TEST_CASE("the Mooncake loader reads millisecond timestamps, lengths and prefix hashes") {
  const auto t = load_mooncake_jsonl(fixtures / "mooncake_sample.jsonl");
  REQUIRE(t.size() == 12);
  CHECK(t[0].arrival_s == 0);
  CHECK(t[2].arrival_s == Approx(0.12));
  CHECK(t[11].arrival_s == Approx(9.999));
  CHECK(t[6].input_tokens == 5000);
  CHECK(t[6].output_tokens == 400);
  CHECK(t[6].prefix_hashes.size() == 10);
  CHECK(t[0].prefix_hashes == std::vector<uint64_t>{0, 1, 2});
  // Requests 1 and 2 share their first two 512-token blocks.
  CHECK(t[1].prefix_hashes[0] == t[0].prefix_hashes[0]);
  CHECK(t[1].prefix_hashes[1] == t[0].prefix_hashes[1]);
  for (const auto& r : t) {
    CHECK(r.prefix_hashes.size() ==
          (r.input_tokens + mooncake_hash_block_tokens - 1) / mooncake_hash_block_tokens);
  }
  CHECK(load_trace(fixtures / "mooncake_sample.jsonl").size() == 12);
  CHECK(load_trace(fixtures / "azure_conv_sample.csv").size() == 12);
  CHECK(contains(error_of<trace_error>([] { (void)load_trace("trace.parquet"); }),
                 "unknown trace format"));
}

TEST_CASE("a malformed Mooncake line is reported with its file and line") {
  const std::string err = error_of<trace_error>(
      [] { (void)load_mooncake_jsonl(fixtures / "mooncake_malformed.jsonl"); });
  INFO(err);
  CHECK(contains(err, "mooncake_malformed.jsonl:4: missing \"output_length\""));

  auto parse_error = [](const std::string& text) {
    return error_of<trace_error>([&] {
      std::istringstream in(text);
      (void)parse_mooncake_jsonl(in, "m.jsonl");
    });
  };
  CHECK(contains(
      parse_error("{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n{oops\n"),
      "m.jsonl:2: invalid JSON"));
  CHECK(contains(parse_error("[1, 2]\n"), "m.jsonl:1: expected a JSON object"));
  CHECK(contains(parse_error("{\"timestamp\": -1, \"input_length\": 5, \"output_length\": 1}\n"),
                 "m.jsonl:1: \"timestamp\" must be"));
  CHECK(contains(parse_error("{\"timestamp\": 1, \"input_length\": 5.5, \"output_length\": 1}\n"),
                 "m.jsonl:1: \"input_length\" must be a non-negative integer"));
  CHECK(contains(parse_error("{\"timestamp\": 1, \"input_length\": 5, \"output_length\": 1, "
                             "\"hash_ids\": [1, \"x\"]}\n"),
                 "m.jsonl:1: \"hash_ids\" must hold non-negative integers"));
}

TEST_CASE("a trace saved as Mooncake JSONL loads back the same") {
  const auto original = load_mooncake_jsonl(fixtures / "mooncake_sample.jsonl");
  std::stringstream buf;
  write_mooncake_jsonl(buf, original);
  const auto back = parse_mooncake_jsonl(buf, "roundtrip");
  REQUIRE(back.size() == original.size());
  for (size_t i = 0; i < back.size(); ++i) {
    CHECK(back[i].arrival_s == Approx(original[i].arrival_s));
    CHECK(back[i].input_tokens == original[i].input_tokens);
    CHECK(back[i].output_tokens == original[i].output_tokens);
    CHECK(back[i].prefix_hashes == original[i].prefix_hashes);
  }
}

TEST_CASE("the real Azure conversation trace has 19366 requests over about an hour") {
  const fs::path file = shared_traces / "AzureLLMInferenceTrace_conv_2023.csv";
  if (!fs::exists(file)) {
    MESSAGE("skipped: " << file << " is not present");
    return;
  }
  const auto t = load_azure_csv(file);
  CHECK(t.size() == 19366);
  // 2023-11-16 18:15:46.6805900 to 19:14:08.4025270.
  CHECK(t.back().arrival_s == Approx(3501.721937).epsilon(1e-9));
  CHECK(t[1].arrival_s == Approx(4.314579).epsilon(1e-9));
  CHECK(t[0].input_tokens == 374);
  CHECK(t[0].output_tokens == 44);
  const auto st = compute_trace_stats(t);
  CHECK(st.duration_s == Approx(3501.721937).epsilon(1e-9));
  CHECK(st.mean_rate == Approx(19365 / 3501.721937));
  CHECK(st.input_mean == Approx(1154.7).epsilon(1e-3));
  CHECK(st.output_mean == Approx(211.13).epsilon(1e-3));
  CHECK(st.input_max == 14050);
  CHECK(st.output_max == 1000);
  CHECK(st.interarrival_cv > 1.0);  // production arrivals are burstier than Poisson
  MESSAGE("Azure conversation 2023:\n" << format_trace_stats(st));
}

TEST_CASE("the real Azure code trace and Mooncake conversation trace load whole") {
  const fs::path code = shared_traces / "AzureLLMInferenceTrace_code_2023.csv";
  const fs::path moon = shared_traces / "mooncake_conversation_trace.jsonl";
  if (!fs::exists(code) || !fs::exists(moon)) {
    MESSAGE("skipped: real traces are not present under " << shared_traces);
    return;
  }
  const auto c = load_azure_csv(code);
  CHECK(c.size() == 8819);
  // 18:17:03.9799600 to 19:14:19.9280160.
  CHECK(c.back().arrival_s == Approx(3435.948056).epsilon(1e-9));
  const auto m = load_mooncake_jsonl(moon);
  CHECK(m.size() == 12031);
  CHECK(m.back().arrival_s == Approx(3536.999));
  const auto st = compute_trace_stats(m);
  CHECK(st.input_mean == Approx(12035).epsilon(2e-3));  // the README's 12,035
  CHECK(st.output_mean == Approx(343).epsilon(5e-3));   // and 343
  CHECK_FALSE(m[0].prefix_hashes.empty());
}

// ============================================================================ synthetic

TEST_CASE("Poisson arrivals hit their target rate with an inter-arrival CV of one") {
  synthetic_trace_params p;
  p.process = arrival_process::poisson;
  p.rate = 10;
  p.count = 20000;
  p.seed = 42;
  const auto t = generate_synthetic_trace(p);
  REQUIRE(t.size() == 20000);
  CHECK(t[0].arrival_s == 0);
  CHECK(std::is_sorted(t.begin(), t.end(),
                       [](const auto& a, const auto& b) { return a.arrival_s < b.arrival_s; }));
  const auto st = compute_trace_stats(t);
  CHECK(st.mean_rate == Approx(10).epsilon(0.03));
  CHECK(st.interarrival_cv == Approx(1.0).epsilon(0.05));
  CHECK(t[0].input_tokens == 512);
  CHECK(t[0].output_tokens == 128);
}

TEST_CASE("gamma arrivals hit their target rate and burstiness CV") {
  for (double cv : {0.5, 2.0, 4.0}) {
    CAPTURE(cv);
    synthetic_trace_params p;
    p.process = arrival_process::gamma;
    p.rate = 5;
    p.cv = cv;
    p.count = 50000;
    p.seed = 7;
    const auto st = compute_trace_stats(generate_synthetic_trace(p));
    CHECK(st.mean_rate == Approx(5).epsilon(0.05));
    CHECK(st.interarrival_cv == Approx(cv).epsilon(0.1));
  }
}

TEST_CASE("on/off bursts keep the long-run rate and leave the off periods silent") {
  synthetic_trace_params p;
  p.process = arrival_process::on_off;
  p.rate = 4;
  p.on_s = 2;
  p.off_s = 6;
  p.duration_s = 4000;
  p.seed = 3;
  const auto t = generate_synthetic_trace(p);
  const auto st = compute_trace_stats(t);
  CHECK(st.mean_rate == Approx(4).epsilon(0.05));
  CHECK(st.interarrival_cv > 1.5);
  CHECK(t.back().arrival_s < 4000);
  size_t in_off = 0;
  for (const auto& r : t) {
    if (std::fmod(r.arrival_s, 8.0) > 2.0 + 1e-9) ++in_off;
  }
  CHECK(in_off == 0);
}

TEST_CASE("a synthetic trace is reproducible from its seed") {
  synthetic_trace_params p;
  p.process = arrival_process::gamma;
  p.cv = 3;
  p.count = 500;
  p.input = length_distribution::lognormal(1000, 1.0);
  p.output = length_distribution::uniform(10, 300);
  p.seed = 1234;
  const auto a = generate_synthetic_trace(p);
  const auto b = generate_synthetic_trace(p);
  REQUIRE(a.size() == b.size());
  bool same = true;
  for (size_t i = 0; i < a.size(); ++i) {
    same = same && a[i].arrival_s == b[i].arrival_s && a[i].input_tokens == b[i].input_tokens &&
           a[i].output_tokens == b[i].output_tokens;
  }
  CHECK(same);
  p.seed = 1235;
  const auto c = generate_synthetic_trace(p);
  CHECK(c[1].arrival_s != a[1].arrival_s);
}

TEST_CASE("length distributions hit their mean and CV within their bounds") {
  synthetic_trace_params p;
  p.count = 50000;
  p.seed = 99;
  p.input = length_distribution::lognormal(1000, 0.8);
  p.output = length_distribution::uniform(10, 20);
  const auto t = generate_synthetic_trace(p);
  std::vector<double> in;
  double out_sum = 0;
  uint32_t out_min = UINT32_MAX, out_max = 0;
  for (const auto& r : t) {
    in.push_back(r.input_tokens);
    out_sum += r.output_tokens;
    out_min = std::min(out_min, r.output_tokens);
    out_max = std::max(out_max, r.output_tokens);
  }
  const auto s = summarize_samples(in);
  double ss = 0;
  for (double v : in) ss += (v - s.mean) * (v - s.mean);
  const double cv = std::sqrt(ss / static_cast<double>(in.size())) / s.mean;
  CHECK(s.mean == Approx(1000).epsilon(0.03));
  CHECK(cv == Approx(0.8).epsilon(0.06));
  CHECK(s.min >= 1);
  CHECK(out_min == 10);
  CHECK(out_max == 20);
  CHECK(out_sum / static_cast<double>(t.size()) == Approx(15).epsilon(0.01));

  p.count = 100;
  p.input = length_distribution::lognormal(1000, 2.0, 50, 4000);
  for (const auto& r : generate_synthetic_trace(p)) {
    CHECK(r.input_tokens >= 50);
    CHECK(r.input_tokens <= 4000);
  }
}

TEST_CASE("invalid synthetic parameters are refused with a reason") {
  synthetic_trace_params p;
  p.count = 10;
  p.rate = 0;
  CHECK(contains(error_of<trace_error>([&] { (void)generate_synthetic_trace(p); }), "rate"));
  p.rate = 1;
  p.count = 0;
  CHECK(contains(error_of<trace_error>([&] { (void)generate_synthetic_trace(p); }), "count"));
  p.count = 10;
  p.process = arrival_process::gamma;
  p.cv = 0;
  CHECK(contains(error_of<trace_error>([&] { (void)generate_synthetic_trace(p); }), "cv"));
  p.process = arrival_process::on_off;
  p.on_s = 0;
  CHECK(contains(error_of<trace_error>([&] { (void)generate_synthetic_trace(p); }), "on_s"));
  p.process = arrival_process::poisson;
  p.input = length_distribution::uniform(20, 10);
  CHECK(contains(error_of<trace_error>([&] { (void)generate_synthetic_trace(p); }), "min > max"));
}

// ============================================================================ transforms

TEST_CASE("rate scaling compresses or stretches arrival times") {
  std::vector<trace_request> t = {{0, 10, 5, {}}, {1, 10, 5, {}}, {3, 10, 5, {}}};
  const auto fast = scale_rate(t, 2);
  CHECK(fast[1].arrival_s == 0.5);
  CHECK(fast[2].arrival_s == 1.5);
  const auto slow = scale_rate(t, 0.5);
  CHECK(slow[2].arrival_s == 6);
  CHECK(compute_trace_stats(fast).mean_rate == Approx(2 * compute_trace_stats(t).mean_rate));
  CHECK_THROWS_AS((void)scale_rate(t, 0), trace_error);
}

TEST_CASE("a time window keeps its requests and restarts the clock at its start") {
  std::vector<trace_request> t;
  for (int i = 0; i < 10; ++i) t.push_back({double(i), uint32_t(i + 1), 1, {}});
  const auto w = time_window(t, 3, 4);  // [3, 7)
  REQUIRE(w.size() == 4);
  CHECK(w.front().arrival_s == 0);
  CHECK(w.front().input_tokens == 4);
  CHECK(w.back().arrival_s == 3);
  CHECK(limit_count(t, 3).size() == 3);
  CHECK(limit_count(t, 30).size() == 10);
}

TEST_CASE("clipping to the context limit shortens the input first and keeps one token") {
  std::vector<trace_request> t = {
      {0, 100, 50, {}},          // fits after clipping input to 70
      {0, 100, 200, {}},         // output alone is over: input 1, output 119
      {0, 10, 10, {}},           // fits already
      {0, 1500, 88, {1, 2, 3}},  // input → 512, one 512-token hash block left
  };
  const auto c = clip_to_context(t, 120);
  CHECK(c[0].input_tokens == 70);
  CHECK(c[0].output_tokens == 50);
  CHECK(c[1].input_tokens == 1);
  CHECK(c[1].output_tokens == 119);
  CHECK(c[2].input_tokens == 10);
  CHECK(c[2].output_tokens == 10);
  const auto h = clip_to_context({t[3]}, 600);
  CHECK(h[0].input_tokens == 512);
  CHECK(h[0].output_tokens == 88);
  CHECK(h[0].prefix_hashes == std::vector<uint64_t>{1});
  for (const auto& r : c) CHECK(r.input_tokens + r.output_tokens <= 120);
}

TEST_CASE("a trace transform applies window, rate scale, count and clip in that order") {
  std::vector<trace_request> t;
  for (int i = 0; i < 100; ++i) t.push_back({double(i), 4000, 100, {}});
  trace_transform x;
  x.window_start_s = 10;
  x.window_duration_s = 50;
  x.rate_scale = 2;
  x.max_requests = 20;
  x.max_context = 1000;
  const auto out = apply_transform(t, x);
  REQUIRE(out.size() == 20);
  CHECK(out[0].arrival_s == 0);
  CHECK(out[19].arrival_s == 9.5);
  CHECK(out[0].input_tokens == 900);
  CHECK(apply_transform(t, {}).size() == 100);
}

TEST_CASE("trace statistics report count, duration, rate, CV and length percentiles") {
  const std::vector<trace_request> t = {
      {0, 100, 10, {}}, {1, 200, 20, {}}, {3, 300, 30, {}}, {6, 400, 40, {}}};
  const auto s = compute_trace_stats(t);
  CHECK(s.count == 4);
  CHECK(s.duration_s == 6);
  CHECK(s.mean_rate == Approx(0.5));
  CHECK(s.interarrival_cv == Approx(std::sqrt(2.0 / 3.0) / 2.0));
  CHECK(s.input_mean == Approx(250));
  CHECK(s.input_p50 == Approx(250));
  CHECK(s.input_p99 == Approx(397));
  CHECK(s.input_max == 400);
  CHECK(s.output_mean == Approx(25));
  CHECK(s.output_max == 40);
  const std::string text = format_trace_stats(s);
  CHECK(contains(text, "requests     4 over 6.0 s"));
  nlohmann::json j = s;
  CHECK(j["input_tokens"]["p99"].get<double>() == Approx(397));
  const auto empty = compute_trace_stats({});
  CHECK(empty.count == 0);
  CHECK(empty.mean_rate == 0);
}

// ============================================================================ report

namespace {

time_series ramp_series(std::string name, std::string unit, double scale) {
  time_series ts{std::move(name), std::move(unit), {}, {}};
  for (int i = 0; i <= 5000; ++i) {  // more points than the plot keeps
    ts.t_s.push_back(i * 0.001);
    ts.values.push_back(scale * std::sin(i * 0.01) * std::sin(i * 0.01));
  }
  return ts;
}

}  // namespace

TEST_CASE("the report writer writes parseable JSON, one CSV row per request and one svg per plot") {
  auto records = crafted_records();
  std::vector<report_run> runs;
  runs.push_back(make_report_run(
      "colocated", records, latency_slo{0.25, 0.125},
      {ramp_series("queue depth", "requests", 12), ramp_series("KV blocks used", "blocks", 4096)}));
  for (auto& r : records) {
    if (r.first_token_s) *r.first_token_s -= 0.0625;
  }
  runs.push_back(make_report_run(
      "1P1D, <fast> & \"new\"", records, latency_slo{0.25, 0.125},
      {ramp_series("queue depth", "requests", 5), ramp_series("GPU busy", "fraction busy", 1)}));
  report_options opts;
  opts.title = "colocated vs 1P1D";
  opts.subtitle = "crafted records";
  const fs::path dir = scratch_dir("report_two_runs");
  const auto files = write_report(dir, runs, opts);

  CHECK(files.summary_json == dir / "summary.json");
  const auto summary = nlohmann::json::parse(read_all(files.summary_json));
  CHECK(summary["title"] == "colocated vs 1P1D");
  REQUIRE(summary["runs"].size() == 2);
  CHECK(summary["runs"][0]["name"] == "colocated");
  CHECK(summary["runs"][0]["summary"]["good_requests"] == 2);
  CHECK(summary["runs"][1]["series"][1]["name"] == "GPU busy");
  CHECK(summary["runs"][1]["series"][1]["points"] == 5001);
  const auto back = summary["runs"][0]["summary"].get<latency_summary>();
  CHECK(back.ttft_s.p90 == Approx(0.45));

  const std::string csv = read_all(files.requests_csv);
  CHECK(count_of(csv, "\n") == 1 + 2 * records.size());
  CHECK(csv.starts_with("run,id,arrival_s,first_token_s,finish_s,ttft_s,tpot_s,e2e_s,"));
  const std::string gaps = "125000 125000 125000 125000 125000 125000 125000 125000 125000";
  CHECK(contains(csv, "\ncolocated,1,0,0.125,1.25,0.125,0.125,1.25,100,10,9,0.125,0.125,ok,1," + gaps + "\n"));
  CHECK(contains(csv, "\ncolocated,2,1,1.5,2.5,0.5,0.25,1.5,200,5,4,0.25,0.25,ok,0,250000 250000 250000 250000\n"));
  CHECK(contains(csv, "\ncolocated,4,3,,4,,,1,400,0,0,,,timeout,0,\n"));
  CHECK(contains(csv, "\"1P1D, <fast> & \"\"new\"\"\",2,"));

  const std::string html = read_all(files.report_html);
  const auto titles = report_plot_titles(runs);
  // 4 CDFs, TTFT and ITL over time, request rate, and 3 distinct series names.
  CHECK(titles.size() == 10);
  CHECK(files.plots == 10);
  CHECK(count_of(html, "<svg") == files.plots);
  CHECK(count_of(html, "</svg>") == files.plots);
  for (const auto& title : titles) CHECK(contains(html, ">" + title + "</text>"));
  CHECK(contains(html, "1P1D, &lt;fast&gt; &amp; &quot;new&quot;"));
  CHECK_FALSE(contains(html, "<fast>"));
  CHECK_FALSE(contains(html, "<script"));
  CHECK_FALSE(contains(html, "https://"));
  CHECK(contains(html, "SLO 250 ms"));
  CHECK(contains(html, "SLO 125 ms"));
}

TEST_CASE("a report of runs without requests still draws every plot, saying there is no data") {
  std::vector<report_run> runs = {make_report_run("idle", {})};
  const std::string html = render_report_html(runs);
  CHECK(count_of(html, "<svg") == report_plot_titles(runs).size());
  CHECK(count_of(html, "no data") >= 4);
  const fs::path dir = scratch_dir("report_empty");
  const auto files = write_report(dir, runs);
  CHECK(nlohmann::json::parse(read_all(files.summary_json))["runs"][0]["summary"]["requests"] == 0);
  CHECK(read_all(files.requests_csv).find('\n') == read_all(files.requests_csv).size() - 1);
}

TEST_CASE("a report into an unwritable place fails with the path in the message") {
  const fs::path blocker = scratch_dir("report_blocked");
  fs::create_directories(blocker.parent_path());
  std::ofstream(blocker) << "a file, not a directory";
  const std::string err = error_of<report_error>(
      [&] { (void)write_report(blocker / "sub", std::vector<report_run>{}); });
  CHECK(contains(err, "report_blocked"));
}

// ============================================================================ sample report

namespace {

/// A toy latency model, only to give the sample report realistic shapes: a FIFO prefill
/// server (15 ms + 0.08-0.09 ms/token), decode whose TPOT grows with load, and, when colocated,
/// ITL spikes while a prefill runs on the same GPU.
report_run toy_deployment(const std::string& name, const std::vector<trace_request>& trace,
                          bool colocated, const latency_slo& slo, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uniform = [&] { return static_cast<double>(rng() >> 11) * 0x1.0p-53; };
  const double per_token = colocated ? 0.00009 : 0.00008;
  std::vector<request_record> records;
  records.reserve(trace.size());
  double server_free = 0;
  std::vector<std::pair<double, double>> prefills;  // [start, end)
  std::vector<double> starts;
  for (size_t i = 0; i < trace.size(); ++i) {
    const auto& q = trace[i];
    const double start = std::max(q.arrival_s, server_free);
    const double service = 0.015 + per_token * q.input_tokens;
    server_free = start + service;
    prefills.emplace_back(start, server_free);
    starts.push_back(start);
    request_record r;
    r.id = i;
    r.arrival_s = q.arrival_s;
    r.prompt_tokens = q.input_tokens;
    r.output_tokens = q.output_tokens;
    r.first_token_s = server_free + (colocated ? 0.0 : 0.004 + 2e-6 * q.input_tokens);
    records.push_back(std::move(r));
  }
  // Load: arrivals in the trailing 30 s.
  size_t window_begin = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    auto& r = records[i];
    size_t busy_idx = i;  // prefills are FIFO: none before i can overlap i's decode
    while (trace[window_begin].arrival_s < r.arrival_s - 30) ++window_begin;
    const double load = static_cast<double>(i - window_begin + 1) / 30.0;
    const double base = (colocated ? 0.016 : 0.012) + 0.0012 * load;
    double t = *r.first_token_s;
    r.itl_s.reserve(r.output_tokens > 0 ? r.output_tokens - 1 : 0);
    for (uint32_t k = 1; k < r.output_tokens; ++k) {
      double gap = base * (0.85 + 0.3 * uniform());
      if (colocated) {
        while (busy_idx + 1 < prefills.size() && prefills[busy_idx].second < t) ++busy_idx;
        if (prefills[busy_idx].first <= t + gap && t < prefills[busy_idx].second &&
            uniform() < 0.5) {
          gap += prefills[busy_idx].second - prefills[busy_idx].first;
        }
      }
      r.itl_s.push_back(gap);
      t += gap;
    }
    r.finish_s = t;
    if (uniform() < 0.002) {
      r.outcome = "timeout";
      r.itl_s.clear();
      r.first_token_s.reset();
    }
  }
  // Series, sampled every 10 s: prefill queue depth, KV blocks in use, GPU busy fraction.
  time_series queue{"prefill queue depth", "requests waiting", {}, {}};
  time_series kv{"KV blocks used", "16-token blocks", {}, {}};
  time_series busy{"GPU busy fraction (prefill)", "fraction of time", {}, {}};
  const double end = records.empty() ? 0 : records.back().finish_s;
  for (double t = 0; t <= end; t += 10) {
    size_t waiting = 0;
    double blocks = 0, busy_s = 0;
    for (size_t i = 0; i < records.size(); ++i) {
      if (trace[i].arrival_s <= t && starts[i] > t) ++waiting;
      const auto& r = records[i];
      if (r.first_token_s && *r.first_token_s <= t && t < r.finish_s) {
        const double frac = (t - *r.first_token_s) / std::max(1e-9, r.finish_s - *r.first_token_s);
        blocks += std::ceil((r.prompt_tokens + frac * r.output_tokens) / 16.0);
      }
      busy_s +=
          std::max(0.0, std::min(prefills[i].second, t + 10) - std::max(prefills[i].first, t));
    }
    queue.t_s.push_back(t);
    queue.values.push_back(static_cast<double>(waiting));
    kv.t_s.push_back(t);
    kv.values.push_back(blocks);
    busy.t_s.push_back(t);
    busy.values.push_back(busy_s / 10.0);
  }
  return make_report_run(name, std::move(records), slo, {queue, kv, busy});
}

}  // namespace

TEST_CASE("a sample report renders from the real Azure conversation trace") {
  const fs::path file = shared_traces / "AzureLLMInferenceTrace_conv_2023.csv";
  if (!fs::exists(file)) {
    MESSAGE("skipped: " << file << " is not present");
    return;
  }
  const auto trace = load_azure_csv(file);
  const latency_slo slo{2.0, 0.05};
  std::vector<report_run> runs;
  runs.push_back(toy_deployment("colocated (toy model)", trace, true, slo, 1));
  runs.push_back(toy_deployment("1P1D (toy model)", trace, false, slo, 2));
  const char* env_dir = std::getenv("DUET_SAMPLE_REPORT_DIR");
  const fs::path dir = env_dir ? fs::path(env_dir) : scratch_dir("report_sample_azure_conv");
  report_options opts;
  opts.title = "Azure LLM conversation trace 2023";
  opts.subtitle = "19,366 requests; synthetic latencies from a toy cost model (not a simulation)";
  const auto files = write_report(dir, runs, opts);
  const std::string html = read_all(files.report_html);
  CHECK(count_of(html, "<svg") == files.plots);
  CHECK(files.plots == 10);
  CHECK(html.size() < 4u * 1024 * 1024);  // thinned plots keep the page light
  CHECK(runs[0].summary.requests == 19366);
  MESSAGE("sample report: " << files.report_html);
  std::vector<std::pair<std::string, latency_summary>> cmp;
  for (const auto& r : runs) cmp.emplace_back(r.name, r.summary);
  MESSAGE("\n" << format_comparison_table(cmp));
}
