#include "sim/report.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string_view>
#include <tuple>
#include <utility>

#include "runtime/version.hpp"

namespace duet {

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();
constexpr double nan = std::numeric_limits<double>::quiet_NaN();

std::string printf_string(const char* fmt, auto... args) {
  char buf[512];
  const int n = std::snprintf(buf, sizeof buf, fmt, args...);
  if (n < 0) return {};
  return std::string(buf, static_cast<size_t>(std::min<int>(n, sizeof buf - 1)));
}

/// Shortest text that reads back as the same double.
std::string exact(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

std::string html_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string csv_field(std::string_view s) {
  if (s.find_first_of(",\"\r\n") == std::string_view::npos) return std::string(s);
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  out += '"';
  return out;
}

/// Trims "12.50" to "12.5" and "3.00" to "3".
std::string trim_zeros(std::string s) {
  if (s.find('.') == std::string::npos || s.find('e') != std::string::npos) return s;
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

/// A duration for tick labels and prose: "250 µs", "12.5 ms", "3.2 s".
std::string format_duration(double seconds) {
  const double a = std::abs(seconds);
  if (a == 0) return "0";
  if (a >= 1) return trim_zeros(printf_string("%.4g", seconds)) + " s";
  if (a >= 1e-3) return trim_zeros(printf_string("%.4g", seconds * 1e3)) + " ms";
  return trim_zeros(printf_string("%.4g", seconds * 1e6)) + " \u00b5s";
}

/// Milliseconds with 3-4 significant digits, for tables.
std::string format_ms(double seconds) {
  const double ms = seconds * 1000.0;
  if (!std::isfinite(ms)) return "-";
  const double a = std::abs(ms);
  if (a < 1) return printf_string("%.3f", ms);
  if (a < 100) return printf_string("%.2f", ms);
  return printf_string("%.1f", ms);
}

const char* const palette[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7",
                               "#E69F00", "#56B4E9", "#555555", "#B8860B"};
std::string run_color(size_t i) {
  return palette[i % std::size(palette)];
}

// ---------------------------------------------------------------------------- axes

enum class tick_format : uint8_t { number, duration, fraction };

struct axis_spec {
  double lo = 0;
  double hi = 1;
  bool log = false;
  tick_format format = tick_format::number;
  std::string title;
};

struct tick {
  double value;       // data units
  std::string label;  // empty for a minor gridline
};

double nice_number(double raw) {
  if (!(raw > 0) || !std::isfinite(raw)) return 1;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  const double n = f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10;
  return n * mag;
}

/// Display unit of a linear duration axis, chosen from its top.
std::pair<double, const char*> duration_unit(double hi) {
  if (hi >= 2.0) return {1.0, "s"};
  if (hi >= 2e-3) return {1e3, "ms"};
  return {1e6, "\u00b5s"};
}

/// Rounds the axis out to tick boundaries and returns its ticks. For linear duration axes
/// the unit goes into the title and the labels are plain numbers in that unit.
std::vector<tick> finalize_axis(axis_spec& a) {
  std::vector<tick> ticks;
  if (!std::isfinite(a.lo) || !std::isfinite(a.hi)) {
    a.lo = 0;
    a.hi = 1;
  }
  if (a.log) {
    // Bounds snap to the 1-2-5 sequence around the data; gridlines at every 1..9 x 10^k,
    // labels at 1, 2 and 5 x 10^k when the axis spans at most three decades, else at 10^k,
    // and always at both ends.
    a.lo = std::max(a.lo, 1e-12);
    if (!(a.hi > a.lo)) a.hi = a.lo * 10;
    auto snap = [](double v, bool up) {
      const double base = std::pow(10.0, std::floor(std::log10(v) + 1e-9));
      const double steps[] = {1, 2, 5, 10};
      if (up) {
        for (double m : steps) {
          if (base * m >= v * (1 - 1e-9)) return base * m;
        }
        return base * 10;
      }
      for (int k = 2; k >= 0; --k) {
        if (base * steps[k] <= v * (1 + 1e-9)) return base * steps[k];
      }
      return base;
    };
    a.lo = snap(a.lo, false);
    a.hi = snap(a.hi, true);
    if (!(a.hi > a.lo)) a.hi = a.lo * 2;
    const int d_lo = static_cast<int>(std::floor(std::log10(a.lo) + 1e-9));
    const int d_hi = static_cast<int>(std::floor(std::log10(a.hi) + 1e-9));
    const bool label_125 = std::log10(a.hi / a.lo) <= 3.0 + 1e-9;
    for (int d = d_lo; d <= d_hi; ++d) {
      const double base = std::pow(10.0, d);
      for (int m = 1; m <= 9; ++m) {
        const double v = base * m;
        if (v < a.lo * (1 - 1e-9) || v > a.hi * (1 + 1e-9)) continue;
        const bool at_end = std::abs(v / a.lo - 1) < 1e-9 || std::abs(v / a.hi - 1) < 1e-9;
        const bool labelled = m == 1 || at_end || (label_125 && (m == 2 || m == 5));
        std::string label;
        if (labelled) {
          label = a.format == tick_format::duration ? format_duration(v)
                                                    : trim_zeros(printf_string("%g", v));
        }
        ticks.push_back({v, label});
      }
    }
    return ticks;
  }
  double scale = 1;
  if (a.format == tick_format::duration) {
    const auto [s, unit] = duration_unit(a.hi);
    scale = s;
    a.title += std::string(" (") + unit + ")";
  }
  if (a.format == tick_format::fraction) {
    a.lo = 0;
    a.hi = 1;
    for (int i = 0; i <= 4; ++i) ticks.push_back({i * 0.25, printf_string("%d%%", i * 25)});
    return ticks;
  }
  double lo = a.lo * scale, hi = a.hi * scale;
  if (!(hi > lo)) hi = lo + (lo == 0 ? 1 : std::abs(lo) * 0.1);
  const double step = nice_number((hi - lo) / 5.0);
  lo = std::floor(lo / step + 1e-9) * step;
  hi = std::ceil(hi / step - 1e-9) * step;
  a.lo = lo / scale;
  a.hi = hi / scale;
  const int decimals = std::max(0, -static_cast<int>(std::floor(std::log10(step) + 1e-9)));
  for (double v = lo; v <= hi + step * 1e-6; v += step) {
    const double shown = std::abs(v) < step * 1e-9 ? 0.0 : v;
    ticks.push_back({shown / scale, printf_string("%.*f", decimals, shown)});
  }
  return ticks;
}

// ---------------------------------------------------------------------------- svg plot

struct plot_line {
  std::string color;
  bool dashed = false;
  double width = 2.0;
  std::vector<std::pair<double, double>> points;  // a NaN y breaks the line
};

struct plot_marker {
  double x;
  std::string label;
};

struct plot_guide {
  double y;
  std::string label;
};

struct legend_entry {
  std::string label;
  std::string color;
  bool dashed = false;
};

class svg_plot {
 public:
  svg_plot(std::string title, axis_spec x, axis_spec y)
      : title_(std::move(title)), x_(std::move(x)), y_(std::move(y)) {}

  std::vector<plot_line> lines;
  std::vector<plot_marker> markers;  // vertical dashed lines (SLOs)
  std::vector<plot_guide> guides;    // horizontal dotted lines (P90, P99)
  std::vector<legend_entry> legend;
  std::string note;  // small grey text under the title

  [[nodiscard]] std::string render(size_t id) {
    const auto xt = finalize_axis(x_);
    const auto yt = finalize_axis(y_);
    std::string s;
    s += printf_string(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 %d %d\" role=\"img\" "
        "aria-label=\"%s\" font-family=\"system-ui, -apple-system, 'Segoe UI', Roboto, "
        "'DejaVu Sans', sans-serif\">\n",
        width_, height_, html_escape(title_).c_str());
    s += printf_string("<rect width=\"%d\" height=\"%d\" fill=\"#fff\"/>\n", width_, height_);
    s += printf_string(
        "<text x=\"%d\" y=\"24\" font-size=\"16\" font-weight=\"600\" fill=\"#111\">%s</text>\n",
        left_, html_escape(title_).c_str());
    double y_cursor = 30;
    if (!note.empty()) {
      s += printf_string("<text x=\"%d\" y=\"42\" font-size=\"11.5\" fill=\"#666\">%s</text>\n",
                         left_, html_escape(note).c_str());
      y_cursor = 46;
    }
    // Legend: a wrapped row of "line sample + label" items above the plot area.
    double lx = left_;
    double ly = y_cursor + 12;
    int rows = legend.empty() ? 0 : 1;
    for (const auto& e : legend) {
      const double w = 28 + 7.0 * static_cast<double>(e.label.size()) + 18;
      if (lx + w > width_ - right_ && lx > left_) {
        lx = left_;
        ly += 18;
        ++rows;
      }
      s += printf_string(
          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
          "stroke-width=\"2.5\"%s/>\n",
          lx, ly - 4, lx + 22, ly - 4, e.color.c_str(),
          e.dashed ? " stroke-dasharray=\"6 4\"" : "");
      s += printf_string("<text x=\"%.1f\" y=\"%.1f\" font-size=\"12.5\" fill=\"#222\">%s</text>\n",
                         lx + 28, ly, html_escape(e.label).c_str());
      lx += w;
    }
    top_ = y_cursor + 14 + rows * 18;
    const double bottom = height_ - bottom_;
    const double right = width_ - right_;
    s += printf_string(
        "<clipPath id=\"clip%zu\"><rect x=\"%d\" y=\"%.1f\" width=\"%.1f\" "
        "height=\"%.1f\"/></clipPath>\n",
        id, left_, top_ - 2, right - left_ + 2, bottom - top_ + 4);
    // Grid and tick labels.
    for (const auto& t : xt) {
      const double px = map_x(t.value);
      s += printf_string("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\"/>\n",
                         px, top_, px, bottom, t.label.empty() ? "#f3f3f3" : "#e2e2e2");
      if (!t.label.empty()) {
        s += printf_string(
            "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11.5\" fill=\"#444\" "
            "text-anchor=\"middle\">%s</text>\n",
            px, bottom + 17, html_escape(t.label).c_str());
      }
    }
    for (const auto& t : yt) {
      const double py = map_y(t.value);
      s += printf_string("<line x1=\"%d\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\"/>\n",
                         left_, py, right, py, t.label.empty() ? "#f3f3f3" : "#e2e2e2");
      if (!t.label.empty()) {
        s += printf_string(
            "<text x=\"%d\" y=\"%.1f\" font-size=\"11.5\" fill=\"#444\" "
            "text-anchor=\"end\" dominant-baseline=\"middle\">%s</text>\n",
            left_ - 7, py, html_escape(t.label).c_str());
      }
    }
    for (const auto& g : guides) {
      const double py = map_y(g.y);
      s += printf_string(
          "<line x1=\"%d\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#999\" "
          "stroke-dasharray=\"2 3\"/>\n",
          left_, py, right, py);
      s += printf_string(
          "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" fill=\"#777\" "
          "text-anchor=\"end\">%s</text>\n",
          right - 3, py - 3, html_escape(g.label).c_str());
    }
    // Axes.
    s += printf_string("<line x1=\"%d\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>\n",
                       left_, bottom, right, bottom);
    s += printf_string("<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#333\"/>\n",
                       left_, top_, left_, bottom);
    s += printf_string(
        "<text x=\"%.1f\" y=\"%d\" font-size=\"12.5\" fill=\"#222\" "
        "text-anchor=\"middle\">%s</text>\n",
        (left_ + right) / 2.0, height_ - 10, html_escape(x_.title).c_str());
    s += printf_string(
        "<text transform=\"translate(16 %.1f) rotate(-90)\" font-size=\"12.5\" "
        "fill=\"#222\" text-anchor=\"middle\">%s</text>\n",
        (top_ + bottom) / 2.0, html_escape(y_.title).c_str());
    // Data.
    bool any = false;
    s += printf_string("<g clip-path=\"url(#clip%zu)\" fill=\"none\" stroke-linejoin=\"round\">\n",
                       id);
    for (const auto& line : lines) {
      std::string pts;
      auto flush = [&] {
        if (pts.empty()) return;
        s += printf_string("<polyline stroke=\"%s\" stroke-width=\"%.1f\"%s points=\"",
                           line.color.c_str(), line.width,
                           line.dashed ? " stroke-dasharray=\"7 4\"" : "");
        s += pts;
        s += "\"/>\n";
        pts.clear();
      };
      size_t in_segment = 0;
      for (const auto& [x, y] : line.points) {
        if (std::isnan(x) || std::isnan(y)) {
          if (in_segment == 1) pts += printf_string("%.1f,%.1f ", last_px_ + 0.1, last_py_);
          flush();
          in_segment = 0;
          continue;
        }
        last_px_ = map_x(x);
        last_py_ = map_y(y);
        pts += printf_string("%.1f,%.1f ", last_px_, last_py_);
        ++in_segment;
        any = true;
      }
      // A lone point would be invisible as a polyline: give it a short tail.
      if (in_segment == 1) pts += printf_string("%.1f,%.1f ", last_px_ + 0.1, last_py_);
      flush();
    }
    for (const auto& m : markers) {
      const double px = map_x(m.x);
      s += printf_string(
          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#B00020\" "
          "stroke-width=\"1.5\" stroke-dasharray=\"5 4\"/>\n",
          px, top_, px, bottom);
      s += printf_string(
          "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" fill=\"#B00020\" "
          "stroke=\"none\">%s</text>\n",
          px + 4, top_ + 12, html_escape(m.label).c_str());
    }
    s += "</g>\n";
    if (!any) {
      s += printf_string(
          "<text x=\"%.1f\" y=\"%.1f\" font-size=\"14\" fill=\"#888\" "
          "text-anchor=\"middle\">no data</text>\n",
          (left_ + right) / 2.0, (top_ + bottom) / 2.0);
    }
    s += "</svg>\n";
    return s;
  }

 private:
  double map_x(double x) const {
    const double right = width_ - right_;
    return std::clamp(left_ + frac(x, x_) * (right - left_), -1e4, 1e4);
  }
  double map_y(double y) const {
    const double bottom = height_ - bottom_;
    return std::clamp(bottom - frac(y, y_) * (bottom - top_), -1e4, 1e4);
  }
  static double frac(double v, const axis_spec& a) {
    if (a.log) {
      v = std::max(v, a.lo);
      return (std::log10(v) - std::log10(a.lo)) / (std::log10(a.hi) - std::log10(a.lo));
    }
    return (v - a.lo) / (a.hi - a.lo);
  }

  std::string title_;
  axis_spec x_;
  axis_spec y_;
  int width_ = 640;
  int height_ = 400;
  int left_ = 70;
  int right_ = 30;
  int bottom_ = 48;
  double top_ = 60;
  double last_px_ = 0;
  double last_py_ = 0;
};

// ---------------------------------------------------------------------------- data prep

struct run_samples {
  std::vector<double> ttft, tpot, itl, e2e;  // sorted, completed requests only
};

run_samples collect_samples(const report_run& run) {
  run_samples s;
  for (const auto& r : run.records) {
    if (!r.succeeded()) continue;
    s.e2e.push_back(r.e2e_s());
    if (const auto t = r.ttft_s()) s.ttft.push_back(*t);
    if (const auto t = r.tpot_s()) s.tpot.push_back(*t);
    s.itl.insert(s.itl.end(), r.itl_s.begin(), r.itl_s.end());
  }
  for (auto* v : {&s.ttft, &s.tpot, &s.itl, &s.e2e}) {
    std::erase_if(*v, [](double x) { return !std::isfinite(x); });
    std::sort(v->begin(), v->end());
  }
  return s;
}

/// The empirical CDF, thinned to about 500 points (a staircase for small sets).
std::vector<std::pair<double, double>> cdf_points(const std::vector<double>& sorted) {
  std::vector<std::pair<double, double>> pts;
  const size_t n = sorted.size();
  if (n == 0) return pts;
  const double dn = static_cast<double>(n);
  if (n <= 300) {
    pts.emplace_back(sorted[0], 0.0);
    for (size_t i = 0; i < n; ++i) {
      if (i > 0) pts.emplace_back(sorted[i], static_cast<double>(i) / dn);
      pts.emplace_back(sorted[i], static_cast<double>(i + 1) / dn);
    }
    return pts;
  }
  constexpr size_t m = 500;
  pts.emplace_back(sorted[0], 0.0);
  for (size_t j = 0; j <= m; ++j) {
    const size_t idx =
        static_cast<size_t>(std::llround(static_cast<double>(j) * static_cast<double>(n - 1) / m));
    pts.emplace_back(sorted[idx], static_cast<double>(idx + 1) / dn);
  }
  return pts;
}

/// x axis of a latency CDF over every run's samples: log when the spread is wide.
axis_spec latency_axis(const std::vector<const std::vector<double>*>& sets, double slo,
                       std::string title) {
  axis_spec a;
  a.format = tick_format::duration;
  a.title = std::move(title);
  double mx = 0, lo_ref = inf, min_pos = inf;
  for (const auto* v : sets) {
    if (v->empty()) continue;
    mx = std::max(mx, v->back());
    const auto first_pos = std::upper_bound(v->begin(), v->end(), 0.0);
    if (first_pos != v->end()) min_pos = std::min(min_pos, *first_pos);
    const double p1 = percentile_sorted(*v, 1);
    lo_ref = std::min(lo_ref, p1 > 0 ? p1 : (first_pos != v->end() ? *first_pos : inf));
  }
  if (std::isfinite(slo)) mx = std::max(mx, slo * 1.05);
  if (!(mx > 0)) {
    a.lo = 0;
    a.hi = 1e-3;
    return a;
  }
  if (std::isfinite(lo_ref) && mx / lo_ref > 20) {
    a.log = true;
    a.lo = std::max(min_pos, mx / 1e6);
    a.hi = mx;
  } else {
    a.lo = 0;
    a.hi = mx;
  }
  return a;
}

double nice_bin(double duration_s, const report_options& options) {
  if (options.time_bin_s > 0) return options.time_bin_s;
  if (!(duration_s > 0)) return 1.0;
  return nice_number(duration_s / 60.0);
}

/// P50 and P99 of the values falling in each time bin (NaN where a bin is empty).
std::pair<std::vector<std::pair<double, double>>, std::vector<std::pair<double, double>>>
binned_p50_p99(std::vector<std::vector<double>>& bins, double bin_s) {
  std::vector<std::pair<double, double>> p50, p99;
  for (size_t i = 0; i < bins.size(); ++i) {
    const double x = (static_cast<double>(i) + 0.5) * bin_s;
    auto& b = bins[i];
    if (b.empty()) {
      p50.emplace_back(x, nan);
      p99.emplace_back(x, nan);
      continue;
    }
    std::sort(b.begin(), b.end());
    p50.emplace_back(x, percentile_sorted(b, 50));
    p99.emplace_back(x, percentile_sorted(b, 99));
  }
  return {std::move(p50), std::move(p99)};
}

/// Keeps at most about 2·columns points: the first, min and max of each x column, the last.
std::vector<std::pair<double, double>> decimate(const time_series& ts, double t0, size_t columns) {
  std::vector<std::pair<double, double>> pts;
  const size_t n = std::min(ts.t_s.size(), ts.values.size());
  if (n <= 2 * columns) {
    for (size_t i = 0; i < n; ++i) pts.emplace_back(ts.t_s[i] - t0, ts.values[i]);
    return pts;
  }
  const double lo = ts.t_s.front(), hi = ts.t_s[n - 1];
  const double w = (hi - lo) / static_cast<double>(columns);
  size_t i = 0;
  while (i < n) {
    const auto col = static_cast<size_t>(w > 0 ? (ts.t_s[i] - lo) / w : 0);
    size_t i_min = i, i_max = i, j = i;
    while (j < n && static_cast<size_t>(w > 0 ? (ts.t_s[j] - lo) / w : 0) == col) {
      if (ts.values[j] < ts.values[i_min]) i_min = j;
      if (ts.values[j] > ts.values[i_max]) i_max = j;
      ++j;
    }
    const size_t a = std::min(i_min, i_max), b = std::max(i_min, i_max);
    pts.emplace_back(ts.t_s[a] - t0, ts.values[a]);
    if (b != a) pts.emplace_back(ts.t_s[b] - t0, ts.values[b]);
    i = j;
  }
  if (pts.back().first != ts.t_s[n - 1] - t0)
    pts.emplace_back(ts.t_s[n - 1] - t0, ts.values[n - 1]);
  return pts;
}

/// Each run's time zero: its first arrival, or its first series sample if earlier.
double run_t0(const report_run& run) {
  double t0 = inf;
  for (const auto& r : run.records) t0 = std::min(t0, r.arrival_s);
  for (const auto& ts : run.series) {
    if (!ts.t_s.empty()) t0 = std::min(t0, ts.t_s.front());
  }
  return std::isfinite(t0) ? t0 : 0.0;
}

double run_end(const report_run& run, double t0) {
  double end = 0;
  for (const auto& r : run.records) {
    end = std::max(end, r.finish_s - t0);
    if (r.first_token_s) end = std::max(end, *r.first_token_s - t0);
  }
  for (const auto& ts : run.series) {
    if (!ts.t_s.empty()) end = std::max(end, ts.t_s.back() - t0);
  }
  return end;
}

std::vector<std::string> series_names(std::span<const report_run> runs) {
  std::vector<std::string> names;
  for (const auto& run : runs) {
    for (const auto& ts : run.series) {
      if (std::find(names.begin(), names.end(), ts.name) == names.end()) names.push_back(ts.name);
    }
  }
  return names;
}

const latency_slo& first_slo(std::span<const report_run> runs) {
  static const latency_slo none{};
  for (const auto& run : runs) {
    if (run.summary.slo.limits_anything()) return run.summary.slo;
  }
  return none;
}

std::vector<legend_entry> run_legend(std::span<const report_run> runs) {
  std::vector<legend_entry> legend;
  for (size_t i = 0; i < runs.size(); ++i) legend.push_back({runs[i].name, run_color(i), false});
  return legend;
}

// ---------------------------------------------------------------------------- html pieces

constexpr std::string_view page_css = R"css(
:root { color-scheme: light; }
body { margin: 0; padding: 24px 32px 48px; background: #f6f7f9; color: #1a1a1a;
       font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 32px 0 12px; }
.sub { color: #555; margin: 0 0 4px; }
.note { color: #666; font-size: 12.5px; max-width: 1100px; }
table { border-collapse: collapse; background: #fff; box-shadow: 0 1px 2px rgba(0,0,0,.08); }
th, td { padding: 5px 14px; border-bottom: 1px solid #e6e6e6; text-align: right;
         font-variant-numeric: tabular-nums; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; color: #333; }
thead th { background: #eef1f5; font-weight: 600; }
h3 { font-size: 15px; margin: 22px 0 8px; }
tbody.metric th { text-align: left; vertical-align: top; background: #fafbfc; font-weight: 600;
                  border-right: 1px solid #e6e6e6; }
tbody.metric tr:last-child td, tbody.metric tr:last-child th { border-bottom: 2px solid #cfd5dd; }
td.best { font-weight: 700; }
.scroll { overflow-x: auto; max-width: 100%; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px;
          margin-right: 6px; vertical-align: -1px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 16px; }
figure { margin: 0; background: #fff; padding: 8px; box-shadow: 0 1px 2px rgba(0,0,0,.08); }
figure svg { display: block; width: 100%; height: auto; }
)css";

std::string swatch(size_t run_index) {
  return "<span class=\"swatch\" style=\"background:" + run_color(run_index) + "\"></span>";
}

/// One <td> per run value of a column, the best one bold when there are several runs.
/// better: -1 lower is better, +1 higher is better, 0 no highlight. NaN prints "-".
std::vector<std::string> column_cells(const std::vector<double>& values,
                                      std::string (*format)(double), int better) {
  double best = better < 0 ? inf : -inf;
  for (double v : values) {
    if (!std::isnan(v)) best = better < 0 ? std::min(best, v) : std::max(best, v);
  }
  std::vector<std::string> cells;
  for (double v : values) {
    const bool is_best = better != 0 && values.size() > 1 && !std::isnan(v) && v == best;
    cells.push_back(std::string(is_best ? "<td class=\"best\">" : "<td>") +
                    (std::isnan(v) ? std::string("-") : format(v)) + "</td>");
  }
  return cells;
}

std::string fmt_count(double v) {
  return printf_string("%.0f", v);
}
std::string fmt_2f(double v) {
  return printf_string("%.2f", v);
}
std::string fmt_1f(double v) {
  return printf_string("%.1f", v);
}
std::string fmt_pct(double v) {
  return printf_string("%.1f%%", 100.0 * v);
}
std::string fmt_ms(double v) {
  return format_ms(v);
}

/// Two tables: requests and throughput (one row per run), then latency (one block of rows
/// per metric, one row per run, percentiles across).
std::string summary_table_html(std::span<const report_run> runs) {
  using column =
      std::tuple<const char*, double (*)(const latency_summary&), std::string (*)(double), int>;
  const column request_columns[] = {
      {"completed", [](const latency_summary& s) { return double(s.completed); }, fmt_count, 0},
      {"failed", [](const latency_summary& s) { return double(s.failed); }, fmt_count, -1},
      {"duration (s)", [](const latency_summary& s) { return s.duration_s; }, fmt_2f, 0},
      {"throughput (req/s)", [](const latency_summary& s) { return s.request_throughput; }, fmt_2f,
       1},
      {"output tokens/s", [](const latency_summary& s) { return s.output_token_throughput; },
       fmt_1f, 1},
      {"goodput (req/s)", [](const latency_summary& s) { return s.goodput; }, fmt_2f, 1},
      {"SLO attainment", [](const latency_summary& s) { return s.slo_attainment; }, fmt_pct, 1}};
  std::string h = "<div class=\"scroll\"><table>\n<thead><tr><th>run</th>";
  for (const auto& c : request_columns) h += "<th>" + std::string(std::get<0>(c)) + "</th>";
  h += "</tr></thead>\n<tbody>\n";
  std::vector<std::vector<std::string>> cells;  // [column][run]
  for (const auto& [title, get, format, better] : request_columns) {
    std::vector<double> v;
    for (const auto& run : runs) v.push_back(get(run.summary));
    cells.push_back(column_cells(v, format, better));
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    h += "<tr><td>" + swatch(i) + html_escape(runs[i].name) + "</td>";
    for (const auto& column_cells : cells) h += column_cells[i];
    h += "</tr>\n";
  }
  h += "</tbody>\n</table></div>\n";

  h += "<h3>Latency (ms)</h3>\n<div "
       "class=\"scroll\"><table>\n<thead><tr><th>metric</th><th>run</th><th>mean</th>"
       "<th>P50</th><th>P90</th><th>P99</th><th>max</th><th>samples</th></tr></thead>\n";
  const std::pair<const char*, percentile_summary latency_summary::*> metrics[] = {
      {"TTFT", &latency_summary::ttft_s},
      {"TPOT", &latency_summary::tpot_s},
      {"ITL", &latency_summary::itl_s},
      {"E2E", &latency_summary::e2e_s}};
  const double percentile_summary::*stats[] = {&percentile_summary::mean, &percentile_summary::p50,
                                               &percentile_summary::p90, &percentile_summary::p99,
                                               &percentile_summary::max};
  for (const auto& [metric, member] : metrics) {
    h += "<tbody class=\"metric\">\n";
    cells.clear();
    for (const auto field : stats) {
      std::vector<double> v;
      for (const auto& run : runs) {
        const percentile_summary& p = run.summary.*member;
        v.push_back(p.count == 0 ? nan : p.*field);
      }
      cells.push_back(column_cells(v, fmt_ms, -1));
    }
    for (size_t i = 0; i < runs.size(); ++i) {
      h += "<tr>";
      if (i == 0) {
        h += "<th scope=\"rowgroup\" rowspan=\"" + std::to_string(runs.size()) + "\">" + metric +
             "</th>";
      }
      h += "<td>" + swatch(i) + html_escape(runs[i].name) + "</td>";
      for (const auto& column_cells : cells) h += column_cells[i];
      h += "<td>" + std::to_string((runs[i].summary.*member).count) + "</td></tr>\n";
    }
    h += "</tbody>\n";
  }
  h += "</table></div>\n";
  return h;
}

std::string slo_text(const latency_slo& slo) {
  std::string p;
  if (std::isfinite(slo.ttft_s)) p += "TTFT \u2264 " + format_duration(slo.ttft_s);
  if (std::isfinite(slo.tpot_s)) {
    if (!p.empty()) p += " and ";
    p += "TPOT \u2264 " + format_duration(slo.tpot_s);
  }
  return p.empty() ? "none (every completed request counts)" : p;
}

std::string outcomes_text(std::span<const report_run> runs) {
  std::string out;
  for (const auto& run : runs) {
    std::string fails;
    for (const auto& [outcome, n] : run.summary.outcomes) {
      if (outcome == request_outcome_ok) continue;
      if (!fails.empty()) fails += ", ";
      fails += outcome + " " + std::to_string(n);
    }
    if (fails.empty()) continue;
    if (!out.empty()) out += "; ";
    out += run.name + ": " + fails;
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------- public

report_run make_report_run(std::string name, std::vector<request_record> records,
                           const latency_slo& slo, std::vector<time_series> series) {
  report_run run;
  run.name = std::move(name);
  run.records = std::move(records);
  run.summary = summarize(run.records, slo);
  run.series = std::move(series);
  return run;
}

std::vector<std::string> report_plot_titles(std::span<const report_run> runs) {
  std::vector<std::string> titles = {"TTFT CDF",
                                     "TPOT CDF",
                                     "ITL CDF",
                                     "E2E latency CDF",
                                     "TTFT over time",
                                     "ITL over time",
                                     "Request rate over time"};
  for (auto& name : series_names(runs)) titles.push_back(std::move(name));
  return titles;
}

std::string render_report_html(std::span<const report_run> runs, const report_options& options) {
  const auto titles = report_plot_titles(runs);
  std::vector<run_samples> samples;
  samples.reserve(runs.size());
  for (const auto& run : runs) samples.push_back(collect_samples(run));
  const latency_slo& slo = first_slo(runs);
  size_t plot_id = 0;

  std::string h;
  h += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
       "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
  h += "<title>" + html_escape(options.title) + "</title>\n<style>" + std::string(page_css) +
       "</style>\n</head>\n<body>\n";
  h += "<header><h1>" + html_escape(options.title) + "</h1>\n";
  if (!options.subtitle.empty())
    h += "<p class=\"sub\">" + html_escape(options.subtitle) + "</p>\n";
  h += "<p class=\"sub\">" + std::to_string(runs.size()) + (runs.size() == 1 ? " run" : " runs") +
       " \u00b7 SLO: " + html_escape(slo_text(slo)) + " \u00b7 generated by duet " +
       std::string(version_string) + "</p></header>\n";

  // Summary.
  h += "<section>\n<h2>Summary</h2>\n" + summary_table_html(runs);
  const std::string fails = outcomes_text(runs);
  h += "<p class=\"note\">Latency percentiles cover completed requests and interpolate "
       "linearly between closest ranks. TTFT = first token \u2212 arrival; TPOT = (E2E \u2212 "
       "TTFT) / (output tokens \u2212 1) per request; ITL = every gap between consecutive "
       "tokens; goodput = completed requests meeting the SLO per second; SLO attainment counts "
       "failed requests as misses. The best run per column is in bold.";
  if (!fails.empty()) h += " Failures: " + html_escape(fails) + ".";
  h += "</p>\n</section>\n";

  // Latency CDFs.
  h += "<section>\n<h2>Latency distributions</h2>\n<div class=\"grid\">\n";
  const std::tuple<std::vector<double> run_samples::*, const char*, double> cdfs[] = {
      {&run_samples::ttft, "time to first token", slo.ttft_s},
      {&run_samples::tpot, "time per output token", slo.tpot_s},
      {&run_samples::itl, "inter-token latency", inf},
      {&run_samples::e2e, "end-to-end latency", inf}};
  for (size_t k = 0; k < std::size(cdfs); ++k) {
    const auto& [member, x_title, limit] = cdfs[k];
    std::vector<const std::vector<double>*> sets;
    for (const auto& s : samples) sets.push_back(&(s.*member));
    axis_spec y;
    y.format = tick_format::fraction;
    y.title = "fraction of samples \u2264 x";
    svg_plot plot(titles[k], latency_axis(sets, limit, x_title), y);
    plot.legend = run_legend(runs);
    plot.guides = {{0.9, "P90"}, {0.99, "P99"}};
    if (std::isfinite(limit)) plot.markers.push_back({limit, "SLO " + format_duration(limit)});
    for (size_t i = 0; i < runs.size(); ++i) {
      plot.lines.push_back({run_color(i), false, 2.0, cdf_points(*sets[i])});
    }
    h += "<figure>\n" + plot.render(plot_id++) + "</figure>\n";
  }
  h += "</div>\n</section>\n";

  // Over time.
  std::vector<double> t0s;
  double t_end = 0;
  for (const auto& run : runs) {
    t0s.push_back(run_t0(run));
    t_end = std::max(t_end, run_end(run, t0s.back()));
  }
  const double bin_s = nice_bin(t_end, options);
  const size_t n_bins = static_cast<size_t>(std::floor(t_end / bin_s)) + 1;
  const std::string bin_note = "per " + format_duration(bin_s) + " bin";
  auto bin_of = [&](double t) {
    return std::min(n_bins - 1, static_cast<size_t>(std::max(0.0, std::floor(t / bin_s))));
  };
  axis_spec time_axis;
  time_axis.lo = 0;
  time_axis.hi = std::max(t_end, bin_s);
  time_axis.title = "time since start (s)";
  std::vector<legend_entry> p_legend = run_legend(runs);
  p_legend.push_back({"P99", "#777", false});
  p_legend.push_back({"P50", "#777", true});

  h += "<section>\n<h2>Over time</h2>\n<div class=\"grid\">\n";
  for (int which = 0; which < 2; ++which) {  // 0: TTFT by arrival, 1: ITL by token time
    axis_spec y;
    y.format = tick_format::duration;
    y.title = which == 0 ? "TTFT" : "ITL";
    y.lo = 0;
    y.hi = 0;
    std::vector<plot_line> lines;
    for (size_t i = 0; i < runs.size(); ++i) {
      std::vector<std::vector<double>> bins(n_bins);
      for (const auto& r : runs[i].records) {
        if (!r.succeeded() || !r.first_token_s) continue;
        if (which == 0) {
          bins[bin_of(r.arrival_s - t0s[i])].push_back(*r.ttft_s());
        } else {
          double t = *r.first_token_s;
          for (double gap : r.itl_s) {
            t += gap;
            bins[bin_of(t - t0s[i])].push_back(gap);
          }
        }
      }
      auto [p50, p99] = binned_p50_p99(bins, bin_s);
      for (const auto& [x, v] : p99) {
        if (std::isfinite(v)) y.hi = std::max(y.hi, v);
      }
      lines.push_back({run_color(i), false, 2.0, std::move(p99)});
      lines.push_back({run_color(i), true, 1.5, std::move(p50)});
    }
    if (which == 0 && std::isfinite(slo.ttft_s)) y.hi = std::max(y.hi, slo.ttft_s);
    if (!(y.hi > 0)) y.hi = 1e-3;
    svg_plot plot(titles[4 + which], time_axis, y);
    plot.note = (which == 0 ? "TTFT by arrival time, " : "ITL by token time, ") + bin_note;
    plot.legend = p_legend;
    plot.lines = std::move(lines);
    if (which == 0 && std::isfinite(slo.ttft_s)) {
      // A horizontal SLO line reads better here than a marker; draw it as a guide.
      plot.guides.push_back({slo.ttft_s, "SLO " + format_duration(slo.ttft_s)});
    }
    h += "<figure>\n" + plot.render(plot_id++) + "</figure>\n";
  }
  {
    axis_spec y;
    y.title = "requests / s";
    y.lo = 0;
    y.hi = 0;
    std::vector<plot_line> lines;
    for (size_t i = 0; i < runs.size(); ++i) {
      std::vector<double> arrivals(n_bins, 0), completions(n_bins, 0);
      for (const auto& r : runs[i].records) {
        arrivals[bin_of(r.arrival_s - t0s[i])] += 1;
        if (r.succeeded()) completions[bin_of(r.finish_s - t0s[i])] += 1;
      }
      plot_line a{run_color(i), false, 2.0, {}}, c{run_color(i), true, 1.5, {}};
      for (size_t b = 0; b < n_bins; ++b) {
        const double x = (static_cast<double>(b) + 0.5) * bin_s;
        a.points.emplace_back(x, arrivals[b] / bin_s);
        c.points.emplace_back(x, completions[b] / bin_s);
        y.hi = std::max({y.hi, arrivals[b] / bin_s, completions[b] / bin_s});
      }
      lines.push_back(std::move(a));
      lines.push_back(std::move(c));
    }
    if (!(y.hi > 0)) y.hi = 1;
    svg_plot plot(titles[6], time_axis, y);
    plot.note = "arrivals and completions " + bin_note;
    plot.legend = run_legend(runs);
    plot.legend.push_back({"arrivals", "#777", false});
    plot.legend.push_back({"completions", "#777", true});
    plot.lines = std::move(lines);
    h += "<figure>\n" + plot.render(plot_id++) + "</figure>\n";
  }
  h += "</div>\n</section>\n";

  // Named time series.
  const auto names = series_names(runs);
  if (!names.empty()) {
    h += "<section>\n<h2>Deployment time series</h2>\n<div class=\"grid\">\n";
    for (size_t k = 0; k < names.size(); ++k) {
      axis_spec y;
      y.lo = inf;
      y.hi = -inf;
      std::vector<plot_line> lines;
      std::vector<legend_entry> legend;
      for (size_t i = 0; i < runs.size(); ++i) {
        bool present = false;
        for (const auto& ts : runs[i].series) {
          if (ts.name != names[k]) continue;
          if (y.title.empty()) y.title = ts.unit;
          present = true;
          auto pts = decimate(ts, t0s[i], 600);
          for (const auto& [x, v] : pts) {
            if (!std::isfinite(v)) continue;
            y.lo = std::min(y.lo, v);
            y.hi = std::max(y.hi, v);
          }
          lines.push_back({run_color(i), false, 1.8, std::move(pts)});
        }
        if (present) legend.push_back({runs[i].name, run_color(i), false});
      }
      if (!std::isfinite(y.lo)) {
        y.lo = 0;
        y.hi = 1;
      }
      y.lo = std::min(y.lo, 0.0);
      if (!(y.hi > y.lo)) y.hi = y.lo + 1;
      svg_plot plot(titles[7 + k], time_axis, y);
      plot.legend = std::move(legend);
      plot.lines = std::move(lines);
      h += "<figure>\n" + plot.render(plot_id++) + "</figure>\n";
    }
    h += "</div>\n</section>\n";
  }
  h += "</body>\n</html>\n";
  return h;
}

nlohmann::json report_summary_json(std::span<const report_run> runs,
                                   const report_options& options) {
  nlohmann::json j;
  j["title"] = options.title;
  j["subtitle"] = options.subtitle;
  j["generator"] = "duet " + std::string(version_string);
  j["runs"] = nlohmann::json::array();
  for (const auto& run : runs) {
    nlohmann::json r;
    r["name"] = run.name;
    r["summary"] = to_json(run.summary);
    r["series"] = nlohmann::json::array();
    for (const auto& ts : run.series) {
      const size_t n = std::min(ts.t_s.size(), ts.values.size());
      double sum = 0, mx = -inf;
      for (size_t i = 0; i < n; ++i) {
        sum += ts.values[i];
        mx = std::max(mx, ts.values[i]);
      }
      nlohmann::json s = {{"name", ts.name}, {"unit", ts.unit}, {"points", n}};
      s["mean"] = n ? nlohmann::json(sum / static_cast<double>(n)) : nlohmann::json(nullptr);
      s["max"] = n ? nlohmann::json(mx) : nlohmann::json(nullptr);
      s["last"] = n ? nlohmann::json(ts.values[n - 1]) : nlohmann::json(nullptr);
      r["series"].push_back(std::move(s));
    }
    j["runs"].push_back(std::move(r));
  }
  return j;
}

void write_requests_csv(std::ostream& out, std::span<const report_run> runs) {
  out << "run,id,arrival_s,first_token_s,finish_s,ttft_s,tpot_s,e2e_s,prompt_tokens,"
         "output_tokens,itl_count,itl_mean_s,itl_max_s,outcome,meets_slo,itl_us\n";
  for (const auto& run : runs) {
    const std::string name = csv_field(run.name);
    for (const auto& r : run.records) {
      out << name << ',' << r.id << ',' << exact(r.arrival_s) << ',';
      if (r.first_token_s) out << exact(*r.first_token_s);
      out << ',' << exact(r.finish_s) << ',';
      if (const auto t = r.ttft_s()) out << exact(*t);
      out << ',';
      if (const auto t = r.tpot_s()) out << exact(*t);
      out << ',' << exact(r.e2e_s()) << ',' << r.prompt_tokens << ',' << r.output_tokens << ','
          << r.itl_s.size() << ',';
      if (!r.itl_s.empty()) {
        double sum = 0, mx = -inf;
        for (double g : r.itl_s) {
          sum += g;
          mx = std::max(mx, g);
        }
        out << exact(sum / static_cast<double>(r.itl_s.size())) << ',' << exact(mx);
      } else {
        out << ',';
      }
      out << ',' << csv_field(r.outcome) << ',' << (meets_slo(r, run.summary.slo) ? 1 : 0) << ',';
      // Every gap, so a distribution can be studied beyond the summary's percentiles.
      for (std::size_t i = 0; i < r.itl_s.size(); ++i) {
        out << (i ? " " : "") << std::llround(r.itl_s[i] * 1e6);
      }
      out << '\n';
    }
  }
}

namespace {

void write_file(const std::filesystem::path& path, const auto& writer) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw report_error(path.string() + ": cannot open for writing");
  writer(out);
  out.flush();
  if (!out) throw report_error(path.string() + ": write failed");
}

}  // namespace

report_files write_report(const std::filesystem::path& dir, std::span<const report_run> runs,
                          const report_options& options) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw report_error(dir.string() + ": cannot create directory: " + ec.message());
  report_files files;
  files.summary_json = dir / "summary.json";
  files.requests_csv = dir / "requests.csv";
  files.report_html = dir / "report.html";
  files.plots = report_plot_titles(runs).size();
  write_file(files.summary_json,
             [&](std::ostream& out) { out << report_summary_json(runs, options).dump(2) << '\n'; });
  write_file(files.requests_csv, [&](std::ostream& out) { write_requests_csv(out, runs); });
  write_file(files.report_html,
             [&](std::ostream& out) { out << render_report_html(runs, options); });
  return files;
}

}  // namespace duet
