// Speed of the CUDA engine on a checkpoint of the real shape (random weights), one GPU:
//   decode step time (wall clock of engine.decode(), graphs on) at batch 1/8/64/256 and context
//   1K/8K, prefill tokens/s at 2K/8K/32K (one sequence, wall clock of engine.prefill()), and the
//   kernel rates behind them (cuBLASLt and skinny GEMM, prefill and decode attention).
// Floors: decode = (weights read + KV read) / copy bandwidth (measured in the run unless
// --bandwidth gives it; the H200's is 4.28 TB/s, an H100's 3.0); prefill = FLOPs / the GEMM rate
// measured here on the model's M=8192 shapes.
//
//   bench_cuda_engine MODEL_DIR OUT.json [--bandwidth TBps] [--decode-only] [--prefill-only]
//                     [--kernels-only] [--quick]
// (--prefill-only: the GEMM rates and the prefill rows, 256 to 32K tokens, for a calibration;
// --kernels-only: the kernel rates alone, for which MODEL_DIR needs only config.json;
// --profile-prefill TOKENS / --profile-decode BATCH: one warm step, then one step of that shape
// between cudaProfilerStart and Stop, nothing else: for `ncu --profile-from-start off`, which
// then times every kernel of the step)
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>

#include "kernels/attention.cuh"
#include "kernels/bf16_host.hpp"
#include "kernels/gemm.cuh"
#include "kernels/kv_layout.hpp"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "kernels/silu_mul.cuh"
#include "runtime/cuda_engine.hpp"

using namespace duet;
using json = nlohmann::json;
namespace k = duet::kernels;

namespace {

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void k_ok(const k::kstatus& s) {
  if (!s.ok()) throw std::runtime_error(s.message());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// Device memory filled with random bf16 (a kernel of ours is not needed: host pattern, copied).
struct dmem {
  void* p = nullptr;
  explicit dmem(uint64_t bytes, bool random = true) {
    cuda_ok(cudaMalloc(&p, bytes), "cudaMalloc");
    if (!random) return;
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<uint16_t> host(std::min<uint64_t>(bytes / 2, 1u << 22));
    for (auto& x : host) x = k::f32_to_bf16(d(rng) * 0.5f);
    for (uint64_t at = 0; at < bytes; at += host.size() * 2) {
      cuda_ok(cudaMemcpy(static_cast<char*>(p) + at, host.data(),
                         std::min<uint64_t>(host.size() * 2, bytes - at), cudaMemcpyHostToDevice),
              "fill");
    }
  }
  ~dmem() { cudaFree(p); }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

/// Median device time (ms) of fn over `reps` runs after `warm` warm-ups, with events.
template <class F>
double time_device(F&& fn, int warm = 2, int reps = 10) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < warm; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a);
    fn();
    cudaEventRecord(b);
    cuda_ok(cudaEventSynchronize(b), "timed run");
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

/// Device-to-device copy bandwidth (reads + writes, bytes/s) of a 2 GiB buffer, as the PyTorch
/// peer measures it (over 4 GiB): the floor of a decode step on whichever card runs the bench.
double copy_bandwidth() {
  const uint64_t bytes = 2ull << 30;
  dmem from(bytes, false), to(bytes, false);
  const double ms = time_device([&] { cudaMemcpyAsync(to.p, from.p, bytes, cudaMemcpyDeviceToDevice); }, 3, 20);
  return 2.0 * bytes / (ms / 1e3);
}

/// One step of one shape under the profiler (see --profile-prefill): a prefill of `tokens` tokens,
/// or a decode step of `batch` sequences of 1,024 tokens of context (graphs on, as served).
int profile_one_step(const std::filesystem::path& dir, int tokens, int batch) {
  cuda_engine_params params;
  params.served_name = "profile";
  params.max_batch = std::max(1, batch);
  params.prefill_tokens = 8192;
  params.block_tokens = 16;
  params.max_context = 32768 + 64;
  params.kv_blocks =
      static_cast<uint32_t>(std::max((tokens + 15) / 16, 65 * std::max(1, batch)) + 16);
  cuda_engine engine(dir, params);
  std::mt19937 rng(7);
  auto step = [&] {
    if (tokens > 0) {
      std::vector<int32_t> toks(tokens);
      for (auto& t : toks) t = static_cast<int32_t>(rng() % 128000);
      std::vector<uint32_t> blocks((tokens + 15) / 16);
      std::iota(blocks.begin(), blocks.end(), 0u);
      std::vector<prefill_chunk> chunk{{1, toks, 0, blocks, true, nullptr}};
      (void)engine.prefill(chunk);
      return;
    }
    const uint32_t per_seq = (1024 + 1 + 15) / 16;
    static std::vector<std::vector<int32_t>> hist;
    static std::vector<std::vector<uint32_t>> blocks;
    hist.assign(batch, std::vector<int32_t>(1024, 1));
    blocks.assign(batch, std::vector<uint32_t>(per_seq));
    std::vector<decode_slot> slots;
    for (int b = 0; b < batch; ++b) {
      std::iota(blocks[b].begin(), blocks[b].end(), static_cast<uint32_t>(b) * per_seq);
      slots.push_back({static_cast<uint64_t>(b), hist[b], blocks[b], nullptr});
    }
    (void)engine.decode(slots);
  };
  step();
  step();  // the first decode step of a bucket runs eagerly, the second captures its graph
  cuda_ok(cudaDeviceSynchronize(), "warm-up");
  cuda_ok(cudaProfilerStart(), "cudaProfilerStart");
  const double a = now_ms();
  step();
  cuda_ok(cudaDeviceSynchronize(), "profiled step");
  const double ms = now_ms() - a;
  cuda_ok(cudaProfilerStop(), "cudaProfilerStop");
  std::printf("profiled %s step: %.3f ms wall (inflated when a profiler replays the kernels)\n",
              tokens ? "prefill" : "decode", ms);
  return 0;
}

// The pool the full decode sweep needs (B=64 at 8K context: 32,832 blocks), or on a smaller
// card (an H100's 80 GB) what fits beside the weights; the sweep then skips what needs more.
uint32_t fitting_pool_blocks(uint32_t wanted, uint64_t weight_bytes, uint64_t block_bytes) {
  size_t free_bytes = 0, total = 0;
  cuda_ok(cudaMemGetInfo(&free_bytes, &total), "memory info");
  const uint64_t headroom = 6ull << 30;  // activations, GEMM workspaces, decode graphs
  const uint64_t spare = free_bytes > weight_bytes + headroom ? free_bytes - weight_bytes - headroom : 0;
  const uint64_t fits = spare / block_bytes;
  if (fits < 64) return wanted;  // too small for any sweep: the engine reports the failed allocation
  return static_cast<uint32_t>(std::min<uint64_t>(wanted, fits));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: bench_cuda_engine MODEL_DIR OUT.json [--bandwidth TBps] [--decode-only] "
                 "[--prefill-only] [--kernels-only] [--quick]\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  const std::string out_file = argv[2];
  double bandwidth = 0;  // bytes/s; 0: measured here (copy_bandwidth)
  bool decode_only = false, prefill_only = false, kernels_only = false, quick = false;
  int profile_prefill = 0, profile_decode = 0;
  for (int i = 3; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--bandwidth") && i + 1 < argc)
      bandwidth = std::atof(argv[++i]) * 1e12;
    if (!std::strcmp(argv[i], "--decode-only")) decode_only = true;
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--prefill-only")) prefill_only = true;
    if (!std::strcmp(argv[i], "--kernels-only")) kernels_only = true;
    if (!std::strcmp(argv[i], "--profile-prefill") && i + 1 < argc) profile_prefill = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--profile-decode") && i + 1 < argc) profile_decode = std::atoi(argv[++i]);
  }
  if (profile_prefill || profile_decode) return profile_one_step(argv[1], profile_prefill, profile_decode);
  try {
    json report;
    const transformer_config c = load_hf_config(dir);
    const uint64_t H = c.hidden_size, Q = c.q_dim(), KV = c.kv_dim(), F = c.intermediate_size,
                   L = c.num_hidden_layers;
    const uint64_t linear_params = L * ((Q + 2 * KV) * H + H * Q + 2 * F * H + H * F);
    const uint64_t head_params = uint64_t{c.vocab_size} * H;
    const uint64_t weight_read = (linear_params + head_params) * 2;
    const uint64_t kv_per_token = 2 * L * c.num_key_value_heads * c.head_dim * 2;
    report["model"] = dir.string();
    report["bandwidth_source"] = bandwidth > 0 ? "--bandwidth" : "device-to-device copy, this run";
    if (bandwidth <= 0) bandwidth = copy_bandwidth();
    report["bandwidth_TBps"] = bandwidth / 1e12;
    report["weights_read_per_decode_step_GB"] = weight_read / 1e9;
    cudaDeviceProp prop{};
    cuda_ok(cudaGetDeviceProperties(&prop, 0), "properties");
    report["device"] = prop.name;
    std::printf("device %s, %d SMs; %.2f GB of weights read per decode step; floors at %.2f TB/s (%s)\n",
                prop.name, prop.multiProcessorCount, weight_read / 1e9, bandwidth / 1e12,
                report["bandwidth_source"].get<std::string>().c_str());

    // ------------------------------------------------------------------ kernel rates
    json kr;
    double gemm_rate = 0;
    {
      k::gemm_runner runner;
      k_ok(runner.init());
      struct shape {
        const char* name;
        uint64_t n, k;
      };
      const shape shapes[] = {
          {"qkv", Q + 2 * KV, H}, {"o", H, Q}, {"gate_up", 2 * F, H}, {"down", H, F}};
      const uint64_t M = 8192;
      dmem x(M * std::max(F, H) * 2), y(M * 2 * F * 2, false);
      double flops = 0, ms_total = 0;
      for (const shape& s : shapes) {
        dmem w(s.n * s.k * 2);
        k::gemm_params g{x.as<uint16_t>(),
                         static_cast<uint32_t>(s.k),
                         w.as<uint16_t>(),
                         nullptr,
                         y.p,
                         static_cast<uint32_t>(s.n),
                         static_cast<uint32_t>(M),
                         static_cast<uint32_t>(s.n),
                         static_cast<uint32_t>(s.k)};
        const double ms = time_device([&] { k_ok(runner.run(g, nullptr)); });
        const double f = 2.0 * M * s.n * s.k;
        flops += f;
        ms_total += ms;
        kr[std::string("gemm_M8192_") + s.name + "_TFLOPs"] = f / ms / 1e9;
        // Decode reads each layer's weights once per step, from HBM: the small-m rates rotate
        // over copies of the weight larger than L2 together (50 MB on the H200), rather than
        // reading one weight that L2 partly keeps between runs.
        const uint64_t elems = s.n * s.k, copies = std::max<uint64_t>(2, (256ull << 20) / (2 * elems) + 1);
        dmem ring(copies * elems * 2, false);
        cuda_ok(cudaMemset(ring.p, 0, copies * elems * 2), "cudaMemset");
        uint64_t turn = 0;
        // Ten launches back to back per timing, so the host's launch cost overlaps the kernels
        // as it does in a stream, and the rate is per launch.
        constexpr int burst = 10;
        auto burst_ms = [&](auto&& fn) { return time_device(fn) / burst; };
        auto cold = [&](k::gemm_path path) {
          for (int i = 0; i < burst; ++i) {
            k::gemm_params q = g;
            q.w = ring.as<uint16_t>() + (turn++ % copies) * elems;
            k_ok(runner.run(q, nullptr, path));
          }
        };
        // Batch 1: cuBLASLt against the skinny kernel, as bandwidth over the weight.
        g.m = 1;
        const double lt = burst_ms([&] { cold(k::gemm_path::cublaslt); });
        const double sk = burst_ms([&] { cold(k::gemm_path::skinny); });
        kr[std::string("gemv_") + s.name + "_cublaslt_TBps"] = s.n * s.k * 2 / lt / 1e9;
        kr[std::string("gemv_") + s.name + "_skinny_TBps"] = s.n * s.k * 2 / sk / 1e9;
        g.m = 4;
        const double sk4 = burst_ms([&] { cold(k::gemm_path::skinny); });
        kr[std::string("gemm_M4_") + s.name + "_skinny_TBps"] = s.n * s.k * 2 / sk4 / 1e9;
        // cuBLASLt at decode batches (the engine's path for 2 to 256 rows); from 128 rows the
        // GEMMs approach the tensor cores' rate, so those rows report TFLOP/s too.
        std::string lt_line;
        for (const uint32_t m : {4u, 8u, 16u, 32u, 64u, 128u, 256u}) {
          g.m = m;
          const double ms_m = burst_ms([&] { cold(k::gemm_path::cublaslt); });
          const double tbps = s.n * s.k * 2 / ms_m / 1e9;
          const std::string key = "gemm_M" + std::to_string(m) + "_" + s.name + "_cublaslt_";
          kr[key + "TBps"] = tbps;
          if (m >= 128) kr[key + "TFLOPs"] = 2.0 * m * s.n * s.k / ms_m / 1e9;
          char part[24];
          std::snprintf(part, sizeof part, " M=%u %.2f", m, tbps);
          lt_line += part;
        }
        std::printf(
            "gemm %-8s M=8192 %4.0f TFLOP/s | TB/s over the weight: M=1 cuBLASLt %.2f skinny %.2f "
            "| M=4 skinny %.2f | cuBLASLt%s\n",
            s.name, f / ms / 1e9, s.n * s.k * 2 / lt / 1e9, s.n * s.k * 2 / sk / 1e9,
            s.n * s.k * 2 / sk4 / 1e9, lt_line.c_str());
      }
      kr["gemm_small_m_weights_rotated_past_L2"] = true;
      kr["gemm_small_m_launches_per_timing"] = 10;
      gemm_rate = flops / ms_total * 1e3;
      kr["gemm_M8192_model_mix_TFLOPs"] = gemm_rate / 1e12;
    }
    // Attention kernels on a standalone pool.
    if (!decode_only && !prefill_only) {
      const uint32_t bt = 16, kvh = c.num_key_value_heads, heads = c.num_attention_heads;
      const int ctx = 8192;
      const uint32_t seq_blocks = ctx / bt;
      const uint32_t batch = quick ? 8 : 64;
      k::kv_pool_view kv{nullptr, k::kv_block_elems(1, kvh, 128, bt), 1, kvh, 128, bt,
                         seq_blocks * batch};
      dmem pool(kv.block_elems * 2 * seq_blocks * batch);
      kv.pool = pool.as<uint16_t>();
      std::vector<int32_t> table(seq_blocks * batch);
      std::iota(table.begin(), table.end(), 0);
      dmem dtable(table.size() * 4, false);
      cuda_ok(cudaMemcpy(dtable.p, table.data(), table.size() * 4, cudaMemcpyHostToDevice),
              "table");
      const uint32_t qs = (heads + 2 * kvh) * 128;
      dmem q(uint64_t{ctx} * qs * 2), out(uint64_t{ctx} * heads * 128 * 2, false);
      std::vector<int32_t> meta = {0, ctx, 0, 0};
      dmem dmeta(16, false);
      cuda_ok(cudaMemcpy(dmeta.p, meta.data(), 16, cudaMemcpyHostToDevice), "meta");
      k::prefill_attention_params p;
      p.q = q.as<uint16_t>();
      p.q_stride = qs;
      p.out = out.as<uint16_t>();
      p.out_stride = heads * 128;
      p.kv = kv;
      p.block_table = dtable.as<int32_t>();
      p.seq_rows = dmeta.as<int32_t>();       // {0, ctx}
      p.seq_start = dmeta.as<int32_t>() + 2;  // {0}
      p.seq_table = dmeta.as<int32_t>() + 3;  // {0}
      p.seqs = 1;
      p.max_seq_rows = ctx;
      p.heads = heads;
      p.kv_heads = kvh;
      p.scale = 1.0f / std::sqrt(128.0f);
      double ms = 0;
      // One 8K prompt, and the last 8K chunk of a 32K one (the engine's 8K chunks attend to
      // every earlier chunk's keys).
      for (const int start : {0, 3 * ctx}) {
        const std::string shape = start ? "32K_last_chunk" : "8K";
        meta[2] = start;
        cuda_ok(cudaMemcpy(dmeta.p, meta.data(), 16, cudaMemcpyHostToDevice), "meta");
        const double flops = 4.0 * (double(ctx) * start + double(ctx) * (ctx + 1) / 2) * heads * 128;
        std::vector<uint32_t> variants;
        for (uint32_t variant : {1u, 2u, 3u, 0u, 4u, 5u, 6u}) {
          if (variant >= 4 && !k::prefill_attention_wgmma_available()) continue;
          if (start && (variant == 1 || variant == 2)) continue;
          variants.push_back(variant);
        }
        // Rounds in alternating order: long passes heat the card toward its power cap, and in one
        // fixed order the variants timed last read 7-10 % slow (docs/cuda-engine.md, 2026-12-06).
        std::map<uint32_t, std::vector<double>> times;
        for (int round = 0; round < 4; ++round) {
          for (std::size_t i = 0; i < variants.size(); ++i) {
            p.variant = variants[round % 2 ? variants.size() - 1 - i : i];
            times[p.variant].push_back(
                time_device([&] { k_ok(k::prefill_attention(p, nullptr)); }, round == 0, 2));
          }
        }
        for (const uint32_t variant : variants) {
          ms = median(times[variant]);
          const std::string v = "_v" + std::to_string(variant);
          kr["prefill_attention_" + shape + "_TFLOPs" + v] = flops / ms / 1e9;
          kr["prefill_attention_" + shape + "_layer_ms" + v] = ms;
          std::printf("prefill attention %s (one layer, causal), variant %u: %.2f ms, %.0f TFLOP/s\n",
                      shape.c_str(), variant, ms, flops / ms / 1e9);
        }
      }
      meta[2] = 0;
      cuda_ok(cudaMemcpy(dmeta.p, meta.data(), 16, cudaMemcpyHostToDevice), "meta");
      // Decode attention: `batch` sequences of 8K keys.
      std::vector<int32_t> lens(batch, ctx), at(batch);
      for (uint32_t b = 0; b < batch; ++b) at[b] = static_cast<int32_t>(b * seq_blocks);
      dmem dlens(batch * 4, false), dat(batch * 4, false);
      cuda_ok(cudaMemcpy(dlens.p, lens.data(), batch * 4, cudaMemcpyHostToDevice), "lens");
      cuda_ok(cudaMemcpy(dat.p, at.data(), batch * 4, cudaMemcpyHostToDevice), "at");
      for (uint32_t b : {1u, batch}) {
        const uint32_t splits =
            std::clamp((3u * prop.multiProcessorCount + b * kvh - 1) / (b * kvh), 1u, 64u);
        dmem ws(k::decode_attention_workspace_bytes(b, heads, kvh, splits), false);
        cuda_ok(cudaMemset(ws.p, 0, k::decode_attention_workspace_bytes(b, heads, kvh, splits)),
                "ws");
        k::decode_attention_params d;
        d.q = q.as<uint16_t>();
        d.q_stride = qs;
        d.out = out.as<uint16_t>();
        d.out_stride = heads * 128;
        d.kv = kv;
        d.block_table = dtable.as<int32_t>();
        d.seq_table = dat.as<int32_t>();
        d.seq_lens = dlens.as<int32_t>();
        d.batch = b;
        d.heads = heads;
        d.kv_heads = kvh;
        d.scale = 1.0f / std::sqrt(128.0f);
        d.max_splits = splits;
        d.split_min_keys = 64;
        d.workspace = ws.p;
        for (uint32_t variant : {1u, 0u}) {
          d.variant = variant;
          const double dms = time_device([&] { k_ok(k::decode_attention(d, nullptr)); });
          const double bytes = double(b) * ctx * kvh * 128 * 2 * 2;
          const std::string key = "decode_attention_B" + std::to_string(b) + "_8K";
          kr[key + "_TBps_v" + std::to_string(variant)] = bytes / dms / 1e9;
          kr[key + "_layer_us_v" + std::to_string(variant)] = dms * 1e3;
          std::printf(
              "decode attention B=%u ctx 8K (one layer, %u splits), variant %u: %.1f us, %.2f "
              "TB/s\n",
              b, splits, variant, dms * 1e3, bytes / dms / 1e9);
        }
      }
    }
    // The kernels between the GEMMs, at a prefill pass (8,192 rows) and a batch-1 decode step:
    // time per layer and bandwidth over the bytes each must move (reads + writes), over buffers
    // larger than L2 together.
    {
      const uint32_t bt = 16, kvh = c.num_key_value_heads, hd = c.head_dim;
      for (const uint32_t rows : {8192u, 1u}) {
        const std::string at = "_M" + std::to_string(rows);
        dmem x(uint64_t{rows} * H * 2), delta(uint64_t{rows} * H * 2), h(uint64_t{rows} * H * 2, false),
            norm_w(H * 2);
        k::rmsnorm_params rn{x.as<uint16_t>(), delta.as<uint16_t>(), norm_w.as<uint16_t>(),
                             h.as<uint16_t>(), rows, static_cast<uint32_t>(H), 1e-5f};
        const double rn_ms = time_device([&] { k_ok(k::add_rmsnorm(rn, nullptr)); });
        const double rn_bytes = 4.0 * rows * H * 2;
        dmem gu(uint64_t{rows} * 2 * F * 2), act(uint64_t{rows} * F * 2, false);
        const k::silu_mul_params sm{gu.as<uint16_t>(), act.as<uint16_t>(), rows, static_cast<uint32_t>(F)};
        const double sm_ms = time_device([&] { k_ok(k::silu_mul(sm, nullptr)); });
        const double sm_bytes = 3.0 * rows * F * 2;
        const uint32_t qkv_dim = static_cast<uint32_t>(Q + 2 * KV), positions = 32768;
        dmem qkv(uint64_t{rows} * qkv_dim * 2), cos(uint64_t{positions} * hd / 2 * 4), sin(uint64_t{positions} * hd / 2 * 4);
        const uint32_t blocks = (rows + bt - 1) / bt;
        k::kv_pool_view kv{nullptr, k::kv_block_elems(1, kvh, hd, bt), 1, kvh, hd, bt, blocks};
        dmem pool(kv.block_elems * 2 * blocks, false);
        kv.pool = pool.as<uint16_t>();
        std::vector<int32_t> pos(rows);
        std::iota(pos.begin(), pos.end(), 0);
        dmem dpos(uint64_t{rows} * 4, false);
        cuda_ok(cudaMemcpy(dpos.p, pos.data(), uint64_t{rows} * 4, cudaMemcpyHostToDevice), "positions");
        k::rope_params rp;
        rp.x = qkv.as<uint16_t>();
        rp.row_stride = qkv_dim;
        rp.positions = dpos.as<int32_t>();
        rp.cos = cos.as<float>();
        rp.sin = sin.as<float>();
        rp.rows = rows;
        rp.q_heads = c.num_attention_heads;
        rp.k_heads = kvh;
        rp.head_dim = hd;
        rp.max_positions = positions;
        rp.slots = dpos.as<int32_t>();  // slot = position: the rows fill the pool in order
        rp.kv = kv;
        const double rope_ms = time_device([&] { k_ok(k::rope_apply(rp, nullptr)); });
        const double rope_bytes = double(rows) * ((Q + KV) * 2 * 2 + 2 * KV * 2);  // q, k in and out; K, V stored
        const struct {
          const char* name;
          double ms, bytes;
        } rates[] = {{"add_rmsnorm", rn_ms, rn_bytes}, {"silu_mul", sm_ms, sm_bytes}, {"rope_kv_append", rope_ms, rope_bytes}};
        for (const auto& r : rates) {
          kr[std::string(r.name) + at + "_us"] = r.ms * 1e3;
          kr[std::string(r.name) + at + "_TBps"] = r.bytes / r.ms / 1e9;
          std::printf("%-15s M=%-5u %9.1f us %6.2f TB/s (floor %.1f us)\n", r.name, rows, r.ms * 1e3,
                      r.bytes / r.ms / 1e9, r.bytes / bandwidth * 1e6);
        }
      }
    }
    report["kernels"] = kr;
    if (kernels_only) {
      std::ofstream(out_file) << report.dump(1) << "\n";
      return 0;
    }

    // ------------------------------------------------------------------ the engine
    cuda_engine_params params;
    params.served_name = "bench";
    params.max_batch = 256;
    params.prefill_tokens = 8192;
    params.block_tokens = 16;
    params.max_context = 32768 + 64;
    const uint64_t weight_bytes = weight_read + (c.tie_word_embeddings ? 0 : head_params * 2);
    params.kv_blocks = fitting_pool_blocks(quick ? 4200 : 33000, weight_bytes, kv_per_token * params.block_tokens);
    double t0 = now_ms();
    cuda_engine engine(dir, params);
    report["load_s"] = (now_ms() - t0) / 1e3;
    std::printf("engine loaded in %.1f s (%.2f GB of weights), KV pool %u blocks of %.1f MB\n",
                (now_ms() - t0) / 1e3, engine.weight_bytes() / 1e9, engine.kv_blocks(),
                engine.info().block_bytes / 1e6);
    const uint64_t block_bytes = engine.info().block_bytes;
    std::mt19937 rng(7);

    json prefill = json::array();
    if (!decode_only) {
      std::vector<int> lengths =
          quick ? std::vector<int>{2048, 8192} : std::vector<int>{256, 512, 1024, 2048, 8192, 32768};
      for (int len : lengths) {
        std::vector<int32_t> toks(len);
        for (auto& t : toks) t = static_cast<int32_t>(rng() % 128000);
        std::vector<uint32_t> blocks((len + 15) / 16);
        std::iota(blocks.begin(), blocks.end(), 0u);
        std::vector<prefill_chunk> chunk{{1, toks, 0, blocks, true, nullptr}};
        (void)engine.prefill(chunk);  // warm-up (GEMM plans for this pass shape)
        std::vector<double> t;
        const int reps = len >= 32768 ? 2 : 3;
        for (int r = 0; r < reps; ++r) {
          const double a = now_ms();
          (void)engine.prefill(chunk);
          t.push_back(now_ms() - a);
        }
        const double ms = median(t);
        const double flops =
            2.0 * linear_params * len + 2.0 * head_params +
            4.0 * (double(len) * (len + 1) / 2) * c.num_attention_heads * c.head_dim * L;
        const double floor_ms = flops / gemm_rate * 1e3;
        prefill.push_back({{"tokens", len},
                           {"ms", ms},
                           {"tok_s", len / ms * 1e3},
                           {"TFLOPs", flops / ms / 1e9},
                           {"floor_ms", floor_ms},
                           {"floor_fraction", floor_ms / ms}});
        std::printf(
            "prefill %6d tokens: %8.1f ms, %7.0f tok/s, %4.0f TFLOP/s; floor %.1f ms (%.0f%% of "
            "floor speed)\n",
            len, ms, len / ms * 1e3, flops / ms / 1e9, floor_ms, 100 * floor_ms / ms);
      }
    }
    report["prefill"] = prefill;

    // Decode: the KV pool holds random bf16 (one random block copied over every block used).
    if (!prefill_only) {
      std::vector<std::byte> block(block_bytes);
      std::normal_distribution<float> d(0.0f, 1.0f);
      for (std::size_t i = 0; i < block.size() / 2; ++i) {
        const uint16_t v = k::f32_to_bf16(d(rng));
        std::memcpy(block.data() + 2 * i, &v, 2);
      }
      const std::vector<uint32_t> zero{0};
      if (!engine.write_blocks(zero, block)) throw std::runtime_error("write_blocks");
      for (uint32_t b = 1; b < engine.kv_blocks(); ++b) {
        cuda_ok(cudaMemcpy(static_cast<char*>(engine.kv_pool()) + b * block_bytes, engine.kv_pool(),
                           block_bytes, cudaMemcpyDeviceToDevice),
                "fill pool");
      }
      cuda_ok(cudaDeviceSynchronize(), "fill pool");
    }
    json decode = json::array();
    struct cfg {
      uint32_t batch, ctx;
    };
    // 96, 160 and 192 fall between powers of two: they show what a step pays for its bucket.
    std::vector<cfg> cfgs = {{1, 1024},  {1, 8192},   {4, 1024},   {8, 1024},   {8, 8192},  {64, 1024},
                             {64, 8192}, {96, 1024},  {128, 1024}, {160, 1024}, {192, 1024}, {256, 1024}};
    if (quick) cfgs = {{1, 1024}, {8, 1024}, {64, 1024}};
    if (prefill_only) cfgs.clear();
    for (const cfg& cf : cfgs) {
      const uint32_t per_seq = (cf.ctx + 1 + 15) / 16;
      if (uint64_t{per_seq} * cf.batch > engine.kv_blocks()) {
        std::printf("decode B=%u ctx %u: skipped (needs %u blocks)\n", cf.batch, cf.ctx,
                    per_seq * cf.batch);
        continue;
      }
      std::vector<std::vector<int32_t>> hist(cf.batch);
      std::vector<std::vector<uint32_t>> blocks(cf.batch);
      std::vector<decode_slot> slots;
      for (uint32_t b = 0; b < cf.batch; ++b) {
        hist[b].resize(cf.ctx);
        for (auto& t : hist[b]) t = static_cast<int32_t>(rng() % 128000);
        blocks[b].resize(per_seq);
        std::iota(blocks[b].begin(), blocks[b].end(), b * per_seq);
        slots.push_back({b, hist[b], blocks[b], nullptr});
      }
      for (int i = 0; i < 3; ++i) (void)engine.decode(slots);
      std::vector<double> t;
      for (int i = 0; i < (quick ? 10 : 30); ++i) {
        const double a = now_ms();
        (void)engine.decode(slots);
        t.push_back(now_ms() - a);
      }
      std::sort(t.begin(), t.end());
      const double ms = median(t);
      const double floor_ms =
          (weight_read + double(cf.batch) * cf.ctx * kv_per_token) / bandwidth * 1e3;
      decode.push_back({{"batch", cf.batch},
                        {"context", cf.ctx},
                        {"ms", ms},
                        {"p10_ms", t[t.size() / 10]},
                        {"p90_ms", t[t.size() * 9 / 10]},
                        {"floor_ms", floor_ms},
                        {"floor_fraction", floor_ms / ms},
                        {"tok_s", cf.batch / ms * 1e3}});
      std::printf(
          "decode B=%3u ctx %5u: %7.3f ms/step (p10 %.3f, p90 %.3f), floor %.3f ms (%.0f%%), %7.0f "
          "tok/s\n",
          cf.batch, cf.ctx, ms, t[t.size() / 10], t[t.size() * 9 / 10], floor_ms,
          100 * floor_ms / ms, cf.batch / ms * 1e3);
    }
    report["decode"] = decode;
    report["graph_steps"] = engine.graph_steps();
    report["eager_steps"] = engine.eager_steps();
    report["pdl"] = std::getenv("DUET_CUDA_PDL") ? std::getenv("DUET_CUDA_PDL") : "1";
    report["attention_variant"] =
        std::getenv("DUET_CUDA_ATTN_VARIANT") ? std::getenv("DUET_CUDA_ATTN_VARIANT") : "0";
    report["skinny_gemm"] = k::gemm_skinny_enabled();
    std::ofstream(out_file) << report.dump(1) << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_engine: %s\n", e.what());
    return 1;
  }
}
