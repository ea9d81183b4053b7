#pragma once
// The run report of `duet sim` and `duet bench serve`: DIR/summary.json, DIR/requests.csv
// and DIR/report.html, a self-contained page (inline CSS and SVG drawn here; no scripts, no
// network) that puts several runs ("deployments") side by side:
//   - a summary table (one column per run),
//   - latency CDFs of TTFT, TPOT, ITL and E2E (log x axis when the spread is wide),
//   - TTFT and ITL over time (P50 dashed, P99 solid, per time bin),
//   - arrival and completion rate over time,
//   - one plot per named time series (queue depth, KV blocks used, GPU busy...), all runs
//     that carry a series of that name drawn together.
#include <cstddef>
#include <filesystem>
#include <iosfwd>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/latency_stats.hpp"

namespace duet {

/// A quantity sampled over time during a run, on the records' clock.
struct time_series {
  std::string name;            // plot title; series of equal name from different runs share a plot
  std::string unit;            // y-axis label, e.g. "requests", "blocks", "fraction busy"
  std::vector<double> t_s;     // sample times, ascending
  std::vector<double> values;  // same length as t_s
};

/// One deployment's results.
struct report_run {
  std::string name;  // e.g. "colocated", "1P1D", "2P1D sm=60/40"
  std::vector<request_record> records;
  latency_summary summary;
  std::vector<time_series> series;
};

/// Builds a run whose summary is summarize(records, slo).
[[nodiscard]] report_run make_report_run(std::string name, std::vector<request_record> records,
                                         const latency_slo& slo = {},
                                         std::vector<time_series> series = {});

struct report_options {
  std::string title = "duet run report";
  std::string subtitle;   // a line under the title: trace, model, hardware...
  double time_bin_s = 0;  // bin width of the over-time plots; 0 picks about 60 bins
};

/// An I/O failure while writing a report; what() names the path.
class report_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What write_report wrote.
struct report_files {
  std::filesystem::path summary_json;
  std::filesystem::path requests_csv;
  std::filesystem::path report_html;
  size_t plots = 0;  // SVG plots in the HTML page (one <svg> element each)
};

/// Creates `dir` if needed and writes summary.json, requests.csv and report.html into it.
/// Throws report_error when a file cannot be written.
[[nodiscard]] report_files write_report(const std::filesystem::path& dir,
                                        std::span<const report_run> runs,
                                        const report_options& options = {});

/// {"title", "subtitle", "generator", "runs": [{"name", "summary", "series": [{"name",
/// "unit", "points", "mean", "max", "last"}]}]}.
[[nodiscard]] nlohmann::json report_summary_json(std::span<const report_run> runs,
                                                 const report_options& options = {});

/// Header, then one row per record of every run: run,id,arrival_s,first_token_s,finish_s,
/// ttft_s,tpot_s,e2e_s,prompt_tokens,output_tokens,itl_count,itl_mean_s,itl_max_s,outcome,
/// meets_slo,itl_us. Missing values are empty cells; numbers are written to round-trip exactly,
/// except itl_us: every inter-token gap in order, in whole microseconds, separated by spaces.
void write_requests_csv(std::ostream& out, std::span<const report_run> runs);

/// The titles of the plots report.html holds for these runs, in page order.
[[nodiscard]] std::vector<std::string> report_plot_titles(std::span<const report_run> runs);

/// The whole HTML page.
[[nodiscard]] std::string render_report_html(std::span<const report_run> runs,
                                             const report_options& options = {});

}  // namespace duet
