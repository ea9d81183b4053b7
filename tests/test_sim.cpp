// The discrete-event simulator (`duet sim`), its cost model inputs (GPU specs, calibration
// files), deployment and trace specs, the planner (`duet plan`), and its fidelity against a
// live cluster running the sim engine.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/cluster_ready.hpp"
#include "actors/node.hpp"
#include "runtime/client.hpp"
#include "runtime/clock.hpp"
#include "runtime/config.hpp"
#include "runtime/gpu_catalog.hpp"
#include "runtime/engine_bench.hpp"
#include "runtime/model_shape.hpp"
#include "runtime/decode_buckets.hpp"
#include "runtime/sim_engine.hpp"
#include "sim/cli.hpp"
#include "sim/deployment_spec.hpp"
#include "sim/event_sim.hpp"
#include "sim/live_replay.hpp"
#include "sim/planner.hpp"
#include "sim/report.hpp"
#include "sim/trace.hpp"
#include "sim/trace_spec.hpp"
#include "tests/process_util.hpp"

namespace fs = std::filesystem;
using namespace duet;
using namespace std::chrono_literals;
using doctest::Approx;

namespace {

const fs::path shared_traces = fs::path(DUET_SOURCE_DIR) / ".." / "shared" / "traces";

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

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

fs::path scratch_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("duet-test-sim-" + std::to_string(getpid()) + "-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

/// Sets an environment variable for the scope, then restores it.
struct scoped_env {
  std::string name;
  std::optional<std::string> old;
  scoped_env(std::string n, const std::string& value) : name(std::move(n)) {
    if (const char* v = std::getenv(name.c_str())) old = v;
    setenv(name.c_str(), value.c_str(), 1);
  }
  ~scoped_env() {
    if (old)
      setenv(name.c_str(), old->c_str(), 1);
    else
      unsetenv(name.c_str());
  }
};

trace_request request_at(double t, uint32_t in, uint32_t out) {
  trace_request r;
  r.arrival_s = t;
  r.input_tokens = in;
  r.output_tokens = out;
  return r;
}

/// Two GPUs of `gpu`, one prefill worker and one decode worker with explicit pools.
sim_deployment one_p_one_d(const std::string& gpu, uint32_t prefill_blocks = 4096,
                           uint32_t decode_blocks = 4096,
                           kv_allocation allocation = kv_allocation::on_demand) {
  sim_deployment d;
  d.name = "1P1D";
  d.gpus = {{gpu, 0}, {gpu, 0}};
  sim_worker p;
  p.address = "gpu0/prefill";
  p.role = actor_role::prefill;
  p.gpu = 0;
  p.kv_blocks = prefill_blocks;
  sim_worker dw;
  dw.address = "gpu1/decode";
  dw.role = actor_role::decode;
  dw.gpu = 1;
  dw.kv_blocks = decode_blocks;
  dw.kv_allocation = allocation;
  d.workers = {p, dw};
  return d;
}

bool same_records(const std::vector<request_record>& a, const std::vector<request_record>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].id != b[i].id || a[i].arrival_s != b[i].arrival_s ||
        a[i].first_token_s != b[i].first_token_s || a[i].itl_s != b[i].itl_s ||
        a[i].finish_s != b[i].finish_s || a[i].outcome != b[i].outcome ||
        a[i].output_tokens != b[i].output_tokens || a[i].prompt_tokens != b[i].prompt_tokens) {
      return false;
    }
  }
  return true;
}

/// Measures how late this host wakes a sleeping thread, from construction to stop_p99_s().
class timer_noise {
 public:
  timer_noise()
      : thread_([this] {
          while (!stop_) {
            const auto t0 = steady::now();
            std::this_thread::sleep_for(2ms);
            late_.push_back(std::chrono::duration<double>(steady::now() - t0 - 2ms).count());
          }
        }) {}
  ~timer_noise() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  /// Stops measuring; the 99th percentile of the lateness, in seconds.
  double stop_p99_s() {
    stop_ = true;
    thread_.join();
    return percentile(late_, 99);
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<double> late_;
  std::thread thread_;
};

double env_number(const char* name, double fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atof(v) : fallback;
}

/// Runs `duet` with `args` and returns its exit code; -1 when it did not exit normally
/// within `timeout` (then it is killed).
int run_duet(std::vector<std::string> args, std::chrono::seconds timeout) {
  args.insert(args.begin(), testing::duet_binary());
  const pid_t pid = fork();
  if (pid == 0) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  const auto until = steady::now() + timeout;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (steady::now() > until) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(20ms);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

double relative_error(double measured, double reference) {
  return reference == 0 ? std::abs(measured) : std::abs(measured - reference) / std::abs(reference);
}

}  // namespace

// ------------------------------------------------------------------------ the event queue

TEST_CASE(
    "events come out earliest first, and events of equal time in the order they were pushed") {
  timed_queue<int> q;
  q.push(30, 1);
  q.push(10, 2);
  q.push(20, 3);
  q.push(10, 4);
  q.push(10, 5);
  std::vector<std::pair<int64_t, int>> out;
  while (!q.empty()) {
    out.push_back(q.pop());
    if (out.size() == 2) q.push(10, 6);  // equal time, pushed last: comes out after 5
  }
  const std::vector<std::pair<int64_t, int>> expected = {{10, 2}, {10, 4}, {10, 5},
                                                         {10, 6}, {20, 3}, {30, 1}};
  CHECK(out == expected);
}

TEST_CASE("the virtual clock never runs backwards, whatever is pushed while popping") {
  timed_queue<uint32_t> q;
  std::mt19937_64 rng(5);
  int64_t now = 0;
  for (uint32_t i = 0; i < 100; ++i) q.push(static_cast<int64_t>(rng() % 1000), i);
  uint32_t pushed = 100;
  while (!q.empty()) {
    const auto [t, v] = q.pop();
    REQUIRE(t >= now);
    now = t;
    if (pushed < 5000) q.push(now + static_cast<int64_t>(rng() % 50), pushed++);
  }
  CHECK(pushed == 5000);
}

// ------------------------------------------------------------------------ GPU specs

TEST_CASE("config/gpus.toml holds the same numbers as the built-in table") {
  const auto file = fs::path(DUET_SOURCE_DIR) / "config" / "gpus.toml";
  const auto specs = load_gpu_specs(file);
  REQUIRE(specs.size() == 5);
  const auto empty = scratch_dir("empty-specs") / "gpus.toml";
  std::ofstream(empty) << "# no GPUs\n";
  scoped_env env("DUET_GPU_SPECS", empty.string());
  for (const auto& s : specs) {
    CAPTURE(s.name);
    const auto builtin = find_gpu_spec(s.name);
    REQUIRE(builtin.has_value());
    CHECK(builtin->bf16_flops == s.bf16_flops);
    CHECK(builtin->memory_bandwidth == s.memory_bandwidth);
    CHECK(builtin->memory_bytes == s.memory_bytes);
    CHECK(builtin->sms == s.sms);
    CHECK(builtin->gemm_efficiency == s.gemm_efficiency);
    CHECK(builtin->bandwidth_efficiency == s.bandwidth_efficiency);
    CHECK(builtin->step_overhead_s == s.step_overhead_s);
    CHECK(builtin->nvlink_bandwidth == s.nvlink_bandwidth);
    CHECK(builtin->pcie_bandwidth == s.pcie_bandwidth);
    CHECK(builtin->nic_bandwidth == s.nic_bandwidth);
    CHECK(builtin->link_efficiency == s.link_efficiency);
    CHECK(builtin->sm_partition_min == s.sm_partition_min);
    CHECK(builtin->sm_partition_step == s.sm_partition_step);
    CHECK(s.calibration.gemm.empty());
  }
  const auto h20 = find_gpu_spec("h20");
  CHECK(h20->bf16_flops == 148e12);  // Hopper, 96 GB HBM3 at 4.0 TB/s, 900 GB/s NVLink
  CHECK(h20->memory_bandwidth == 4.0e12);
  CHECK(h20->memory_bytes == 96e9);
  CHECK(h20->nvlink_bandwidth * 2 == 900e9);
}

TEST_CASE("every calibration file the repository ships loads") {
  // A typo in a key or a curve would otherwise surface only when a run names the file.
  std::size_t files = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(DUET_SOURCE_DIR) / "config" / "calibration-duet")) {
    if (entry.path().extension() != ".toml") continue;
    CAPTURE(entry.path().string());
    CHECK_NOTHROW((void)load_gpu_calibration(entry.path()));
    ++files;
  }
  CHECK(files >= 20);
  const auto tiled = load_gpu_calibration(fs::path(DUET_SOURCE_DIR) / "config" / "calibration-duet" /
                                          "h100-cuda-engine-2026-12-06k.toml");
  CHECK(tiled.prefill_gemm_row_tile == 64u);
  CHECK_FALSE(load_gpu_calibration(fs::path(DUET_SOURCE_DIR) / "config" / "calibration-duet" /
                                   "h100-cuda-engine-2026-12-06h.toml")
                  .prefill_gemm_row_tile.has_value());
}

TEST_CASE("SM shares are priced as the SMs a green context gets: in the GPU's partition steps") {
  const auto h100 = find_gpu_spec("h100");
  REQUIRE(h100.has_value());
  REQUIRE(h100->sms == 132);
  REQUIRE(h100->sm_partition_step == 8);
  // What the H100 serving runs' partitions got (docs/data/h100-serve-2026-12-06c: 0.7 and 0.75
  // both as 96 SMs).
  for (auto [share, sms] : {std::pair{0.5, 64.0}, {0.6, 80.0}, {0.7, 96.0}, {0.75, 96.0}, {0.85, 112.0}}) {
    CAPTURE(share);
    CHECK(partition_sms(*h100, share, 132) == sms);
    CHECK(partition_share(*h100, share) == Approx(sms / 132));
  }
  CHECK(partition_sms(*h100, 0.01, 132) == 8);  // at least the smallest partition
  CHECK(partition_sms(*h100, 0.3, 36) == 36);   // beside 96 SMs, 0.3 (40) gets what is left
  CHECK(contains(error_of<std::invalid_argument>([&] { (void)partition_sms(*h100, 0.1, 4); }),
                 "only 4 SMs are left"));
  CHECK(partition_share(*h100, 1.0) == 1.0);
  // A calibration fitted on configured shares keeps them.
  gpu_spec nominal = *h100;
  nominal.calibration.nominal_sm_shares = true;
  CHECK(partition_share(nominal, 0.75) == Approx(0.75));
  CHECK(load_gpu_calibration(fs::path(DUET_SOURCE_DIR) / "config" / "calibration-duet" /
                             "h100-cuda-engine-2026-12-06h.toml")
            .nominal_sm_shares);
  CHECK_FALSE(load_gpu_calibration(fs::path(DUET_SOURCE_DIR) / "config" / "calibration-duet" /
                                   "h100-cuda-engine-2026-12-06m.toml")
                  .nominal_sm_shares);
  const auto dir = scratch_dir("partition-specs");
  std::ofstream(dir / "bad-shares.toml") << "sm_shares = \"rounded\"\n";
  CHECK(contains(error_of<gpu_catalog_error>([&] { (void)load_gpu_calibration(dir / "bad-shares.toml"); }),
                 "sm_shares"));
  std::ofstream(dir / "gpus.toml") << "[gpus.toy]\nbf16_flops = 1e12\nmemory_bandwidth = 1e12\n"
                                      "memory_bytes = 1e9\nsms = 40\nsm_partition_step = 7.5\n";
  CHECK(contains(error_of<gpu_catalog_error>([&] { (void)load_gpu_specs(dir / "gpus.toml"); }),
                 "gpus.toy.sm_partition_step"));
}

TEST_CASE("a GPU spec file adds GPUs, and a broken one is an error that names file, line and key") {
  const auto dir = scratch_dir("specs");
  std::ofstream(dir / "gpus.toml") << "[gpus.toy]\nbf16_flops = 100e12\nmemory_bandwidth = 1e12\n"
                                      "memory_bytes = 24e9\nsms = 40\nnvlink_bandwidth = 0\n";
  {
    scoped_env env("DUET_GPU_SPECS", (dir / "gpus.toml").string());
    const auto toy = find_gpu_spec("toy");
    REQUIRE(toy.has_value());
    CHECK(toy->bf16_flops == 100e12);
    CHECK(toy->gemm_efficiency == 0.7);       // the default
    CHECK(find_gpu_spec("h20").has_value());  // the built-in table still answers
  }
  std::ofstream(dir / "bad.toml") << "[gpus.toy]\nbf16_flops = 100e12\nmemory_bandwidth = 1e12\n"
                                     "memory_bytes = 24e9\nsms = 40\ngemm_efficency = 0.5\n";
  const auto message = error_of<gpu_catalog_error>([&] { (void)load_gpu_specs(dir / "bad.toml"); });
  CHECK(contains(message, "bad.toml:6"));
  CHECK(contains(message, "gpus.toy.gemm_efficency"));
  std::ofstream(dir / "over.toml") << "[gpus.toy]\nbf16_flops = 1e12\nmemory_bandwidth = 1e12\n"
                                      "memory_bytes = 1e9\nsms = 1\nbandwidth_efficiency = 1.5\n";
  CHECK(contains(error_of<gpu_catalog_error>([&] { (void)load_gpu_specs(dir / "over.toml"); }),
                 "(0, 1]"));
  std::ofstream(dir / "missing.toml") << "[gpus.toy]\nbf16_flops = 1e12\n";
  CHECK(contains(error_of<gpu_catalog_error>([&] { (void)load_gpu_specs(dir / "missing.toml"); }),
                 "gpus.toy.memory_bandwidth': is required"));
}

TEST_CASE(
    "calibration files set the fraction of peak per operation and shape, interpolated in log "
    "shape") {
  const auto dir = scratch_dir("calibration");
  std::ofstream(dir / "cal.toml")
      << "gpu = \"h20\"\nstep_overhead_s = 0\n"
         "gemm = [[1, 0.1], [100, 0.5], [10000, 0.5]]\n"
         "attention = [[128, 0.4]]\nmemory = [[1e6, 0.5], [1e10, 0.9]]\n";
  const auto cal = load_gpu_calibration(dir / "cal.toml");
  CHECK(cal.gemm.at(10, 0.7) == Approx(0.3));   // halfway between 1 and 100 in log
  CHECK(cal.gemm.at(0.5, 0.7) == Approx(0.1));  // held flat below the first point
  CHECK(cal.gemm.at(1e6, 0.7) == Approx(0.5));  // and above the last
  CHECK(cal.memory.at(1e8, 0.7) == Approx(0.7));
  CHECK(efficiency_curve{}.at(5, 0.42) == 0.42);

  auto h20 = *find_gpu_spec("h20");
  const auto shape = *find_model_shape("r1-distill-llama-8b");
  const cost_model plain(shape, h20);
  auto calibrated_gpu = h20;
  calibrated_gpu.calibration = cal;
  const cost_model calibrated(shape, calibrated_gpu);
  // Prefill of 4096 tokens is compute bound: GEMMs at 0.5 of peak instead of 0.85.
  const double linear = 2.0 * double(shape.linear_params()) * 4096;
  const double attention = plain.chunk_attention_flops(4096, 0);
  const double expected = linear / (h20.bf16_flops * 0.5) + attention / (h20.bf16_flops * 0.4);
  CHECK(calibrated.prefill_seconds(4096, attention) == Approx(expected).epsilon(1e-9));
  CHECK(plain.prefill_seconds(4096, attention) ==
        Approx((linear + attention) / (h20.bf16_flops * 0.85) + h20.step_overhead_s).epsilon(1e-9));
  // Decode of one sequence is bandwidth bound: weights + KV at the calibrated fraction.
  const double bytes = double(shape.weight_bytes()) + double(shape.kv_bytes_per_token()) * 1024;
  CHECK(calibrated.decode_seconds(1, 1024) ==
        Approx(bytes / (h20.memory_bandwidth * cal.memory.at(bytes, 0))));

  // An engine whose kernels reach less bandwidth on a share of the SMs, and host work per
  // sequence per decode step (both measured on the H200: docs/benchmarks.md).
  std::ofstream(dir / "split.toml") << "memory = [[1e6, 0.5]]\ndecode_sequence_overhead_s = 20e-6\n"
                                       "split_bandwidth = [[0.3, 0.38], [0.5, 0.6], [1.0, 1.0]]\n";
  auto split_gpu = h20;
  split_gpu.calibration = load_gpu_calibration(dir / "split.toml");
  const cost_model half(shape, split_gpu, 0.5), whole(shape, split_gpu, 1.0);
  const double overhead = h20.step_overhead_s + 8 * 20e-6;
  CHECK(half.decode_seconds(8, 8 * 1024) - overhead ==
        Approx((whole.decode_seconds(8, 8 * 1024) - overhead) / 0.6).epsilon(1e-9));
  // With split_kv_bandwidth the KV reads of attention get a fraction of their own on the share
  // (0.3 here) and the weights keep split_bandwidth's 0.6: by hand, 8 sequences of 1024 tokens
  // on half an H20 read W weight bytes at 4 TB/s x 0.5 (memory) x 0.6 and 8 x 1024 x 128 KiB at
  // 4 TB/s x 0.5 x 0.3. The old model read both at x 0.6. A whole GPU is unaffected.
  std::ofstream(dir / "split_kv.toml") << "memory = [[1e6, 0.5]]\n"
                                          "split_bandwidth = [[0.3, 0.38], [0.5, 0.6], [1.0, 1.0]]\n"
                                          "split_kv_bandwidth = [[0.5, 0.3], [1.0, 1.0]]\n";
  auto split_kv_gpu = h20;
  split_kv_gpu.calibration = load_gpu_calibration(dir / "split_kv.toml");
  const cost_model kv_half(shape, split_kv_gpu, 0.5), kv_whole(shape, split_kv_gpu, 1.0);
  const double weight_bytes = double(shape.weight_bytes());
  const double kv_bytes = 8.0 * 1024 * double(shape.kv_bytes_per_token());
  CHECK(kv_bytes == 8.0 * 1024 * 131072);
  CHECK(kv_half.decode_seconds(8, 8 * 1024) - h20.step_overhead_s ==
        Approx(weight_bytes / (4.0e12 * 0.5 * 0.6) + kv_bytes / (4.0e12 * 0.5 * 0.3)).epsilon(1e-9));
  CHECK(kv_half.decode_seconds(8, 8 * 1024) - h20.step_overhead_s >
        1.05 * (weight_bytes + kv_bytes) / (4.0e12 * 0.5 * 0.6));
  CHECK(kv_whole.decode_seconds(8, 8 * 1024) - h20.step_overhead_s ==
        Approx((weight_bytes + kv_bytes) / (4.0e12 * 0.5)).epsilon(1e-9));
  // split_compute: a prefill step on a share reaches that fraction of the share's peak (its GEMM
  // and attention time both divided by it; compute bound here), the whole GPU is unaffected.
  std::ofstream(dir / "split_compute.toml")
      << "gemm = [[1, 0.5]]\nattention = [[1, 0.4]]\nstep_overhead_s = 0\n"
         "split_compute = [[0.5, 0.8], [1.0, 1.0]]\n";
  auto compute_gpu = h20;
  compute_gpu.calibration = load_gpu_calibration(dir / "split_compute.toml");
  const cost_model c_half(shape, compute_gpu, 0.5), c_whole(shape, compute_gpu, 1.0);
  const double c_attention = c_whole.chunk_attention_flops(4096, 0);
  const double c_linear = 2.0 * double(shape.linear_params()) * 4096;
  CHECK(c_half.prefill_seconds(4096, c_attention) ==
        Approx((c_linear / 0.5 + c_attention / 0.4) / (h20.bf16_flops * 0.5 * 0.8)).epsilon(1e-9));
  CHECK(c_whole.prefill_seconds(4096, c_attention) ==
        Approx((c_linear / 0.5 + c_attention / 0.4) / h20.bf16_flops).epsilon(1e-9));
  // A factor above 1: alone, a share may run a step at more of its peak than the whole GPU does.
  std::ofstream(dir / "split_compute_above_one.toml")
      << "gemm = [[1, 0.5]]\nattention = [[1, 0.4]]\nstep_overhead_s = 0\nsplit_compute = [[0.5, 1.25], [1.0, 1.0]]\n";
  compute_gpu.calibration = load_gpu_calibration(dir / "split_compute_above_one.toml");
  CHECK(cost_model(shape, compute_gpu, 0.5).prefill_seconds(4096, c_attention) ==
        Approx((c_linear / 0.5 + c_attention / 0.4) / (h20.bf16_flops * 0.5 * 1.25)).epsilon(1e-9));
  // prefill_memory: a short step's floor reads the weights at that fraction of the bandwidth,
  // times split_bandwidth on a share; without it, the memory curve on the whole GPU's.
  std::ofstream(dir / "prefill_memory.toml") << "gemm = [[1, 0.9]]\nmemory = [[1e6, 0.8]]\nstep_overhead_s = 0\n"
                                                "prefill_memory = 0.6\nsplit_bandwidth = [[0.5, 0.75], [1.0, 1.0]]\n";
  auto floor_gpu = h20;
  floor_gpu.calibration = load_gpu_calibration(dir / "prefill_memory.toml");
  CHECK(cost_model(shape, floor_gpu, 1.0).prefill_seconds(8, 0) ==
        Approx(weight_bytes / (4.0e12 * 0.6)).epsilon(1e-9));
  CHECK(cost_model(shape, floor_gpu, 0.5).prefill_seconds(8, 0) ==
        Approx(weight_bytes / (4.0e12 * 0.6 * 0.75)).epsilon(1e-9));
  floor_gpu.calibration.prefill_memory.reset();
  CHECK(cost_model(shape, floor_gpu, 0.5).prefill_seconds(8, 0) == Approx(weight_bytes / (4.0e12 * 0.8)).epsilon(1e-9));
  std::ofstream(dir / "prefill_memory_above_one.toml") << "prefill_memory = 1.2\n";
  CHECK(contains(error_of<gpu_catalog_error>(
                     [&] { (void)load_gpu_calibration(dir / "prefill_memory_above_one.toml"); }),
                 "prefill_memory"));
  // prefill_gemm_row_tile: a step's GEMMs are priced on whole tiles of rows, FLOPs and the gemm
  // curve both (measured on an H100: 513 tokens took 23 % longer than 512, 704 about as long as
  // 768; docs/sim.md). The curve rises with rows, so without the key 513 tokens cost less than 576.
  std::ofstream(dir / "row_tile.toml") << "gemm = [[512, 0.5], [1024, 0.7]]\nstep_overhead_s = 0\n"
                                          "prefill_gemm_row_tile = 64\n";
  auto tile_gpu = h20;
  tile_gpu.calibration = load_gpu_calibration(dir / "row_tile.toml");
  const cost_model tiled(shape, tile_gpu, 1.0);
  const double linear_576 = 2.0 * double(shape.linear_params()) * 576;
  const double e_576 = 0.5 + 0.2 * std::log2(576.0 / 512.0);  // the curve is linear in log rows
  CHECK(tiled.prefill_seconds(513, 0) == Approx(linear_576 / (h20.bf16_flops * e_576)).epsilon(1e-9));
  CHECK(tiled.prefill_seconds(513, 0) == Approx(tiled.prefill_seconds(576, 0)).epsilon(1e-12));
  CHECK(tiled.prefill_seconds(512, 0) < tiled.prefill_seconds(513, 0));
  tile_gpu.calibration.prefill_gemm_row_tile.reset();
  const cost_model untiled(shape, tile_gpu, 1.0);
  CHECK(untiled.prefill_seconds(513, 0) < untiled.prefill_seconds(576, 0));
  for (const char* bad : {"0", "1.5", "5000"}) {
    std::ofstream(dir / "row_tile_bad.toml") << "prefill_gemm_row_tile = " << bad << "\n";
    CHECK(contains(error_of<gpu_catalog_error>([&] { (void)load_gpu_calibration(dir / "row_tile_bad.toml"); }),
                   "prefill_gemm_row_tile"));
  }
  // prefill_roofline_exponent: compute c and weight reads m combine as (c^p + m^p)^(1/p), so a
  // step where the two are close costs more than the larger (short steps on an H100, docs/sim.md)
  // and a step far into either bound costs about that bound.
  std::ofstream(dir / "overlap.toml") << "gemm = [[64, 0.5], [4096, 0.5]]\nstep_overhead_s = 0\n"
                                         "prefill_memory = 0.8\nprefill_roofline_exponent = 4\n";
  auto overlap_gpu = h20;
  overlap_gpu.calibration = load_gpu_calibration(dir / "overlap.toml");
  REQUIRE(overlap_gpu.calibration.prefill_roofline_exponent.has_value());
  const cost_model overlapped(shape, overlap_gpu, 1.0);
  const double reads = weight_bytes / (h20.memory_bandwidth * 0.8);
  const auto math = [&](uint64_t t) { return 2.0 * double(shape.linear_params()) * double(t) / (h20.bf16_flops * 0.5); };
  for (const uint64_t t : {1u, 100u, 300u, 4096u}) {
    INFO("tokens " << t);
    CHECK(overlapped.prefill_seconds(t, 0) ==
          Approx(std::pow(std::pow(math(t), 4.0) + std::pow(reads, 4.0), 0.25)).epsilon(1e-9));
    CHECK(overlapped.prefill_seconds(t, 0) > std::max(math(t), reads));
  }
  CHECK(overlapped.prefill_seconds(1, 0) == Approx(reads).epsilon(1e-6));
  overlap_gpu.calibration.prefill_roofline_exponent.reset();
  CHECK(cost_model(shape, overlap_gpu, 1.0).prefill_seconds(300, 0) == Approx(std::max(math(300), reads)).epsilon(1e-9));
  for (const char* bad : {"0.5", "100", "\"x\""}) {
    std::ofstream(dir / "overlap_bad.toml") << "prefill_roofline_exponent = " << bad << "\n";
    CHECK(contains(error_of<gpu_catalog_error>([&] { (void)load_gpu_calibration(dir / "overlap_bad.toml"); }),
                   "prefill_roofline_exponent"));
  }
  std::ofstream(dir / "kv_share_above_one.toml") << "split_kv_bandwidth = [[0.5, 0.3], [1.5, 1.0]]\n";
  CHECK(contains(error_of<gpu_catalog_error>(
                     [&] { (void)load_gpu_calibration(dir / "kv_share_above_one.toml"); }),
                 "SM shares must be at most 1"));
  const cost_model default_half(shape, h20, 0.5), default_whole(shape, h20, 1.0);
  CHECK(default_half.decode_seconds(8, 8 * 1024) - h20.step_overhead_s ==
        Approx((default_whole.decode_seconds(8, 8 * 1024) - h20.step_overhead_s) / (1.1 * std::sqrt(0.5)))
            .epsilon(1e-9));
  std::ofstream(dir / "contention.toml")
      << "concurrent_decode_delay_s = 0.014\nconcurrent_prefill_slowdown = 1.2\nconcurrent_prefill_yield = 0.6\n"
         "shared_prefill_delay_s = 0.004\nconcurrent_decode_tile_keys = 3400\n"
         "concurrent_decode_delay_by_overlap = true\n";
  const auto contention = load_gpu_calibration(dir / "contention.toml");
  CHECK(contention.concurrent_decode_delay_by_overlap == true);
  std::ofstream(dir / "overlap_number.toml") << "concurrent_decode_delay_by_overlap = 1\n";
  CHECK(contains(error_of<gpu_catalog_error>(
                     [&] { (void)load_gpu_calibration(dir / "overlap_number.toml"); }),
                 "must be true or false"));
  CHECK_FALSE(contention.concurrent_overlap_on_prefill_start.has_value());
  std::ofstream(dir / "prefill_start.toml") << "concurrent_overlap_on_prefill_start = true\n";
  CHECK(load_gpu_calibration(dir / "prefill_start.toml").concurrent_overlap_on_prefill_start == true);
  std::ofstream(dir / "prefill_start_text.toml") << "concurrent_overlap_on_prefill_start = \"yes\"\n";
  CHECK(contains(error_of<gpu_catalog_error>(
                     [&] { (void)load_gpu_calibration(dir / "prefill_start_text.toml"); }),
                 "concurrent_overlap_on_prefill_start"));
  CHECK_FALSE(contention.split_decode_slowdown.has_value());
  std::ofstream(dir / "split_slowdown.toml") << "split_decode_slowdown = 1.25\n";
  CHECK(load_gpu_calibration(dir / "split_slowdown.toml").split_decode_slowdown == Approx(1.25));
  std::ofstream(dir / "split_speedup.toml") << "split_decode_slowdown = 0.8\n";
  CHECK(contains(error_of<gpu_catalog_error>(
                     [&] { (void)load_gpu_calibration(dir / "split_speedup.toml"); }),
                 "a slowdown is at least 1"));
  CHECK(contention.split_prefill_slowdown.empty());
  std::ofstream(dir / "split_prefill.toml") << "split_prefill_slowdown = [[0.5, 1.4], [0.7, 1.2]]\n";
  const auto by_share = load_gpu_calibration(dir / "split_prefill.toml").split_prefill_slowdown;
  CHECK(by_share.at(0.5, 1.0) == Approx(1.4));
  CHECK(by_share.at(0.7, 1.0) == Approx(1.2));
  std::ofstream(dir / "split_prefill_speedup.toml") << "split_prefill_slowdown = [[0.5, 0.9]]\n";
  CHECK(contains(error_of<gpu_catalog_error>(
                     [&] { (void)load_gpu_calibration(dir / "split_prefill_speedup.toml"); }),
                 "a slowdown is at least 1"));
  CHECK(contention.concurrent_decode_delay_s == Approx(0.014));
  CHECK(contention.concurrent_prefill_slowdown == Approx(1.2));
  CHECK(contention.concurrent_prefill_yield == Approx(0.6));
  CHECK(contention.shared_prefill_delay_s == Approx(0.004));
  CHECK(contention.concurrent_decode_tile_keys == Approx(3400));
  CHECK_FALSE(contention.concurrent_decode_slowdown.has_value());
  std::ofstream(dir / "front_end.toml") << "front_end_s = 0.003\n";
  CHECK(load_gpu_calibration(dir / "front_end.toml").front_end_s == Approx(0.003));
  CHECK_FALSE(contention.front_end_s.has_value());
  std::ofstream(dir / "negative_front_end.toml") << "front_end_s = -0.001\n";
  CHECK(contains(error_of<gpu_catalog_error>([&] { (void)load_gpu_calibration(dir / "negative_front_end.toml"); }),
                 "must not be negative"));
  std::ofstream(dir / "front_end_tokens.toml")
      << "front_end_token_s = 5e-7\nshared_decode_lag_s = [[32, 0.0005], [256, 0.0055]]\n";
  const auto front = load_gpu_calibration(dir / "front_end_tokens.toml");
  CHECK(front.front_end_token_s == Approx(5e-7));
  CHECK(front.shared_decode_lag_s.at(32, 0) == Approx(0.0005));
  CHECK(front.shared_decode_lag_s.at(256, 0) == Approx(0.0055));
  CHECK(contention.shared_decode_lag_s.empty());
  std::ofstream(dir / "negative_token.toml") << "front_end_token_s = -1e-7\n";
  CHECK(contains(
      error_of<gpu_catalog_error>([&] { (void)load_gpu_calibration(dir / "negative_token.toml"); }),
      "must not be negative"));
  std::ofstream(dir / "zero_lag.toml") << "shared_decode_lag_s = [[32, 0]]\n";
  CHECK(contains(
      error_of<gpu_catalog_error>([&] { (void)load_gpu_calibration(dir / "zero_lag.toml"); }),
      "must be above 0"));
  std::ofstream(dir / "negative_delay.toml") << "shared_prefill_delay_s = -0.001\n";
  CHECK(contains(error_of<gpu_catalog_error>([&] { (void)load_gpu_calibration(dir / "negative_delay.toml"); }),
                 "must not be negative"));
  std::ofstream(dir / "zero_tile.toml") << "concurrent_decode_tile_keys = 0\n";
  CHECK(contains(error_of<gpu_catalog_error>(
                     [&] { (void)load_gpu_calibration(dir / "zero_tile.toml"); }),
                 "must be above 0"));
  std::ofstream(dir / "speedup.toml") << "concurrent_decode_slowdown = 0.5\n";
  CHECK(contains(error_of<gpu_catalog_error>([&] { (void)load_gpu_calibration(dir / "speedup.toml"); }),
                 "a slowdown is at least 1"));
  // The chunk-size factors: any positive multiplier (above 1 too), interpolated in log(tokens).
  std::ofstream(dir / "chunk_scales.toml")
      << "concurrent_prefill_yield_scale = [[512, 1.6], [2048, 1]]\n"
         "concurrent_decode_delay_scale = [[512, 0.5], [2048, 1.0]]\n";
  const auto scales = load_gpu_calibration(dir / "chunk_scales.toml");
  CHECK(scales.concurrent_prefill_yield_scale.at(256, 1.0) == Approx(1.6));
  CHECK(scales.concurrent_prefill_yield_scale.at(1024, 1.0) == Approx(1.3));
  CHECK(scales.concurrent_decode_delay_scale.at(1024, 1.0) == Approx(0.75));
  CHECK(scales.concurrent_decode_delay_scale.at(8192, 1.0) == Approx(1.0));
  CHECK(scales.concurrent_decode_slowdown_scale.empty());
  std::ofstream(dir / "slowdown_scale.toml") << "concurrent_decode_slowdown_scale = [[512, 1.2], [1024, 1.0]]\n";
  CHECK(load_gpu_calibration(dir / "slowdown_scale.toml").concurrent_decode_slowdown_scale.at(512, 1.0) ==
        Approx(1.2));
  CHECK(contention.concurrent_prefill_yield_scale.empty());
  // The error a calibration file holding `text` is refused with.
  const auto refusal = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return error_of<gpu_catalog_error>([&] { (void)load_gpu_calibration(dir / name); });
  };
  CHECK(contains(refusal("zero_scale.toml", "concurrent_decode_delay_scale = [[512, 0], [2048, 1]]\n"),
                 "must be above 0"));
  std::ofstream(dir / "batch_scale.toml")
      << "concurrent_decode_delay_batch_scale = [[2, 0.55], [8, 1]]\n";
  const auto by_rows = load_gpu_calibration(dir / "batch_scale.toml");
  CHECK(by_rows.concurrent_decode_delay_batch_scale.at(1, 1.0) == Approx(0.55));
  CHECK(by_rows.concurrent_decode_delay_batch_scale.at(256, 1.0) == Approx(1.0));
  CHECK(contains(
      refusal("zero_batch_scale.toml", "concurrent_decode_delay_batch_scale = [[2, 0], [8, 1]]\n"),
      "must be above 0"));
  CHECK(contains(refusal("scale_order.toml", "concurrent_prefill_yield_scale = [[2048, 1], [512, 1.5]]\n"),
                 "shapes must be strictly ascending"));
  CHECK(contains(refusal("scale_scalar.toml", "concurrent_prefill_yield_scale = 1.5\n"),
                 "[shape, factor] pairs"));
  std::ofstream(dir / "share_above_one.toml") << "split_bandwidth = [[0.5, 0.6], [2.0, 1.0]]\n";
  CHECK(contains(error_of<gpu_catalog_error>([&] { (void)load_gpu_calibration(dir / "share_above_one.toml"); }),
                 "SM shares must be at most 1"));

  std::ofstream(dir / "unsorted.toml") << "gemm = [[100, 0.5], [1, 0.1]]\n";
  CHECK(contains(
      error_of<gpu_catalog_error>([&] { (void)load_gpu_calibration(dir / "unsorted.toml"); }),
      "strictly ascending"));
  std::ofstream(dir / "wrong_gpu.toml") << "gpu = \"a100\"\n";
  std::ofstream(dir / "gpus.toml")
      << "[gpus.h20]\nbf16_flops = 148e12\nmemory_bandwidth = 4e12\nmemory_bytes = 96e9\n"
         "sms = 78\ncalibration = \"wrong_gpu.toml\"\n";
  CHECK(contains(error_of<gpu_catalog_error>([&] { (void)load_gpu_specs(dir / "gpus.toml"); }),
                 "calibrates 'h20'"));
}

// ------------------------------------------------------------------------ specs

TEST_CASE(
    "deployment specs describe colocated, SM-split and xPyD deployments with a GPU type per role") {
  const auto config = default_config();
  const auto coloc = parse_deployment_spec("colocated:gpus=2", config, "h20");
  CHECK(coloc.gpus.size() == 2);
  REQUIRE(coloc.workers.size() == 4);
  CHECK(coloc.workers[0].gpu == 0);
  CHECK(coloc.workers[1].gpu == 0);
  CHECK(coloc.workers[0].sm_share == 1.0);
  CHECK(coloc.workers[1].kv_memory_share == Approx(0.8));

  const auto split = parse_deployment_spec("split:sm=0.6", config, "h20");
  REQUIRE(split.workers.size() == 2);
  CHECK(split.workers[0].sm_share == Approx(0.6));
  CHECK(split.workers[1].sm_share == Approx(0.4));

  const auto reserve = parse_deployment_spec("reserve:sm=0.75,gpus=2", config, "h100");
  REQUIRE(reserve.workers.size() == 4);
  CHECK(reserve.workers[0].sm_share == Approx(0.75));
  CHECK(reserve.workers[1].sm_share == 1.0);
  CHECK(reserve.workers[1].role == actor_role::decode);
  CHECK(reserve.workers[1].own_stream);
  CHECK(reserve.workers[3].gpu == 1);
  CHECK(parse_deployment_spec("reserve", config, "h100").workers[0].sm_share == Approx(0.7));
  CHECK(describe(reserve) == "2 GPUs: gpu0 h100 [prefill 75% + decode], gpu1 h100 [prefill 75% + decode]");
  // PD on one GPU, each engine on the whole GPU on a stream of its own.
  const auto streams = parse_deployment_spec("streams:chunk=1024", config, "h100");
  REQUIRE(streams.workers.size() == 2);
  for (const auto& w : streams.workers) {
    CHECK(w.sm_share == 1.0);
    CHECK(w.own_stream);
    CHECK(w.gpu == 0);
  }
  CHECK(streams.workers[0].chunk_tokens == 1024);
  CHECK_THROWS_AS(parse_deployment_spec("streams:sm=0.5", config, "h100"), std::invalid_argument);
  CHECK_FALSE(coloc.workers[0].own_stream);

  const auto hetero =
      parse_deployment_spec("2P3D:p=h100,d=h20,batch=128,chunk=1024,link=network", config, "h200");
  REQUIRE(hetero.gpus.size() == 5);
  CHECK(hetero.gpus[0].type == "h100");
  CHECK(hetero.gpus[4].type == "h20");
  CHECK(hetero.workers[4].max_batch == 128);
  CHECK(hetero.workers[0].chunk_tokens == 1024);
  CHECK(hetero.link == link_kind::network);
  CHECK(describe(hetero) ==
        "5 GPUs: gpu0 h100 [prefill], gpu1 h100 [prefill], gpu2 h20 [decode], gpu3 h20 [decode], "
        "gpu4 h20 [decode]");

  CHECK(contains(
      error_of<deployment_spec_error>([&] { (void)parse_deployment_spec("3X", config, "h20"); }),
      "colocated, streams, split, reserve, or XPYD"));
  CHECK(contains(error_of<deployment_spec_error>(
                     [&] { (void)parse_deployment_spec("1P1D:sm=0.5", config, "h20"); }),
                 "unknown option 'sm'"));
  CHECK(contains(error_of<deployment_spec_error>(
                     [&] { (void)parse_deployment_spec("split:sm=1.5", config, "h20"); }),
                 "between 0 and 1"));

  // A config maps to what `duet up` would run: the local example splits one GPU 50/50.
  const auto local =
      deployment_from_config(load_config(fs::path(DUET_SOURCE_DIR) / "config" / "local-sim.toml"));
  CHECK(local.gpus.size() == 1);
  REQUIRE(local.workers.size() == 2);
  CHECK(local.workers[0].address == "local/prefill0");
  CHECK(local.workers[0].sm_share == 0.5);
  CHECK(local.workers[1].kv_blocks == 4096);
}

TEST_CASE("synthetic trace specs and SLO specs read as documented") {
  const auto p =
      parse_synthetic_spec("synthetic:gamma:rate=5,cv=3,count=100,in=1000,in_cv=1,out=200,seed=3");
  CHECK(p.process == arrival_process::gamma);
  CHECK(p.rate == 5);
  CHECK(p.cv == 3);
  CHECK(p.count == 100);
  CHECK(p.input.kind == length_distribution::shape::lognormal);
  CHECK(p.output.kind == length_distribution::shape::fixed);
  CHECK(p.seed == 3);
  const auto trace = load_trace_spec("synthetic:poisson:rate=4,duration=10,in=64,out=8");
  CHECK(trace.size() > 20);
  CHECK(trace.back().arrival_s < 10);
  CHECK(trace.front().input_tokens == 64);
  CHECK(
      contains(error_of<trace_error>([] { (void)parse_synthetic_spec("synthetic:poisson:rat=4"); }),
               "unknown key 'rat'"));
  CHECK(contains(error_of<trace_error>([] { (void)parse_synthetic_spec("synthetic:uniform"); }),
                 "poisson, gamma or onoff"));

  const auto slo = parse_slo("ttft=2s,tpot=50ms");
  CHECK(slo.ttft_s == 2.0);
  CHECK(slo.tpot_s == Approx(0.05));
  CHECK(std::isinf(parse_slo("tpot=100us").ttft_s));
  CHECK(contains(error_of<std::invalid_argument>([] { (void)parse_slo("ttft=fast"); }),
                 "positive time"));
}

// ------------------------------------------------------------------------ the simulation

TEST_CASE(
    "one request's TTFT and inter-token gaps are the cost model's step times plus message hops") {
  const auto config = default_config();
  const auto shape = *find_model_shape(config.model.preset);
  const auto h200 = *find_gpu_spec("h200");
  const cost_model costs(shape, h200);
  sim_options o;
  o.hop_s = 50e-6;
  const double h = o.hop_s;
  const std::vector<trace_request> trace = {request_at(0, 1000, 4)};
  auto ns = [](double s) {
    return std::floor(s * 1e9) / 1e9;
  };  // the sim engine truncates to whole ns
  const double prefill = ns(costs.prefill_seconds(1000, costs.chunk_attention_flops(1000, 0)));
  const double d1 = ns(costs.decode_seconds(1, 1001)), d2 = ns(costs.decode_seconds(1, 1002)),
               d3 = ns(costs.decode_seconds(1, 1003));

  SUBCASE("KV moves between GPUs over NVLink at the link's bandwidth") {
    const auto r = run_simulation(config, one_p_one_d("h200"), trace, o);
    REQUIRE(r.records.size() == 1);
    const auto& rec = r.records[0];
    REQUIRE(rec.succeeded());
    // client → router → prefill, step, → broker (register) → prefill (ack) → router → client
    CHECK(*rec.ttft_s() == Approx(6 * h + prefill).epsilon(1e-9));
    // 63 blocks of 16 tokens × 128 KiB cross NVLink at 450 GB/s × 0.88, plus 5 us to set up.
    const double transfer = 63.0 * 16 * 131072 / (450e9 * 0.88) + 5e-6;
    REQUIRE(rec.itl_s.size() == 3);
    // router → decode (adopt) → broker (pull) → decode (moved, after the transfer), step, → client
    CHECK(rec.itl_s[0] == Approx(3 * h + transfer + d1).epsilon(1e-6));
    CHECK(rec.itl_s[1] == Approx(d2).epsilon(1e-6));
    CHECK(rec.itl_s[2] == Approx(d3).epsilon(1e-6));
    CHECK(rec.output_tokens == 4);
    CHECK(rec.e2e_s() == Approx(9 * h + prefill + transfer + d1 + d2 + d3).epsilon(1e-6));
    CHECK(r.counters.at("sim.kv_transfers_nvlink") == 1);
    CHECK(r.counters.at("sim.kv_bytes_transferred") == 63ull * 16 * 131072);
  }
  SUBCASE("on one GPU in time, the decode steps follow the prefill with no transfer") {
    const auto r =
        run_simulation(config, parse_deployment_spec("colocated", config, "h200"), trace, o);
    const auto& rec = r.records[0];
    REQUIRE(rec.succeeded());
    CHECK(*rec.ttft_s() == Approx(6 * h + prefill).epsilon(1e-9));
    CHECK(rec.itl_s[0] == Approx(3 * h + d1).epsilon(1e-6));
    CHECK_FALSE(r.counters.contains("sim.kv_transfers_nvlink"));
  }
  SUBCASE("an SM split slows each side by its share, in the GPU's partition steps") {
    // 0.25 of 132 SMs is 33: the green context gets 32, a multiple of 8.
    REQUIRE(partition_share(h200, 0.25) == Approx(32.0 / 132));
    const cost_model prefill_share(shape, h200, partition_share(h200, 0.25));
    const auto r =
        run_simulation(config, parse_deployment_spec("split:sm=0.25", config, "h200"), trace, o);
    CHECK(*r.records[0].ttft_s() == Approx(6 * h + ns(prefill_share.prefill_seconds(
                                                       1000, costs.chunk_attention_flops(1000, 0))))
                                        .epsilon(1e-9));
  }
}

TEST_CASE("the same trace and deployment give the same records and byte-identical reports") {
  const auto config = default_config();
  const auto trace = load_trace_spec(
      "synthetic:gamma:rate=6,cv=3,count=200,in=800,in_cv=1,out=60,out_cv=1,seed=7");
  std::vector<report_run> first, second;
  for (const char* spec : {"colocated", "1P1D"}) {
    const auto d = parse_deployment_spec(spec, config, "h20");
    auto a = run_simulation(config, d, trace);
    auto b = run_simulation(config, d, trace);
    CHECK(a.events == b.events);
    CHECK(a.counters == b.counters);
    CHECK(same_records(a.records, b.records));
    first.push_back(make_report_run(spec, std::move(a.records), {}, std::move(a.series)));
    second.push_back(make_report_run(spec, std::move(b.records), {}, std::move(b.series)));
  }
  const auto d1 = scratch_dir("determinism-1"), d2 = scratch_dir("determinism-2");
  (void)write_report(d1, first);
  (void)write_report(d2, second);
  for (const char* f : {"summary.json", "requests.csv", "report.html"}) {
    CAPTURE(f);
    CHECK(read_all(d1 / f) == read_all(d2 / f));
  }
}

TEST_CASE("DUET_STEP_LOG writes one line per engine step: its span, modelled time and chunks") {
  const auto config = default_config();
  const auto trace = load_trace_spec("synthetic:poisson:rate=4,count=12,in=3000,out=8,seed=3");
  const auto dir = scratch_dir("step-log");
  sim_result r;
  {
    scoped_env env("DUET_STEP_LOG", (dir / "run").string());
    r = run_simulation(config, parse_deployment_spec("1P1D", config, "h200"), trace);
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path());
  REQUIRE(files.size() == 2);  // the prefill and the decode worker
  uint64_t prefill_lines = 0, decode_lines = 0, prefill_tokens = 0, prefill_us = 0;
  for (const auto& f : files) {
    std::istringstream in(read_all(f));
    std::string line;
    std::getline(in, line);
    CHECK(line == "role,begin_ms,end_ms,engine_us,sequences,tokens,context,mix");
    while (std::getline(in, line)) {
      std::vector<std::string> cells;
      std::stringstream cell_stream(line);
      for (std::string c; std::getline(cell_stream, c, ',');) cells.push_back(c);
      if (cells.size() == 7) cells.emplace_back();  // a decode step: no mix
      REQUIRE(cells.size() == 8);
      CHECK(std::stoll(cells[2]) >= std::stoll(cells[1]));
      if (cells[0] == "prefill") {
        ++prefill_lines;
        prefill_tokens += std::stoull(cells[5]);
        prefill_us += std::stoull(cells[3]);
        // The mix reads back as the step's chunks: 3,000-token prompts in 2,048-token chunks.
        const auto mix = parse_prefill_mix(cells[7]);
        CHECK(mix.tokens() == std::stoull(cells[5]));
        CHECK(mix.sequences() == std::stoul(cells[4]));
      } else {
        ++decode_lines;
        CHECK(cells[0] == "decode");
      }
    }
  }
  CHECK(prefill_lines == r.counters.at("prefill.steps"));
  CHECK(decode_lines == r.counters.at("decode.hop_step_count"));
  CHECK(prefill_tokens == 12u * 3000);
  // Alone on its GPU each prefill step takes its modelled time (ms on the clock, us logged).
  CHECK(double(prefill_us) / 1e3 == Approx(double(r.counters.at("prefill.hop_step_us")) / 1e3).epsilon(0.05));
}

TEST_CASE(
    "with reserve, a full decode KV pool makes adopted sequences wait for memory, in arrival "
    "order, and all finish") {
  const auto config = default_config();
  std::vector<trace_request> trace;
  for (int i = 0; i < 4; ++i) trace.push_back(request_at(0.001 * i, 100, 100));
  // prompt 100 + 99 generated positions = 199 tokens = 13 blocks: a 16-block pool holds one.
  const auto small =
      run_simulation(config, one_p_one_d("h200", 4096, 16, kv_allocation::reserve), trace);
  const auto large =
      run_simulation(config, one_p_one_d("h200", 4096, 4096, kv_allocation::reserve), trace);
  for (const auto& r : small.records) REQUIRE(r.succeeded());
  CHECK(small.counters.at("decode.adopted") == 4);
  CHECK_FALSE(small.counters.contains("decode.memory_timeouts"));
  // Each sequence decodes only after the one before it finished.
  for (size_t i = 1; i < small.records.size(); ++i) {
    CHECK(small.records[i].finish_s > small.records[i - 1].finish_s);
    CHECK(small.records[i].itl_s.front() >
          small.records[i - 1].e2e_s() - small.records[i - 1].ttft_s().value() - 0.01);
  }
  const double single = large.records[0].e2e_s();
  CHECK(small.records.back().e2e_s() > 3.5 * (single - *large.records[0].ttft_s()));
  // With room for all, they share every decode step and finish together.
  CHECK(large.records.back().finish_s - large.records.front().finish_s < 0.01);
  double most_waiting = 0;
  for (const auto& s : small.series) {
    if (s.name == "waiting for decode KV memory") {
      for (double v : s.values) most_waiting = std::max(most_waiting, v);
    }
  }
  CHECK(most_waiting >= 2);
  CHECK(small.counters.at("decode.double_frees") == 0);
  CHECK(small.counters.at("prefill.double_frees") == 0);
}

TEST_CASE(
    "a memory-bound decode pool runs a larger batch on demand than reserved, and the simulator "
    "reports its preemptions and what recomputing them cost") {
  const auto config = default_config();
  std::vector<trace_request> trace;
  for (int i = 0; i < 12; ++i) trace.push_back(request_at(0.001 * i, 100, 100));
  // Full length 199 tokens = 13 blocks: reserve fits four in 52 blocks; on demand admits at
  // 101 tokens (7 blocks) while a block stays free: seven, which then outgrow the pool.
  const auto on_demand =
      run_simulation(config, one_p_one_d("h200", 4096, 52, kv_allocation::on_demand), trace);
  const auto reserve =
      run_simulation(config, one_p_one_d("h200", 4096, 52, kv_allocation::reserve), trace);
  for (const auto* r : {&on_demand, &reserve}) {
    for (const auto& rec : r->records) {
      REQUIRE(rec.succeeded());
      CHECK(rec.output_tokens == 100);
    }
    CHECK(r->counters.at("decode.double_frees") == 0);
  }
  const auto peak_on_demand = on_demand.counters.at("sim.peak_decode_batch");
  const auto peak_reserve = reserve.counters.at("sim.peak_decode_batch");
  const auto preemptions = on_demand.counters.at("decode.preemptions");
  MESSAGE("peak decode batch: on_demand " << peak_on_demand << ", reserve " << peak_reserve
                                          << "; preemptions " << preemptions << ", recomputed "
                                          << on_demand.counters.at("decode.recomputed_tokens")
                                          << " tokens");
  CHECK(peak_reserve == 4);
  CHECK(peak_on_demand == 7);
  CHECK(preemptions > 0);
  CHECK(on_demand.counters.at("decode.resumed") == preemptions);
  CHECK(on_demand.counters.at("decode.recomputed_tokens") > 100 * preemptions);
  CHECK(on_demand.counters.at("decode.recompute_steps") > 0);
  CHECK_FALSE(reserve.counters.contains("decode.preemptions"));
  // The series the report plots: preemptions so far, ending at the counter.
  const auto series = std::find_if(on_demand.series.begin(), on_demand.series.end(),
                                   [](const time_series& s) { return s.name == "decode preemptions"; });
  REQUIRE(series != on_demand.series.end());
  REQUIRE_FALSE(series->values.empty());
  CHECK(*std::max_element(series->values.begin(), series->values.end()) > 0);
  CHECK(series->values.back() <= double(preemptions));
}

namespace {

/// The default deployment with its prefill and decode workers on one GPU (device 0), each on
/// its own stream (the default).
deployment_config one_gpu_own_streams() {
  auto config = default_config();
  config.nodes.resize(1);
  for (auto& a : config.nodes[0].actors) a.device = 0;
  return config;
}

/// one_gpu_own_streams() with the prefill engine on a partition of `share` of the SMs (decode
/// on the whole GPU).
deployment_config one_gpu_prefill_partition(double share) {
  auto config = one_gpu_own_streams();
  for (auto& a : config.nodes[0].actors) {
    if (a.role == actor_role::prefill) a.sm_share = share;
  }
  return config;
}

/// one_gpu_own_streams with the SMs split by green contexts: 60 % prefill, 40 % decode.
deployment_config one_gpu_split_60_40() {
  auto config = one_gpu_own_streams();
  for (auto& a : config.nodes[0].actors) {
    if (a.role == actor_role::prefill) a.sm_share = 0.6;
    if (a.role == actor_role::decode) a.sm_share = 0.4;
  }
  return config;
}

}  // namespace

TEST_CASE(
    "engines on streams of their own step concurrently on one GPU, slowed by the calibrated "
    "contention; on one shared stream they take turns") {
  auto config = one_gpu_own_streams();  // prefill and decode on one GPU
  auto own = deployment_from_config(config);
  REQUIRE(own.gpus.size() == 1);
  for (const auto& w : own.workers) CHECK(w.own_stream);
  for (auto& a : config.nodes[0].actors) a.stream = "shared";
  const auto shared = deployment_from_config(config);
  for (const auto& w : shared.workers) CHECK_FALSE(w.own_stream);

  const auto trace =
      load_trace_spec("synthetic:poisson:rate=2,duration=30,in=2000,out=100,seed=11");
  const auto turns = summarize(run_simulation(config, shared, trace).records);
  const auto free_running = summarize(run_simulation(config, own, trace).records);
  sim_options contended;
  gpu_calibration cal;
  cal.concurrent_decode_delay_s = 0.02;
  cal.concurrent_prefill_slowdown = 1.5;
  contended.calibrations[own.gpus[0].type] = cal;
  const auto slowed = summarize(run_simulation(config, own, trace, contended).records);
  // Decode's priority: a prefill in flight also loses most of each decode step's work time.
  sim_options yielding = contended;
  yielding.calibrations[own.gpus[0].type].concurrent_prefill_yield = 0.9;
  const auto yielded = summarize(run_simulation(config, own, trace, yielding).records);
  REQUIRE(yielded.completed == trace.size());
  REQUIRE(turns.completed == trace.size());
  REQUIRE(free_running.completed == trace.size());
  REQUIRE(slowed.completed == trace.size());
  MESSAGE("ITL P99: shared stream " << turns.itl_s.p99 * 1e3 << " ms, own streams "
                                    << free_running.itl_s.p99 * 1e3 << " ms, contended "
                                    << slowed.itl_s.p99 * 1e3 << " ms; TTFT P50 "
                                    << free_running.ttft_s.p50 * 1e3 << " / "
                                    << slowed.ttft_s.p50 * 1e3 << " ms");
  // Taking turns, a decode step waits out a prefill chunk; concurrently it does not.
  CHECK(turns.itl_s.p99 > 10 * free_running.itl_s.p99);
  // Contention: a decode step overlapping a prefill waits 20 ms more, prefill runs 1.5x longer.
  CHECK(slowed.itl_s.max >= 0.02 + free_running.itl_s.p50);
  CHECK(slowed.itl_s.p99 > free_running.itl_s.p99 + 0.015);
  CHECK(slowed.ttft_s.p50 > 1.3 * free_running.ttft_s.p50);
  CHECK(slowed.itl_s.p99 < turns.itl_s.p99);
  MESSAGE("TTFT P50 with prefill yielding to decode: " << yielded.ttft_s.p50 * 1e3 << " ms");
  CHECK(yielded.ttft_s.p50 > slowed.ttft_s.p50);
  CHECK(yielded.itl_s.p50 == Approx(slowed.itl_s.p50).epsilon(0.1));  // decode is not slowed more
}

TEST_CASE(
    "a decode engine on the whole GPU beside a prefill engine on a partition waits as on streams, "
    "scaled by reserve_decode_delay_scale, and the prefill runs at its share") {
  auto streams_config = one_gpu_own_streams();
  auto reserve_config = one_gpu_prefill_partition(0.75);
  const auto streams = deployment_from_config(streams_config);
  const auto reserve = deployment_from_config(reserve_config);
  REQUIRE(reserve.workers.size() == 2);
  const auto trace =
      load_trace_spec("synthetic:poisson:rate=2,duration=30,in=2000,out=100,seed=11");
  gpu_calibration cal;
  cal.concurrent_decode_delay_s = 0.02;
  sim_options plain;
  plain.calibrations[streams.gpus[0].type] = cal;
  sim_options halved = plain;
  // A curve over the SMs no partition holds (0.25 here): the delay at a quarter free is halved.
  halved.calibrations[streams.gpus[0].type].reserve_decode_delay_scale.points = {{0.1, 0.9},
                                                                                 {0.25, 0.5}};
  const auto on_streams = summarize(run_simulation(streams_config, streams, trace, plain).records);
  const auto unscaled = summarize(run_simulation(reserve_config, reserve, trace, plain).records);
  const auto scaled = summarize(run_simulation(reserve_config, reserve, trace, halved).records);
  // The scale is for a partition beside the whole GPU only: streams ignore it.
  const auto streams_halved =
      summarize(run_simulation(streams_config, streams, trace, halved).records);
  for (const auto* r : {&on_streams, &unscaled, &scaled, &streams_halved})
    REQUIRE(r->completed == trace.size());
  MESSAGE("ITL P50 / max ms: streams " << on_streams.itl_s.p50 * 1e3 << " / "
                                       << on_streams.itl_s.max * 1e3 << ", prefill at 0.75 "
                                       << unscaled.itl_s.p50 * 1e3 << " / "
                                       << unscaled.itl_s.max * 1e3 << ", scaled 0.5 "
                                       << scaled.itl_s.p50 * 1e3 << " / "
                                       << scaled.itl_s.max * 1e3 << "; TTFT P50 "
                                       << on_streams.ttft_s.p50 * 1e3 << " / "
                                       << unscaled.ttft_s.p50 * 1e3 << " ms");
  CHECK(streams_halved.itl_s.max == Approx(on_streams.itl_s.max));
  // A step beside a chunk waits the whole delay unscaled, half of it scaled.
  CHECK(unscaled.itl_s.max >= 0.02 + on_streams.itl_s.p50 - 1e-3);
  CHECK(scaled.itl_s.max < unscaled.itl_s.max - 0.008);
  CHECK(scaled.itl_s.max >= 0.01 + on_streams.itl_s.p50 - 1e-3);
  // Decode alone is as fast as on streams; prefill on 3/4 of the SMs is slower.
  CHECK(unscaled.itl_s.p50 == Approx(on_streams.itl_s.p50).epsilon(0.05));
  CHECK(unscaled.ttft_s.p50 > 1.1 * on_streams.ttft_s.p50);
  // The prefill on the partition loses its yield times its share (default) or times
  // reserve_prefill_yield_scale of each decode step.
  sim_options yielding = plain;
  yielding.calibrations[streams.gpus[0].type].concurrent_prefill_yield = 0.6;
  sim_options yielding_more = yielding;
  yielding_more.calibrations[streams.gpus[0].type].reserve_prefill_yield_scale.points = {{0.25, 1.5}};
  const auto share_yield = summarize(run_simulation(reserve_config, reserve, trace, yielding).records);
  const auto more_yield =
      summarize(run_simulation(reserve_config, reserve, trace, yielding_more).records);
  MESSAGE("TTFT P50 with the yield times 0.75 / 1.5: " << share_yield.ttft_s.p50 * 1e3 << " / "
                                                       << more_yield.ttft_s.p50 * 1e3 << " ms");
  CHECK(share_yield.ttft_s.p50 > unscaled.ttft_s.p50);
  CHECK(more_yield.ttft_s.p50 > share_yield.ttft_s.p50 * 1.05);
  // With the attention part priced apart, reserve_prefill_attention_yield replaces
  // concurrent_prefill_attention_yield beside a partition only: a prefill losing the whole of
  // each decode step's attention there is slower than one losing none of it; on streams the
  // key changes nothing.
  sim_options by_part = yielding;
  by_part.calibrations[streams.gpus[0].type].concurrent_prefill_attention_yield = 0.6;
  sim_options attention_all = by_part, attention_none = by_part;
  attention_all.calibrations[streams.gpus[0].type].reserve_prefill_attention_yield = 1.0;
  attention_none.calibrations[streams.gpus[0].type].reserve_prefill_attention_yield = 0.0;
  // Long contexts, so that attention is much of each decode step.
  const auto long_contexts =
      load_trace_spec("synthetic:poisson:rate=3,duration=30,in=6000,out=300,seed=11");
  auto simulate = [&](const auto& config, const auto& deployment, const sim_options& o) {
    return summarize(run_simulation(config, deployment, long_contexts, o).records);
  };
  const auto as_streams = simulate(reserve_config, reserve, by_part);
  const auto all_of_it = simulate(reserve_config, reserve, attention_all);
  const auto none_of_it = simulate(reserve_config, reserve, attention_none);
  const auto streams_by_part = simulate(streams_config, streams, by_part);
  const auto streams_none = simulate(streams_config, streams, attention_none);
  MESSAGE("TTFT P50, attention yield 0 / 0.6 / 1 beside the partition: "
          << none_of_it.ttft_s.p50 * 1e3 << " / " << as_streams.ttft_s.p50 * 1e3 << " / "
          << all_of_it.ttft_s.p50 * 1e3 << " ms");
  CHECK(all_of_it.ttft_s.p50 > as_streams.ttft_s.p50);
  CHECK(as_streams.ttft_s.p50 > none_of_it.ttft_s.p50);
  CHECK(all_of_it.ttft_s.p50 > none_of_it.ttft_s.p50 * 1.05);
  CHECK(streams_none.ttft_s.p50 == Approx(streams_by_part.ttft_s.p50));
  // Partitions below 1 must still fit the GPU.
  auto overfull = reserve_config;
  for (auto& a : overfull.nodes[0].actors) {
    if (a.role == actor_role::decode) a.sm_share = 0.5;
  }
  const auto overfull_deployment = deployment_from_config(overfull);
  CHECK_THROWS_WITH_AS(run_simulation(overfull, overfull_deployment, trace),
                       doctest::Contains("shares below 1 must sum to at most 1"),
                       std::invalid_argument);
}

TEST_CASE(
    "the decode delay beside a prefill step scales by the decode step's rows: the reserve_ keys "
    "(and the prefill's yield) beside a partition, concurrent_decode_delay_batch_scale on "
    "streams") {
  auto streams_config = one_gpu_own_streams();
  auto reserve_config = one_gpu_prefill_partition(0.75);
  const auto streams = deployment_from_config(streams_config);
  const auto reserve = deployment_from_config(reserve_config);
  // Few requests at a time: decode steps of 1-3 rows, each beside a prefill chunk.
  const auto trace =
      load_trace_spec("synthetic:poisson:rate=2,duration=30,in=2000,out=100,seed=11");
  gpu_calibration cal;
  cal.concurrent_decode_delay_s = 0.02;
  cal.concurrent_prefill_yield = 0.6;
  sim_options plain;
  plain.calibrations[streams.gpus[0].type] = cal;
  sim_options small_rows = plain;  // steps of up to 4 rows: half the delay, half the yield
  auto& scaled = small_rows.calibrations[streams.gpus[0].type];
  scaled.reserve_decode_delay_batch_scale.points = {{4, 0.5}, {64, 1}};
  scaled.reserve_prefill_yield_batch_scale.points = {{4, 0.5}, {64, 1}};
  sim_options large_rows = plain;  // the same keys from 64 rows on: these steps are far below
  auto& flat = large_rows.calibrations[streams.gpus[0].type];
  flat.reserve_decode_delay_batch_scale.points = {{64, 1}, {128, 0.5}};
  flat.reserve_prefill_yield_batch_scale.points = {{64, 1}, {128, 0.5}};
  auto simulate = [&](const auto& config, const auto& deployment, const sim_options& o) {
    const auto r = summarize(run_simulation(config, deployment, trace, o).records);
    REQUIRE(r.completed == trace.size());
    return r;
  };
  const auto unscaled = simulate(reserve_config, reserve, plain);
  const auto halved = simulate(reserve_config, reserve, small_rows);
  const auto untouched = simulate(reserve_config, reserve, large_rows);
  MESSAGE("beside the partition, ITL max / TTFT P50 ms: unscaled "
          << unscaled.itl_s.max * 1e3 << " / " << unscaled.ttft_s.p50 * 1e3 << ", halved "
          << halved.itl_s.max * 1e3 << " / " << halved.ttft_s.p50 * 1e3);
  // A step beside a chunk waits the whole 20 ms unscaled, half of it at these rows.
  CHECK(unscaled.itl_s.max >= 0.02);
  CHECK(halved.itl_s.max < unscaled.itl_s.max - 0.008);
  // The prefill loses less of each decode step: first tokens come sooner.
  CHECK(halved.ttft_s.p50 < unscaled.ttft_s.p50);
  // The curves' value at these rows is what counts: flat at 1 below 64 rows, nothing moves.
  CHECK(untouched.itl_s.max == Approx(unscaled.itl_s.max));
  CHECK(untouched.ttft_s.p50 == Approx(unscaled.ttft_s.p50));
  // On streams the keys change nothing.
  const auto streams_plain = simulate(streams_config, streams, plain);
  const auto streams_scaled = simulate(streams_config, streams, small_rows);
  CHECK(streams_scaled.itl_s.max == Approx(streams_plain.itl_s.max));
  CHECK(streams_scaled.ttft_s.p50 == Approx(streams_plain.ttft_s.p50));
  // Streams have a key of their own, which a partition ignores in turn.
  sim_options streams_small_rows = plain, streams_large_rows = plain;
  streams_small_rows.calibrations[streams.gpus[0].type]
      .concurrent_decode_delay_batch_scale.points = {{4, 0.5}, {64, 1}};
  streams_large_rows.calibrations[streams.gpus[0].type]
      .concurrent_decode_delay_batch_scale.points = {{64, 1}, {128, 0.5}};
  const auto streams_halved = simulate(streams_config, streams, streams_small_rows);
  const auto streams_untouched = simulate(streams_config, streams, streams_large_rows);
  MESSAGE("on streams, ITL max ms: unscaled " << streams_plain.itl_s.max * 1e3 << ", halved "
                                              << streams_halved.itl_s.max * 1e3);
  CHECK(streams_plain.itl_s.max >= 0.02);
  CHECK(streams_halved.itl_s.max < streams_plain.itl_s.max - 0.008);
  CHECK(streams_halved.itl_s.p99 < streams_plain.itl_s.p99);
  CHECK(streams_untouched.itl_s.max == Approx(streams_plain.itl_s.max));
  CHECK(streams_untouched.itl_s.p99 == Approx(streams_plain.itl_s.p99));
  const auto reserve_with_streams_key = simulate(reserve_config, reserve, streams_small_rows);
  CHECK(reserve_with_streams_key.itl_s.max == Approx(unscaled.itl_s.max));
  CHECK(reserve_with_streams_key.ttft_s.p50 == Approx(unscaled.ttft_s.p50));
}

TEST_CASE("a decode step waits out the delay beside a prefill step only for the part they overlap") {
  auto config = one_gpu_own_streams();
  const auto own = deployment_from_config(config);
  REQUIRE(own.gpus.size() == 1);
  const auto trace =
      load_trace_spec("synthetic:poisson:rate=3,duration=30,in=2000,out=100,seed=12");
  sim_options whole;
  gpu_calibration cal;
  cal.concurrent_decode_delay_s = 0.02;
  whole.calibrations[own.gpus[0].type] = cal;
  sim_options by_overlap = whole;
  by_overlap.calibrations[own.gpus[0].type].concurrent_decode_delay_by_overlap = true;
  const auto alone = summarize(run_simulation(config, own, trace).records);
  const auto full = summarize(run_simulation(config, own, trace, whole).records);
  const auto part = summarize(run_simulation(config, own, trace, by_overlap).records);
  REQUIRE(part.completed == trace.size());
  REQUIRE(full.completed == trace.size());
  MESSAGE("ITL mean / max: alone " << alone.itl_s.mean * 1e3 << " / " << alone.itl_s.max * 1e3
                                   << " ms, whole delay " << full.itl_s.mean * 1e3 << " / "
                                   << full.itl_s.max * 1e3 << " ms, by overlap "
                                   << part.itl_s.mean * 1e3 << " / " << part.itl_s.max * 1e3 << " ms");
  // Steps that start as a chunk ends wait less: the mean delay over alone shrinks...
  CHECK(part.itl_s.mean - alone.itl_s.mean < 0.9 * (full.itl_s.mean - alone.itl_s.mean));
  CHECK(part.itl_s.mean > alone.itl_s.mean);
  // ...while a step that starts with a chunk still waits the whole 20 ms, and never more.
  CHECK(part.itl_s.max >= 0.02 + alone.itl_s.p50);
  CHECK(part.itl_s.max <= full.itl_s.max + 1e-3);
}

TEST_CASE(
    "a prefill step starting during a decode step delays the rest of it and loses its yield of "
    "it (concurrent_overlap_on_prefill_start)") {
  auto config = one_gpu_own_streams();
  const auto own = deployment_from_config(config);
  REQUIRE(own.gpus.size() == 1);
  const auto trace =
      load_trace_spec("synthetic:poisson:rate=3,duration=30,in=2000,out=100,seed=12");
  sim_options second_only;
  gpu_calibration cal;
  cal.concurrent_decode_delay_s = 0.02;
  cal.concurrent_decode_delay_by_overlap = true;
  second_only.calibrations[own.gpus[0].type] = cal;
  sim_options both = second_only;
  both.calibrations[own.gpus[0].type].concurrent_overlap_on_prefill_start = true;
  sim_options both_yielding = both;
  both_yielding.calibrations[own.gpus[0].type].concurrent_prefill_yield = 0.5;
  sim_options second_yielding = second_only;
  second_yielding.calibrations[own.gpus[0].type].concurrent_prefill_yield = 0.5;
  const auto alone = summarize(run_simulation(config, own, trace).records);
  const auto before = summarize(run_simulation(config, own, trace, second_only).records);
  const auto after = summarize(run_simulation(config, own, trace, both).records);
  const auto before_y = summarize(run_simulation(config, own, trace, second_yielding).records);
  const auto after_y = summarize(run_simulation(config, own, trace, both_yielding).records);
  for (const auto* r : {&before, &after, &before_y, &after_y}) REQUIRE(r->completed == trace.size());
  MESSAGE("ITL mean / max: alone " << alone.itl_s.mean * 1e3 << " / " << alone.itl_s.max * 1e3
                                   << " ms, decode start only " << before.itl_s.mean * 1e3 << " / "
                                   << before.itl_s.max * 1e3 << " ms, prefill start too "
                                   << after.itl_s.mean * 1e3 << " / " << after.itl_s.max * 1e3
                                   << " ms; TTFT P50 with yield 0.5: " << before_y.ttft_s.p50 * 1e3
                                   << " -> " << after_y.ttft_s.p50 * 1e3 << " ms");
  // Decode steps that a chunk starts into now wait too (one chunk start per prompt here, against
  // a dozen decode steps starting during each chunk): more of the delay reaches the gaps...
  CHECK(after.itl_s.mean > before.itl_s.mean);
  // ...and a step that began beside one chunk and sees the next start waits for both, never more.
  CHECK(after.itl_s.max > before.itl_s.max);
  CHECK(after.itl_s.max <= alone.itl_s.max + 2 * 0.02 + 1e-3);
  // ...and without a yield the prefill steps are as long as before, so TTFT moves only through
  // the decode steps' later ends (the broker's ack), while with one the prefill loses time too.
  CHECK(after_y.ttft_s.p50 > before_y.ttft_s.p50);
  CHECK(after_y.ttft_s.p50 - before_y.ttft_s.p50 > after.ttft_s.p50 - before.ttft_s.p50);
}

TEST_CASE(
    "on a split GPU a decode step runs split_decode_slowdown times as long while the other "
    "share's prefill step is in flight, and only then") {
  const auto config = one_gpu_split_60_40();
  const auto split = deployment_from_config(config);
  REQUIRE(split.workers.size() == 2);
  for (const auto& w : split.workers) CHECK(w.sm_share < 1.0);
  // Prompts of 4,000 tokens (two chunks) twice a second: a request decodes beside the
  // next ones' prefill steps for part of its life and alone for the rest.
  const auto trace =
      load_trace_spec("synthetic:poisson:rate=2,duration=40,in=4000,out=200,seed=15");
  const auto alone = run_simulation(config, split, trace);
  sim_options contended;
  contended.calibrations[split.gpus[0].type].split_decode_slowdown = 1.5;
  const auto slowed = run_simulation(config, split, trace, contended);
  const auto a = summarize(alone.records), b = summarize(slowed.records);
  REQUIRE(a.completed == trace.size());
  REQUIRE(b.completed == trace.size());
  // The share of gaps over 1.3 times the typical one alone: steps that ran beside a chunk.
  const auto share_over = [](const sim_result& r, double limit) {
    size_t over = 0, all = 0;
    for (const auto& rec : r.records) {
      for (double gap : rec.itl_s) over += gap > limit, ++all;
    }
    return double(over) / double(std::max<size_t>(all, 1));
  };
  const double typical = a.itl_s.p50;
  MESSAGE("ITL P50 / P90 / max ms: shares apart " << a.itl_s.p50 * 1e3 << " / " << a.itl_s.p90 * 1e3
          << " / " << a.itl_s.max * 1e3 << ", slowed beside prefill " << b.itl_s.p50 * 1e3 << " / "
          << b.itl_s.p90 * 1e3 << " / " << b.itl_s.max * 1e3 << "; gaps over 1.3x P50 "
          << share_over(alone, 1.3 * typical) << " -> " << share_over(slowed, 1.3 * typical));
  // Prefill's share is untouched: the first tokens come as before.
  CHECK(b.ttft_s.p50 * 1e3 == Approx(a.ttft_s.p50 * 1e3).epsilon(1e-6));
  CHECK(b.ttft_s.p99 * 1e3 == Approx(a.ttft_s.p99 * 1e3).epsilon(1e-6));
  // Steps inside a chunk take 1.5 times as long, others as long as before...
  CHECK(share_over(slowed, 1.3 * typical) > share_over(alone, 1.3 * typical) + 0.05);
  CHECK(b.itl_s.mean > 1.03 * a.itl_s.mean);
  CHECK(b.itl_s.min * 1e3 == Approx(a.itl_s.min * 1e3).epsilon(0.02));
  // ...and none much more than 1.5 times the longest alone (slower steps batch a little more).
  CHECK(b.itl_s.max > 1.3 * a.itl_s.max);
  CHECK(b.itl_s.max < 1.6 * a.itl_s.max);
  // Without the key the two shares do not interact: the same run as with none.
  sim_options unit_slowdown;
  unit_slowdown.calibrations[split.gpus[0].type].split_decode_slowdown = 1.0;
  const auto same = summarize(run_simulation(config, split, trace, unit_slowdown).records);
  CHECK(same.itl_s.mean == Approx(a.itl_s.mean).epsilon(1e-9));
}

TEST_CASE("a simulated split GPU runs each share on the SMs its green context would get") {
  // 0.75 of an H200's 132 SMs is 96 SMs, as 0.7 is: the two deployments price alike, and the
  // prefill share 0.75 runs slower than its configured share would.
  auto config = one_gpu_split_60_40();
  const auto trace = load_trace_spec("synthetic:poisson:rate=2,duration=20,in=3000,out=50,seed=4");
  auto with_prefill_share = [&](double share) {
    for (auto& node : config.nodes) {
      for (auto& a : node.actors) {
        if (a.role == actor_role::prefill) a.sm_share = share;
        if (a.role == actor_role::decode) a.sm_share = 1 - share;
      }
    }
    return run_simulation(config, deployment_from_config(config), trace);
  };
  const auto at_70 = with_prefill_share(0.7), at_75 = with_prefill_share(0.75);
  REQUIRE(at_70.records.size() == trace.size());
  CHECK(at_70.counters.at("prefill.hop_step_us") == at_75.counters.at("prefill.hop_step_us"));
  CHECK(summarize(at_70.records).ttft_s.p50 == summarize(at_75.records).ttft_s.p50);
  const auto& lines = at_75.worker_lines;
  REQUIRE_FALSE(lines.empty());
  CHECK(std::any_of(lines.begin(), lines.end(),
                    [](const std::string& l) { return contains(l, "SM share 0.73 (96 of 132 SMs)"); }));
}

TEST_CASE(
    "on a split GPU a prefill step runs split_prefill_slowdown times as long while the other "
    "share's decode step is in flight, and only then") {
  const auto config = one_gpu_split_60_40();
  const auto split = deployment_from_config(config);
  // Prompts of 4,000 tokens twice a second, each decoding 200 tokens: the decode share is busy
  // most of the time, not all of it (the first request's chunks run beside nothing).
  const auto trace =
      load_trace_spec("synthetic:poisson:rate=2,duration=40,in=4000,out=200,seed=15");
  const auto alone = run_simulation(config, split, trace);
  sim_options contended;
  // A curve by the prefill share: 1.5 at this one (0.6), whatever it says at others.
  contended.calibrations[split.gpus[0].type].split_prefill_slowdown.points = {{0.6, 1.5}, {0.9, 3.0}};
  const auto slowed = run_simulation(config, split, trace, contended);
  const auto a = summarize(alone.records), b = summarize(slowed.records);
  REQUIRE(a.completed == trace.size());
  REQUIRE(b.completed == trace.size());
  const auto mean_prefill_step = [](const sim_result& r) {
    return double(r.counters.at("prefill.hop_step_us")) / double(r.counters.at("prefill.hop_step_count"));
  };
  const double step_alone = mean_prefill_step(alone), step_slowed = mean_prefill_step(slowed);
  MESSAGE("prefill step ms: shares apart " << step_alone / 1e3 << ", slowed beside decode " << step_slowed / 1e3
          << "; TTFT P50 " << a.ttft_s.p50 * 1e3 << " -> " << b.ttft_s.p50 * 1e3 << " ms");
  // Steps beside decode take up to 1.5 times as long; some ran with decode idle.
  CHECK(step_slowed > 1.1 * step_alone);
  CHECK(step_slowed < 1.5 * step_alone);
  CHECK(b.ttft_s.p50 > a.ttft_s.p50 * 1.1);
  // Without the key the two shares do not interact: the same run as with none.
  sim_options unit_slowdown;
  unit_slowdown.calibrations[split.gpus[0].type].split_prefill_slowdown.points = {{0.6, 1.0}};
  const auto same = run_simulation(config, split, trace, unit_slowdown);
  CHECK(mean_prefill_step(same) == Approx(step_alone).epsilon(1e-9));
}

TEST_CASE(
    "a decode step costs as the CUDA graph it replays: its GEMMs on the bucket's rows, its "
    "attention, KV reads and host work on its own batch") {
  auto gpu = *find_gpu_spec("h200");
  const auto shape = *find_model_shape("r1-distill-llama-8b");
  gpu.calibration.gemm.points = {{1, 0.01}, {256, 0.5}};
  gpu.calibration.decode_sequence_overhead_s = 1e-5;
  const cost_model costs(shape, gpu);
  const uint64_t context = 129 * 1024;
  const auto own = costs.decode_parts(129, context), padded = costs.decode_parts(129, context, 160);
  const auto at160 = costs.decode_parts(160, context);
  CHECK(padded.linear_s == Approx(at160.linear_s).epsilon(1e-12));
  CHECK(padded.linear_s > own.linear_s);
  CHECK(padded.attention_s == Approx(own.attention_s).epsilon(1e-12));
  CHECK(padded.kv_s == Approx(own.kv_s).epsilon(1e-12));
  CHECK(padded.overhead_s == Approx(own.overhead_s).epsilon(1e-12));
  CHECK(costs.decode_seconds(129, context, 100) == Approx(costs.decode_seconds(129, context)));
  sim_engine engine(shape, gpu, "m", 8192, 16, 1.0, 1.0);
  CHECK(engine.graph_rows(129) == 129);  // no buckets: every batch its own
  engine.set_decode_graph_buckets(decode_graph_buckets(256, 32));
  CHECK(engine.graph_rows(129) == 160);
  CHECK(engine.graph_rows(160) == 160);
  CHECK(engine.graph_rows(20) == 32);
  engine.set_decode_graph_buckets(decode_graph_buckets(256, 0));
  CHECK(engine.graph_rows(129) == 256);
  CHECK(engine.graph_rows(300) == 300);  // beyond the last bucket: its own rows
  // The simulator prices a run as its engine ran: DUET_DECODE_BUCKET_STEP=0 (powers of two)
  // pads a batch of ~150 to 256 rows, where every 32 rows pads it to 160.
  auto config = default_config();
  config.engine.gpu = "h200";
  for (auto& node : config.nodes)
    for (auto& a : node.actors)
      if (a.role == actor_role::decode) {
        a.max_batch = 256;
        a.kv_blocks = 32768;
      }
  const auto d = deployment_from_config(config);
  const auto trace = load_trace_spec("synthetic:poisson:rate=30,duration=20,in=100,out=1000,seed=14");
  sim_options slow_gemms;  // GEMMs at 30 % of peak: a decode step at ~150 rows is compute-bound
  slow_gemms.calibrations["h200"].gemm.points = {{1, 0.3}};
  const auto every_32 = run_simulation(config, d, trace, slow_gemms);
  scoped_env pow2("DUET_DECODE_BUCKET_STEP", "0");
  const auto powers = run_simulation(config, d, trace, slow_gemms);
  REQUIRE(summarize(every_32.records).completed == trace.size());
  REQUIRE(summarize(powers.records).completed == trace.size());
  const auto mean = [](const auto& r, const char* sum, const char* count) {
    return double(r.counters.at(sum)) / double(r.counters.at(count));
  };
  const double batch = mean(every_32, "decode.batched_sequences", "decode.steps");
  const double step_32 = mean(every_32, "decode.hop_step_us", "decode.hop_step_count") / 1e3;
  const double step_pow2 = mean(powers, "decode.hop_step_us", "decode.hop_step_count") / 1e3;
  MESSAGE("mean decode step: graphs every 32 rows " << step_32 << " ms, powers of two "
          << step_pow2 << " ms; mean decode batch " << batch);
  CHECK(batch > 129);
  CHECK(step_pow2 > 1.03 * step_32);
}

TEST_CASE(
    "the chunk-size factors scale the prefill yield (up to the whole decode step), the decode "
    "slowdown (at least 1) and the decode delay at the tokens of the prefill step in flight") {
  auto config = one_gpu_own_streams();
  const auto trace =
      load_trace_spec("synthetic:poisson:rate=3,duration=30,in=2000,out=100,seed=13");
  const auto run = [&](const deployment_config& c, const gpu_calibration& cal) {
    const auto d = deployment_from_config(c);
    REQUIRE(d.gpus.size() == 1);
    sim_options o;
    o.calibrations[d.gpus[0].type] = cal;
    const auto s = summarize(run_simulation(c, d, trace, o).records);
    REQUIRE(s.completed == trace.size());
    return s;
  };
  const auto same = [](const auto& a, const auto& b) {
    return a.ttft_s.p50 == b.ttft_s.p50 && a.ttft_s.p99 == b.ttft_s.p99 &&
           a.itl_s.p50 == b.itl_s.p50 && a.itl_s.p99 == b.itl_s.p99;
  };
  gpu_calibration base;
  base.concurrent_decode_delay_s = 0.02;
  base.concurrent_decode_delay_by_overlap = true;
  base.concurrent_prefill_yield = 0.4;
  // A flat factor is the yield scaled...
  auto scaled = base;
  scaled.concurrent_prefill_yield_scale.points = {{1, 1.5}};
  auto plain = base;
  plain.concurrent_prefill_yield = 0.6;
  const auto yield_scaled = run(config, scaled), yield_plain = run(config, plain);
  CHECK(same(yield_scaled, yield_plain));
  CHECK(yield_scaled.ttft_s.p50 > run(config, base).ttft_s.p50);
  // ...up to the whole step: 0.4 times 5 is 1.
  scaled.concurrent_prefill_yield_scale.points = {{1, 5.0}};
  plain.concurrent_prefill_yield = 1.0;
  CHECK(same(run(config, scaled), run(config, plain)));
  // The decode slowdown the same way, and never below 1.
  auto slowed = base;
  slowed.concurrent_decode_slowdown_scale.points = {{1, 1.2}};
  auto slowed_plain = base;
  slowed_plain.concurrent_decode_slowdown = 1.2;
  const auto slowdown_scaled = run(config, slowed);
  CHECK(same(slowdown_scaled, run(config, slowed_plain)));
  CHECK(slowdown_scaled.itl_s.p50 > run(config, base).itl_s.p50);
  slowed_plain.concurrent_decode_slowdown_scale.points = {{1, 0.5}};  // 1.2 · 0.5 is 1
  CHECK(same(run(config, slowed_plain), run(config, base)));
  // The delay factor is read at the prefill step's tokens: 0.25 up to 600, 1 from 601. With
  // 512-token chunks every step is at most 512 tokens, so it is the delay times 0.25.
  auto keyed = base;
  keyed.concurrent_decode_delay_scale.points = {{600, 0.25}, {601, 1.0}};
  auto quarter = base;
  quarter.concurrent_decode_delay_s = 0.005;
  auto small_chunks = config;
  for (auto& a : small_chunks.nodes[0].actors)
    if (a.role == actor_role::prefill) a.chunk_tokens = 512;
  const auto keyed_small = run(small_chunks, keyed), quarter_small = run(small_chunks, quarter);
  CHECK(same(keyed_small, quarter_small));
  CHECK(keyed_small.itl_s.p99 < run(small_chunks, base).itl_s.p99);
  // With 2,048-token chunks the steps are longer than 600 tokens: the whole delay, not a quarter.
  const auto keyed_large = run(config, keyed), quarter_large = run(config, quarter);
  MESSAGE("ITL P99, 2,048-token chunks: factor by tokens " << keyed_large.itl_s.p99 * 1e3
          << " ms, a quarter of the delay " << quarter_large.itl_s.p99 * 1e3 << " ms");
  CHECK(keyed_large.itl_s.p99 > quarter_large.itl_s.p99 + 0.01);
}

namespace {

/// The default deployment with its prefill and decode workers on one H200, each on its own
/// stream (the default).
deployment_config one_h200_own_streams() {
  auto config = one_gpu_own_streams();
  config.engine.gpu = "h200";
  return config;
}

/// Its simulated deployment: one GPU, both workers on streams of their own.
sim_deployment own_streams_deployment(const deployment_config& config) {
  auto d = deployment_from_config(config);
  REQUIRE(d.gpus.size() == 1);
  for (const auto& w : d.workers) REQUIRE(w.own_stream);
  return d;
}

/// Flat GEMM and attention efficiencies, so a reference is a few lines of arithmetic.
gpu_calibration flat_calibration() {
  gpu_calibration cal;
  cal.gemm.points = {{1, 0.5}};
  cal.attention.points = {{1, 0.25}};
  return cal;
}

}  // namespace

TEST_CASE(
    "on streams of their own, a decode step beside a prefill chunk waits longer the more of the "
    "chunk's time goes to long attention blocks: a prompt's second chunk holds decode back 1.7 "
    "times as long as its first") {
  const auto config = one_h200_own_streams();
  const auto d = own_streams_deployment(config);
  auto cal = flat_calibration();
  const double delay = 0.010, tile_keys = 1000;
  cal.concurrent_decode_delay_s = delay;
  cal.concurrent_decode_tile_keys = tile_keys;
  sim_options o;
  o.calibrations["h200"] = cal;
  auto gpu = *find_gpu_spec("h200");
  gpu.calibration = cal;
  const auto shape = *find_model_shape(config.model.preset);
  const cost_model costs(shape, gpu);
  // The delay factor of a 2048-token chunk after `prior` cached tokens, by hand: GEMM time
  // 2·P·t / (F·0.5), attention time 4·L·H·d·Σk / (F·0.25) for the keys k = prior + 1 ..
  // prior + t its rows read; an attention block over Σk²/Σk keys lasts that / 1000 ·
  // (0.5 / 0.25) GEMM tiles.
  auto factor = [&](double prior) {
    const double t = 2048, flops = gpu.bf16_flops;
    double sum = 0, squares = 0;
    for (double k = prior + 1; k <= prior + t; ++k) {
      sum += k;
      squares += k * k;
    }
    const double gemm_s = 2.0 * double(shape.linear_params()) * t / (flops * 0.5);
    const double per_pair = 4.0 * shape.layers * shape.heads * shape.head_dim;
    const double attention_s = per_pair * sum / (flops * 0.25);
    const double block = squares / sum / tile_keys * (0.5 / 0.25);
    return (gemm_s + block * attention_s) / (gemm_s + attention_s);
  };
  const double first = delay * factor(0), second = delay * factor(2048);
  MESSAGE("decode delay beside the first chunk " << first * 1e3 << " ms, the second "
                                                 << second * 1e3 << " ms (the constant model: "
                                                 << delay * 1e3 << ")");
  REQUIRE(first > 1.1 * delay);
  REQUIRE(second > 1.7 * first);

  // A (100 tokens) decodes alone; B's 4096-token prompt prefills in two chunks meanwhile.
  const std::vector<trace_request> trace = {request_at(0, 100, 200), request_at(0.05, 4096, 2)};
  const auto r = run_simulation(config, d, trace, o);
  for (const auto& rec : r.records) REQUIRE(rec.succeeded());
  const auto& a = r.records[0];
  const double b_first = *r.records[1].first_token_s;
  // Every gap of A before B joins its batch is one decode step (batch 1, context 101 + i: gap
  // i ends decode step i + 1) plus nothing, the first chunk's delay or the second's.
  auto ns = [](double s) { return std::floor(s * 1e9) / 1e9; };  // the sim engine's truncation
  uint32_t plain = 0, beside_first = 0, beside_second = 0, other = 0;
  double t = *a.first_token_s;
  for (size_t i = 0; i < a.itl_s.size(); ++i) {
    t += a.itl_s[i];
    if (t >= b_first) break;
    if (i == 0) continue;  // the first gap starts at the router's first token
    const double excess = a.itl_s[i] - ns(costs.decode_seconds(1, 101 + i));
    if (std::abs(excess) < 1e-8)
      ++plain;
    else if (std::abs(excess - first) < 1e-8)
      ++beside_first;
    else if (std::abs(excess - second) < 1e-8)
      ++beside_second;
    else
      ++other;
  }
  MESSAGE("A's gaps before B joins: " << plain << " plain, " << beside_first
                                      << " beside the first chunk, " << beside_second
                                      << " beside the second, " << other << " other");
  CHECK(plain > 10);
  CHECK(beside_first >= 3);
  CHECK(beside_second >= 2);
  CHECK(other == 0);
  // Without the key the delay is the same beside either chunk (the model before).
  o.calibrations["h200"].concurrent_decode_tile_keys.reset();
  const auto flat = run_simulation(config, d, trace, o);
  CHECK(*std::max_element(flat.records[0].itl_s.begin() + 1, flat.records[0].itl_s.end()) <
        ns(costs.decode_seconds(2, 4096 + 300)) + delay + 1e-6);
}

TEST_CASE(
    "on streams of their own, a prefill step loses concurrent_prefill_attention_yield of the "
    "attention share of each decode step that starts during it, concurrent_prefill_yield of the "
    "rest") {
  const auto config = one_h200_own_streams();
  const auto d = own_streams_deployment(config);
  // Flat efficiencies, no decode delay: a prefill step is pushed back by the yields alone.
  auto cal = flat_calibration();
  cal.memory.points = {{1, 0.8}};
  const double rest = 0.5, attention = 1.0;
  cal.concurrent_prefill_yield = rest;
  cal.concurrent_prefill_attention_yield = attention;
  auto gpu = *find_gpu_spec("h200");
  gpu.calibration = cal;
  const auto shape = *find_model_shape(config.model.preset);
  const cost_model costs(shape, gpu);
  sim_options o;
  o.calibrations["h200"] = cal;
  const int64_t h = 50'000;  // one hop, ns
  auto ns = [](double s) { return static_cast<int64_t>(std::floor(s * 1e9)); };
  // A (2,000 tokens) decodes alone; B (1,000) prefills in one chunk meanwhile, from 2 hops after
  // it arrives, halfway through A's 5th decode step. A's decode step k holds C = 2000 + k tokens,
  // memory-bound: its attention share is its KV bytes over all it reads.
  const int64_t pa = ns(costs.prefill_seconds(2000, costs.chunk_attention_flops(2000, 0)));
  const int64_t pb = ns(costs.prefill_seconds(1000, costs.chunk_attention_flops(1000, 0)));
  auto step = [&](int k) { return ns(costs.decode_seconds(1, 2000 + k)); };
  auto share = [&](int k) {
    const double kv = double(shape.kv_bytes_per_token()) * (2000 + k);
    return kv / (double(shape.weight_bytes()) + kv);
  };
  const int64_t d1 = 2 * h + pa + 6 * h;  // A's first decode step starts
  int64_t start5 = d1;
  for (int k = 1; k < 5; ++k) start5 += step(k);
  const int64_t tb = start5 + step(5) / 2 - 2 * h;
  // B's step ends after its chunk and, for every decode step k of A that starts before then,
  // y_k · that step's work, y_k = rest + (attention − rest) · share(k) (the old model: y_k = rest).
  auto b_ttft = [&](bool by_share) {
    int64_t end = tb + 2 * h + pb, s = d1;
    for (int k = 1; s < end; s += step(k), ++k) {
      if (s < tb + 2 * h) continue;
      const double y = by_share ? rest + (attention - rest) * share(k) : rest;
      end += static_cast<int64_t>(y * double(step(k)));
    }
    return double(end + 4 * h - tb) * 1e-9;
  };
  MESSAGE("attention share of A's decode steps " << share(6) << "; B's TTFT " << b_ttft(true) * 1e3
                                                 << " ms (the single yield: " << b_ttft(false) * 1e3
                                                 << ")");
  REQUIRE(b_ttft(true) - b_ttft(false) > 50e-6);
  const std::vector<trace_request> trace = {request_at(0, 2000, 60),
                                            request_at(double(tb) * 1e-9, 1000, 2)};
  const auto r = run_simulation(config, d, trace, o);
  for (const auto& rec : r.records) REQUIRE(rec.succeeded());
  CHECK(*r.records[0].ttft_s() == Approx(double(6 * h + pa) * 1e-9).epsilon(1e-9));
  CHECK(*r.records[1].ttft_s() == Approx(b_ttft(true)).epsilon(1e-7));
  // Without the key, the whole step loses concurrent_prefill_yield of it (the model before).
  o.calibrations["h200"].concurrent_prefill_attention_yield.reset();
  const auto old = run_simulation(config, d, trace, o);
  CHECK(*old.records[1].ttft_s() == Approx(b_ttft(false)).epsilon(1e-7));
}

namespace {
/// 1P1D on H200s with free transfers: A (1,000 tokens) decodes alone, and B's prompt (500
/// tokens, arriving at tb) ends its prefill halfway through A's 5th decode step.
struct handover_mid_step {
  static double ns(double s) { return std::floor(s * 1e9) / 1e9; }  // the sim's whole ns
  deployment_config config = [] {
    auto c = default_config();
    c.engine.gpu = "h200";
    return c;
  }();
  sim_deployment d = [] {
    auto one = one_p_one_d("h200");  // prefill on one GPU, decode on the other
    one.link = link_kind::same_gpu;  // no transfer time
    return one;
  }();
  cost_model costs{*find_model_shape(config.model.preset), *find_gpu_spec("h200")};
  double h = 50e-6;  // one hop
  double pb = ns(costs.prefill_seconds(500, costs.chunk_attention_flops(500, 0)));
  double tb = [this] {
    const double pa = ns(costs.prefill_seconds(1000, costs.chunk_attention_flops(1000, 0)));
    double end4 = 2 * h + pa + 6 * h;  // A's first decode step starts
    for (int k = 1; k <= 4; ++k) end4 += ns(costs.decode_seconds(1, 1000 + k));
    return end4 + ns(costs.decode_seconds(1, 1005)) / 2 - pb - 2 * h;
  }();
};
}  // namespace

TEST_CASE(
    "a worker whose engine computes in its actor's step (DUET_DECODE_THREAD=0, "
    "DUET_PREFILL_THREAD=0) reads its messages only when the step returns: a sequence adopted "
    "during a decode step joins the batch two steps later, and a prompt that arrives during a "
    "prefill step waits in the mailbox; on step threads (the default) neither waits") {
  const handover_mid_step m;
  auto config = m.config;
  const auto& d = m.d;
  const double h = m.h, pb = m.pb, tb = m.tb;
  // C arrives halfway through B's prefill step.
  const double tc = tb + 2 * h + pb / 2 - 2 * h;
  const std::vector<trace_request> trace = {request_at(0, 1000, 20), request_at(tb, 500, 3),
                                            request_at(tc, 300, 2)};
  // Which of A's decode steps (1, 2, ...) B's first decode step is: the step whose token reached
  // the client with B's second token.
  auto joined = [&](const sim_result& r) {
    const auto& a = r.records[0];
    const auto& b = r.records[1];
    const double b_second = *b.first_token_s + b.itl_s.at(0);
    double t = *a.first_token_s;
    for (size_t i = 0; i < a.itl_s.size(); ++i) {
      t += a.itl_s[i];
      if (std::abs(t - b_second) < 1e-9) return int(i) + 1;
    }
    return -1;
  };
  const auto timers = run_simulation(config, d, trace);  // the sim engine: messages flow
  config.engine.kind = "cuda";
  const auto threads = run_simulation(config, d, trace);  // steps on the workers' step threads
  const auto in_step = [&] {
    scoped_env inline_prefill("DUET_PREFILL_THREAD", "0");
    scoped_env inline_decode("DUET_DECODE_THREAD", "0");
    return run_simulation(config, d, trace);
  }();
  for (const auto* r : {&timers, &threads, &in_step}) {
    for (const auto& rec : r->records) REQUIRE(rec.succeeded());
  }
  // The sim engine: B's adoption (router, decode, broker and back: a few hops) completes within
  // A's 5th step, so B joins the 6th; so it does beside a step thread. In the step: the adopt
  // waits for the 5th to return, the pull goes out, and kv_moved waits out the 6th.
  CHECK(joined(timers) == 6);
  CHECK(joined(threads) == 6);
  CHECK(joined(in_step) == 7);
  // C reached the prefill worker during B's step: only in the step did it wait, until the step
  // returned.
  CHECK(timers.counters.at("prefill.hop_inbox_us") == 0);
  CHECK(threads.counters.at("prefill.hop_inbox_us") == 0);
  const double c_waited = (tb + 2 * h + pb) - (tc + 2 * h);
  const double inbox_s = double(in_step.counters.at("prefill.hop_inbox_us")) * 1e-6;
  CHECK(c_waited > 2e-3);
  CHECK(std::abs(inbox_s - c_waited) <= 1e-3);  // the cores' clock counts whole milliseconds
  // No message is lost or reordered: every request gets all its tokens either way.
  for (const auto* r : {&threads, &in_step}) {
    CHECK(r->records[0].output_tokens == 20);
    CHECK(r->records[1].output_tokens == 3);
    CHECK(r->records[2].output_tokens == 2);
  }
}

TEST_CASE(
    "with router.first_token = \"decode\" a request's first token leaves when its first decode "
    "step starts: its second token comes exactly as before, its first one step before it") {
  const handover_mid_step m;
  auto config = m.config;
  const auto& d = m.d;
  const auto ns = handover_mid_step::ns;
  const cost_model& costs = m.costs;
  const std::vector<trace_request> trace = {request_at(0, 1000, 20), request_at(m.tb, 500, 3)};
  for (const std::string kind : {"sim", "cuda"}) {
    CAPTURE(kind);
    config.engine.kind = kind;
    config.router.first_token = "prefill";
    const auto from_prefill = run_simulation(config, d, trace);
    config.router.first_token = "decode";
    const auto from_decode = run_simulation(config, d, trace);
    for (const auto* r : {&from_prefill, &from_decode}) {
      for (const auto& rec : r->records) REQUIRE(rec.succeeded());
      CHECK(r->records[1].output_tokens == 3);
    }
    const auto& a = from_decode.records[0];
    const auto& b = from_decode.records[1];
    const auto& b_before = from_prefill.records[1];
    // B's second token: unchanged (it joins A's 6th step either way).
    CHECK(*b.first_token_s + b.itl_s.at(0) == Approx(*b_before.first_token_s + b_before.itl_s.at(0)).epsilon(1e-12));
    // Its first: at the start of that step, so the gap is the step, as A's gaps are.
    CHECK(b.itl_s.at(0) == Approx(a.itl_s.at(5)).epsilon(1e-9));
    CHECK(b_before.itl_s.at(0) > 1.3 * a.itl_s.at(5));  // from mid-step 5 to the end of step 6
    CHECK(*b.first_token_s > *b_before.first_token_s + 0.3 * a.itl_s.at(4));
    // A's first token came before any decode step existed: it too waited for step 1's start.
    CHECK(*a.first_token_s > *from_prefill.records[0].first_token_s);
    CHECK(a.itl_s.at(0) == Approx(ns(costs.decode_seconds(1, 1001))).epsilon(1e-6));
  }
}

TEST_CASE(
    "on one shared stream a prompt's prefill step waits for the decode step ahead of it and, "
    "having sampled its first token, for the decode step queued behind it; decode enqueues "
    "first after both return") {
  auto config = default_config();
  config.engine.gpu = "h200";
  for (auto& a : config.nodes[0].actors) {
    a.device = 0;
    a.stream = "shared";
  }
  const auto d = deployment_from_config(config);
  REQUIRE(d.gpus.size() == 1);
  CHECK(d.policy == step_policy::stream);
  const auto shape = *find_model_shape(config.model.preset);
  const cost_model costs(shape, *find_gpu_spec("h200"));
  auto ns = [](double s) { return std::floor(s * 1e9) / 1e9; };  // the sim engine's truncation
  auto prefill = [&](uint32_t n) {
    return ns(costs.prefill_seconds(n, costs.chunk_attention_flops(n, 0)));
  };
  auto decode_a = [&](uint32_t k) { return ns(costs.decode_seconds(1, 1000 + k)); };  // A's step k
  sim_options o;
  o.hop_s = 50e-6;
  const double h = o.hop_s;
  // A (1000 tokens) decodes alone; B (500) reaches the prefill worker halfway through A's third
  // decode step D3; C (300) arrives while B's chunk computes.
  const double pa = prefill(1000), pb = prefill(500), pc = prefill(300);
  const double a_done = 2 * h + pa;      // A's prefill step ends (nothing queued behind it)
  const double d1_start = a_done + 6 * h;  // register, ack, prefill_done, adopt, pull, moved
  const double d3_end = d1_start + decode_a(1) + decode_a(2) + decode_a(3);
  const double tb = d3_end - decode_a(3) / 2 - 2 * h;
  const double tc = d3_end + pb / 2;
  const std::vector<trace_request> trace = {request_at(0, 1000, 40), request_at(tb, 500, 3),
                                            request_at(tc, 300, 2)};

  // B's chunk was enqueued behind D3 and D4 was enqueued behind it: B's step returns when D4
  // does (D4 is A alone: B is not adopted yet). That is the release.
  const double release = d3_end + pb + decode_a(4);
  const double b_ttft = release + 4 * h - tb;  // register, ack, prefill_done, first token
  // At the release decode enqueues D5 (still A alone) first; C's chunk goes behind it; B joins
  // at D6 (adopted 6 hops after the release, well within D5), which C's second sync waits for.
  const double d5 = decode_a(5);
  const double d6 = ns(costs.decode_seconds(2, (1000 + 6) + (500 + 1)));
  const double c_ttft = release + d5 + pc + d6 + 4 * h - tc;

  SUBCASE("with the model's own step times") {
    const auto r = run_simulation(config, d, trace, o);
    for (const auto& rec : r.records) REQUIRE(rec.succeeded());
    CHECK(*r.records[0].ttft_s() == Approx(6 * h + pa).epsilon(1e-9));
    CHECK(*r.records[1].ttft_s() == Approx(b_ttft).epsilon(1e-9));
    CHECK(*r.records[2].ttft_s() == Approx(c_ttft).epsilon(1e-9));
    // A's gap across B's chunk is the chunk and D4, as when steps alternate whole.
    CHECK(r.records[0].itl_s[3] == Approx(pb + decode_a(4)).epsilon(1e-6));
    CHECK(r.counters.at("sim.stream_second_sync_waits") == 2);  // B's and C's steps
    // The old model (whole steps taking turns on one timeline) gives B's first token one
    // decode step earlier: its step ended with its own chunk.
    sim_deployment turns = d;
    turns.policy = step_policy::alternate;
    const auto old = run_simulation(config, turns, trace, o);
    CHECK(*old.records[1].ttft_s() == Approx(b_ttft - decode_a(4)).epsilon(1e-9));
  }
  SUBCASE("a calibrated delay holds the stream longer for every prefill step") {
    const double delay = 0.004;
    gpu_calibration cal;
    cal.shared_prefill_delay_s = delay;
    o.calibrations["h200"] = cal;
    // A's chunk holds the stream 4 ms longer, so everything after it starts 4 ms later: B and
    // C arrive 4 ms later too, at the same points of the decode steps.
    const std::vector<trace_request> later = {request_at(0, 1000, 40),
                                              request_at(tb + delay, 500, 3),
                                              request_at(tc + delay, 300, 2)};
    const auto r = run_simulation(config, d, later, o);
    for (const auto& rec : r.records) REQUIRE(rec.succeeded());
    CHECK(*r.records[0].ttft_s() == Approx(6 * h + pa + delay).epsilon(1e-9));
    CHECK(*r.records[1].ttft_s() == Approx(b_ttft + delay).epsilon(1e-9));
    // B's chunk, and with it the release, is 4 ms longer; then C's chunk is.
    CHECK(*r.records[2].ttft_s() == Approx(c_ttft + 2 * delay).epsilon(1e-9));
    CHECK(r.records[0].itl_s[3] == Approx(pb + delay + decode_a(4)).epsilon(1e-6));
  }
  SUBCASE("a decode step enqueued in the same instant as a chunk waits for the chunk's lead") {
    const double lag = 0.002;
    gpu_calibration cal;
    cal.shared_decode_lag_s.points = {{1, lag}, {256, lag}};
    o.calibrations["h200"] = cal;
    const auto r = run_simulation(config, d, trace, o);
    for (const auto& rec : r.records) REQUIRE(rec.succeeded());
    // At the release D5 and C's chunk are enqueued together: 2 ms of the chunk runs first, so
    // A's gap at D5 is 2 ms longer, and the chunk, C's first token and B's are not moved.
    CHECK(r.records[0].itl_s[4] == Approx(decode_a(5) + lag).epsilon(1e-6));
    CHECK(*r.records[1].ttft_s() == Approx(b_ttft).epsilon(1e-9));
    CHECK(*r.records[2].ttft_s() == Approx(c_ttft).epsilon(1e-9));
    CHECK(r.counters.at("sim.stream_decode_lags") == 1);
  }
  SUBCASE("a front end's time per request is in every TTFT and end-to-end time, no gap") {
    const double front_end = 0.003;
    const auto plain = run_simulation(config, d, trace, o);
    gpu_calibration cal;
    cal.front_end_s = front_end;
    o.calibrations["h200"] = cal;
    const auto r = run_simulation(config, d, trace, o);
    REQUIRE(r.records.size() == plain.records.size());
    for (std::size_t i = 0; i < r.records.size(); ++i) {
      REQUIRE(r.records[i].succeeded());
      CHECK(*r.records[i].ttft_s() == Approx(*plain.records[i].ttft_s() + front_end).epsilon(1e-9));
      CHECK(r.records[i].e2e_s() == Approx(plain.records[i].e2e_s() + front_end).epsilon(1e-9));
      REQUIRE(r.records[i].itl_s.size() == plain.records[i].itl_s.size());
      for (std::size_t g = 0; g < r.records[i].itl_s.size(); ++g)
        CHECK(r.records[i].itl_s[g] == Approx(plain.records[i].itl_s[g]).epsilon(1e-6));
    }
    CHECK(*r.records[1].ttft_s() == Approx(b_ttft + front_end).epsilon(1e-9));
  }
}

TEST_CASE("the front end shares its per-token work among the requests in it at once") {
  using std::vector;
  // Two jobs in together share the server: the short one leaves first, after twice its work.
  CHECK(processor_sharing_departures(vector<double>{0, 0}, vector<double>{1, 2}) ==
        vector<double>{2, 3});
  // One alone for a second, then two: each gets half the server until both are done.
  const auto later = processor_sharing_departures(vector<double>{0, 1}, vector<double>{2, 1});
  CHECK(later[0] == Approx(3));
  CHECK(later[1] == Approx(3));
  // A job of no work leaves as it comes; one arriving to an empty server takes its work.
  CHECK(processor_sharing_departures(vector<double>{0, 0.5, 5}, vector<double>{1, 0, 1}) ==
        vector<double>{1, 0.5, 6});
  // Arrivals out of order are taken in time order.
  CHECK(processor_sharing_departures(vector<double>{5, 0, 0}, vector<double>{1, 1, 2}) ==
        vector<double>{6, 2, 3});

  // A long prompt and a short one arrive together, the long one first in the trace: with the
  // front end's work per token the short one reaches the router first, after twice its share.
  auto config = default_config();
  config.engine.gpu = "h200";
  const auto d = parse_deployment_spec("1P1D", config, "h200");
  const double per_token = 1e-5;
  sim_options o;
  const auto alone =
      run_simulation(config, d, std::vector<trace_request>{request_at(0, 500, 2)}, o);
  const std::vector<trace_request> both = {request_at(0, 4000, 2), request_at(0, 500, 2)};
  const auto fifo = run_simulation(config, d, both, o);
  gpu_calibration cal;
  cal.front_end_token_s = per_token;
  o.calibrations["h200"] = cal;
  const auto shared = run_simulation(config, d, both, o);
  for (const auto& r : {std::cref(alone), std::cref(fifo), std::cref(shared)})
    for (const auto& rec : r.get().records) REQUIRE(rec.succeeded());
  CHECK(*fifo.records[1].ttft_s() > *fifo.records[0].ttft_s());
  CHECK(*shared.records[1].ttft_s() < *shared.records[0].ttft_s());
  CHECK(*shared.records[1].ttft_s() ==
        Approx(2 * 500 * per_token + *alone.records[0].ttft_s()).epsilon(1e-9));
}

TEST_CASE(
    "on one GPU, prefill chunks between decode steps raise the P99 inter-token gap far above "
    "1P1D's") {
  const auto config = default_config();
  const auto trace =
      load_trace_spec("synthetic:poisson:rate=2,duration=30,in=2000,out=100,seed=11");
  const auto coloc =
      run_simulation(config, parse_deployment_spec("colocated", config, "h20"), trace);
  const auto disagg = run_simulation(config, parse_deployment_spec("1P1D", config, "h20"), trace);
  const auto split =
      run_simulation(config, parse_deployment_spec("split:sm=0.5", config, "h20"), trace);
  const auto c = summarize(coloc.records), d = summarize(disagg.records),
             s = summarize(split.records);
  REQUIRE(c.completed == trace.size());
  REQUIRE(d.completed == trace.size());
  REQUIRE(s.completed == trace.size());
  MESSAGE("P99 ITL: colocated " << c.itl_s.p99 * 1e3 << " ms, 1P1D " << d.itl_s.p99 * 1e3
                                << " ms, split 50/50 " << s.itl_s.p99 * 1e3 << " ms");
  // A 2000-token prefill on an H20 takes ~0.25 s; a decode step of a few sequences ~5 ms.
  CHECK(c.itl_s.p99 > 10 * d.itl_s.p99);
  CHECK(c.itl_s.p99 > 0.2);
  CHECK(d.itl_s.p99 < 0.02);
  CHECK(c.itl_s.p50 < 0.02);  // most gaps are plain decode steps
  // Taking turns bounds a gap by one prefill step; letting every waiting prompt go first
  // stalls decode for several in a row when prompts queue.
  auto eager = parse_deployment_spec("colocated:policy=prefill_first", config, "h20");
  const auto e = summarize(run_simulation(config, eager, trace).records);
  MESSAGE("longest gap: alternate " << c.itl_s.max * 1e3 << " ms, prefill_first "
                                    << e.itl_s.max * 1e3 << " ms");
  CHECK(c.itl_s.max < 0.3);
  CHECK(e.itl_s.max > 0.45);
  CHECK(e.ttft_s.p99 <= c.ttft_s.p99);
  // Splitting the SMs removes the stalls but slows both sides.
  CHECK(s.itl_s.p99 < c.itl_s.p99 / 5);
  CHECK(s.ttft_s.p50 > d.ttft_s.p50);
}

TEST_CASE(
    "the planner ranks colocated, PD streams, SM splits, prefill partitions and xPyD by goodput "
    "per GPU under the SLO") {
  const auto config = default_config();
  const auto trace = load_trace_spec(
      "synthetic:poisson:rate=3,count=120,in=600,in_cv=0.5,out=60,out_cv=0.5,seed=2");
  plan_options o;
  o.gpu = "h20";
  o.gpu_budget = 3;
  o.slo = parse_slo("ttft=1s,tpot=40ms");
  o.sm_shares = {0.4, 0.6};
  o.reserve_shares = {0.7};
  o.search_steps = 3;
  o.jobs = 2;
  const auto ranked = plan_deployments(config, trace, o);
  // colocated, streams, two splits, one partition, 1P1D, 1P2D, 2P1D
  REQUIRE(ranked.size() == 1 + 1 + 2 + 1 + 3);
  for (size_t i = 1; i < ranked.size(); ++i)
    CHECK(ranked[i - 1].goodput_per_gpu >= ranked[i].goodput_per_gpu);
  for (const auto& e : ranked) {
    CAPTURE(e.deployment.name);
    CHECK(e.simulations >= 2);
    if (e.goodput > 0) {
      CHECK(e.attainment >= 0.9);
      CHECK(e.goodput_per_gpu == Approx(e.goodput / e.gpus));
      CHECK(e.replicas == 3 / e.gpus);
    }
  }
  CHECK(ranked.front().goodput > 0);
  const auto table = format_plan_table(ranked, o, 3.0);
  CHECK(contains(table, "colocated"));
  CHECK(contains(table, "1P2D"));
  CHECK(contains(table, "streams"));
  CHECK(contains(table, "reserve 70"));
  CHECK(contains(table, "split 40/60"));
}

TEST_CASE(
    "duet sim and duet plan write summary.json, requests.csv and report.html with every "
    "deployment") {
  const auto dir = scratch_dir("cli");
  const std::string trace = "synthetic:poisson:rate=4,count=60,in=500,out=40,seed=1";
  CHECK(
      run_duet({"sim", "--trace", trace, "--out", (dir / "sim").string(), "--deployment",
                "colocated", "--deployment", "1P1D", "--gpu", "h20", "--slo", "ttft=1s,tpot=50ms"},
               120s) == 0);
  for (const char* f : {"summary.json", "requests.csv", "report.html"})
    CHECK(fs::exists(dir / "sim" / f));
  const auto summary = nlohmann::json::parse(read_all(dir / "sim" / "summary.json"));
  CHECK(summary["runs"].size() == 2);
  CHECK(summary["simulation"]["runs"].size() == 2);
  CHECK(summary["simulation"]["runs"][0]["events"].get<uint64_t>() > 0);
  CHECK(summary["runs"][0]["summary"]["completed"].get<size_t>() == 60);
  CHECK(run_duet(
            {"plan", "--trace", trace, "--gpu", "h20", "--gpus", "2", "--slo", "ttft=1s,tpot=50ms",
             "--sm-shares", "0.5", "--reserve-shares", "none", "--out", (dir / "plan").string(),
             "--jobs", "2"},
            240s) == 0);
  const auto plan = nlohmann::json::parse(read_all(dir / "plan" / "summary.json"));
  CHECK(plan["simulation"]["plan"].size() == 4);  // colocated, streams, split 50/50, 1P1D
  CHECK(fs::exists(dir / "plan" / "report.html"));
  // Bad input is exit code 2 with a message, as for config errors.
  const auto bad = (dir / "bad").string();
  CHECK(run_duet({"sim", "--trace", trace, "--out", bad, "--deployment", "4Q2D"}, 30s) == 2);
  CHECK(run_duet({"sim", "--trace", "synthetic:poisson:rat=1", "--out", bad}, 30s) == 2);
  CHECK(run_duet({"plan", "--trace", trace, "--slo", "ttft=soon"}, 30s) == 2);
  CHECK(run_duet({"plan", "--trace", trace, "--slo", "ttft=1s", "--reserve-shares", "1.2"}, 30s) ==
        2);
  CHECK(run_duet({"sim", "--trace", trace, "--out", bad, "--speed-spread", "0.9"}, 30s) == 2);
  fs::remove_all(dir);
}

TEST_CASE("with_engine_speed scales the GEMM, attention and memory efficiencies, at most to 1") {
  const auto h200 = find_gpu_spec("h200");
  REQUIRE(h200);
  gpu_calibration cal;
  cal.gemm.points = {{256, 0.5}, {8192, 0.98}};
  cal.memory.points = {{1e10, 0.8}};
  cal.concurrent_decode_delay_s = 0.018;
  const auto faster = with_engine_speed(cal, *h200, 1.03);
  CHECK(faster.gemm.points[0].second == Approx(0.515));
  CHECK(faster.gemm.points[1].second == Approx(1.0));  // 1.0094 clamped
  CHECK(faster.memory.points[0].second == Approx(0.824));
  REQUIRE(faster.attention.points.size() == 1);  // empty: from the spec's default
  CHECK(faster.attention.points[0].second == Approx(std::min(1.0, h200->gemm_efficiency * 1.03)));
  CHECK(faster.concurrent_decode_delay_s == Approx(0.018));  // serving keys untouched
  const auto slower = with_engine_speed(cal, *h200, 0.97);
  CHECK(slower.gemm.points[1].second == Approx(0.9506));
}

TEST_CASE("duet sim --speed-spread simulates each deployment with a slower and a faster engine") {
  const auto dir = scratch_dir("speed");
  // Loaded enough that a 10 % slower engine queues prompts.
  const std::string trace = "synthetic:poisson:rate=12,count=240,in=2000,out=60,seed=4";
  CHECK(run_duet({"sim", "--trace", trace, "--out", dir.string(), "--gpu", "h20", "--slo",
                  "ttft=1s,tpot=50ms", "--speed-spread", "0.1"},
                 120s) == 0);
  const auto summary = nlohmann::json::parse(read_all(dir / "summary.json"));
  const auto& band = summary["simulation"]["runs"][0]["speed_band"];
  const auto& base = summary["runs"][0]["summary"];
  CHECK(band["spread"].get<double>() == Approx(0.1));
  const double slow = band["slower"]["ttft_p50_s"], fast = band["faster"]["ttft_p50_s"];
  const double mid = base["ttft_s"]["p50"];
  MESSAGE("TTFT P50 faster / base / slower: " << fast * 1e3 << " / " << mid * 1e3 << " / " << slow * 1e3 << " ms");
  CHECK(fast < mid);
  CHECK(mid < slow);
  CHECK(band["faster"]["itl_p50_s"].get<double>() < band["slower"]["itl_p50_s"].get<double>());
  fs::remove_all(dir);
}

// ------------------------------------------------------------------------ fidelity

/// Runs `trace` through a live one-node cluster built from `config`, returning its records;
/// `host_noise_p99_s` receives the host's P99 timer lateness during the run, in trace seconds.
std::vector<request_record> run_live_fidelity(const deployment_config& config,
                                              const std::string& endpoint,
                                              const std::vector<trace_request>& trace,
                                              double scale, double& host_noise_p99_s) {
  caf::actor_system_config cfg;
  duet::tune_actor_system(cfg);
  caf::actor_system system{cfg};
  node n(system, config, "fid");
  client c(endpoint, "fid/router");
  REQUIRE(testing::wait_ready(c, "fid/router", 10s));
  live_replay_options o;
  o.time_scale = scale;
  o.timeout = 90s;
  timer_noise noise;
  auto live = replay_live(c, trace, o);
  host_noise_p99_s = noise.stop_p99_s() / scale;
  n.stop();
  return live;
}

TEST_CASE(
    "the simulator agrees with a live cluster on the sim engine within 5% at P50 and P99 TTFT and "
    "ITL") {
  // One node in this process: router, broker, a prefill worker on device 0 and a decode
  // worker on device 1 (so the simulator models two GPUs, as the live actors behave).
  // Time scale: the live cluster waits `scale` times the modelled step, so its own costs
  // (sockets, mailboxes, timers, a busy host's late wake-ups) shrink relative to the steps.
  // The L40S model has the longest decode steps (~23 ms), hence the most step time per
  // second of test; outputs are capped so the slice drains quickly. DUET_FIDELITY_SCALE,
  // DUET_FIDELITY_SECONDS and DUET_FIDELITY_GPU run other checks by hand.
  const double scale = env_number("DUET_FIDELITY_SCALE", 6.0);
  const double seconds = env_number("DUET_FIDELITY_SECONDS", 3.0);
  const std::string gpu =
      std::getenv("DUET_FIDELITY_GPU") ? std::getenv("DUET_FIDELITY_GPU") : "l40s";
  std::vector<trace_request> trace;
  const auto azure = shared_traces / "AzureLLMInferenceTrace_conv_2023.csv";
  if (fs::exists(azure)) {
    trace = time_window(load_azure_csv(azure), 600, seconds);  // from minute 10 of the trace
  } else {
    trace = load_trace_spec("synthetic:gamma:rate=4,cv=2,duration=" + std::to_string(seconds) +
                            ",in=1000,in_cv=1,out=200,out_cv=1,in_max=4000,out_max=800,seed=3");
  }
  trace = clip_to_context(std::move(trace), 4096);
  for (auto& r : trace) r.output_tokens = std::min<uint32_t>(r.output_tokens, 160);
  REQUIRE(trace.size() >= 10);
  const std::string endpoint = "inproc://duet-fidelity-" + std::to_string(getpid());
  auto config = parse_config(R"([model]
preset = "r1-distill-llama-8b"
max_context = 4096
[engine]
kind = "sim"
gpu = ")" + gpu + R"("
time_scale = )" + std::to_string(scale) +
                                 R"(
[[nodes]]
name = "fid"
endpoint = ")" + endpoint + R"("
[[nodes.actors]]
name = "router"
role = "router"
[[nodes.actors]]
name = "broker"
role = "broker"
[[nodes.actors]]
name = "prefill0"
role = "prefill"
device = 0
kv_blocks = 8192
[[nodes.actors]]
name = "decode0"
role = "decode"
device = 1
kv_blocks = 8192
max_batch = 128
)",
                             "fidelity.toml");

  auto d = deployment_from_config(config);
  d.link = link_kind::same_gpu;  // the live sim engine moves KV instantly
  sim_options so;
  so.hop_s = 50e-6 / scale;  // the live hops (~50 us) shrink by the time scale in trace seconds
  const auto simulated = run_simulation(config, d, trace, so);
  const auto s = summarize(simulated.records);
  REQUIRE(s.completed == trace.size());

  // Host noise only ever adds latency, and on a 2-core machine one preempted thread adds
  // a scheduler time slice (several ms) to a handful of the ~1400 gaps, enough to move
  // their P99. So the live run is repeated (up to three times) until it matches: a
  // simulator that is wrong misses in every run; a busy host misses in some.
  constexpr int attempts = 3;
  for (int attempt = 1; attempt <= attempts; ++attempt) {
    double host_noise_p99_s = 0;  // in trace seconds
    const auto live = run_live_fidelity(config, endpoint, trace, scale, host_noise_p99_s);
    const auto l = summarize(live);
    REQUIRE(l.completed == trace.size());
    MESSAGE("attempt " << attempt << ": " << trace.size() << " requests, " << s.itl_s.count
                       << " gaps; TTFT P50 live " << l.ttft_s.p50 * 1e3 << " / sim "
                       << s.ttft_s.p50 * 1e3 << " ms, P99 " << l.ttft_s.p99 * 1e3 << " / "
                       << s.ttft_s.p99 * 1e3 << " ms; ITL P50 " << l.itl_s.p50 * 1e3 << " / "
                       << s.itl_s.p50 * 1e3 << " ms, P99 " << l.itl_s.p99 * 1e3 << " / "
                       << s.itl_s.p99 * 1e3 << " ms; host timer lateness P99 "
                       << host_noise_p99_s * scale * 1e3 << " ms");
    const bool matched = relative_error(l.ttft_s.p50, s.ttft_s.p50) <= 0.05 &&
                         relative_error(l.ttft_s.p99, s.ttft_s.p99) <= 0.05 &&
                         relative_error(l.itl_s.p50, s.itl_s.p50) <= 0.05 &&
                         relative_error(l.itl_s.p99, s.itl_s.p99) <= 0.05;
    if (matched || attempt == attempts) {
      CHECK(relative_error(l.ttft_s.p50, s.ttft_s.p50) <= 0.05);
      CHECK(relative_error(l.ttft_s.p99, s.ttft_s.p99) <= 0.05);
      CHECK(relative_error(l.itl_s.p50, s.itl_s.p50) <= 0.05);
      // Each token reaches the client after three wake-ups (the step's timer, the transport
      // thread, the client); when other processes keep the cores busy, their lateness alone
      // exceeds the tolerance at the P99 of the gaps, and the comparison would measure the
      // host, not the simulator.
      if (3 * host_noise_p99_s <= 0.025 * s.itl_s.p99) {
        CHECK(relative_error(l.itl_s.p99, s.itl_s.p99) <= 0.05);
      } else {
        MESSAGE("P99 ITL not compared: this host woke sleeping threads up to "
                << host_noise_p99_s * scale * 1e3
                << " ms late at P99 during the run (load from other processes): three such "
                   "wake-ups per token exceed half the 5% tolerance");
      }
      break;
    }
  }
}

// ------------------------------------------------------------------------ real traces

TEST_CASE(
    "one hour of the Azure conversation trace replays through one deployment within seconds of "
    "CPU") {
  const auto conv = shared_traces / "AzureLLMInferenceTrace_conv_2023.csv";
  if (!fs::exists(conv)) {
    MESSAGE("skipped: " << conv.string() << " is not here");
    return;
  }
  const auto config = default_config();
  const auto trace = load_azure_csv(conv);
  REQUIRE(trace.size() == 19366);
  // Two H20 prefill GPUs keep up with the trace's bursts (one alone falls behind for minutes).
  const auto d = parse_deployment_spec("2P1D", config, "h20");
  const auto r = run_simulation(config, d, trace);
  const auto s = summarize(r.records);
  MESSAGE("Azure conv, 2P1D H20: " << r.events << " events in " << r.cpu_s << " s CPU (" << r.wall_s
                                   << " s wall), " << double(r.events) / r.cpu_s / 1e6
                                   << "M events/s; TTFT P50 " << s.ttft_s.p50 * 1e3
                                   << " ms, ITL P99 " << s.itl_s.p99 * 1e3 << " ms");
  CHECK(s.completed == trace.size());
  CHECK(r.cpu_s <= 10.0);
  CHECK(r.counters.at("decode.double_frees") == 0);

  const auto code = shared_traces / "AzureLLMInferenceTrace_code_2023.csv";
  REQUIRE(fs::exists(code));
  const auto code_trace = time_window(load_azure_csv(code), 0, 600);
  const auto rc = run_simulation(config, d, code_trace);
  CHECK(summarize(rc.records).completed == code_trace.size());
}
