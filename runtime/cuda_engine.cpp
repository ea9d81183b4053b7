#include "runtime/cuda_engine.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string_view>

#include "kernels/attention.cuh"
#include "kernels/decode_layers.cuh"
#include "kernels/embedding.cuh"
#include "kernels/gemm.cuh"
#include "kernels/kv_copy.cuh"
#include "kernels/kv_layout.hpp"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "kernels/sampling.cuh"
#include "kernels/silu_mul.cuh"
#include "runtime/cpu_engine.hpp"
#include "runtime/decode_buckets.hpp"
#include "runtime/kv_pool_share.hpp"
#include "runtime/model_shape.hpp"
#include "runtime/safetensors.hpp"
#include "runtime/shared_loads.hpp"

namespace duet {

namespace k = kernels;

namespace {

[[noreturn]] void cuda_fail(cudaError_t e, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("cuda_engine: ") + file + ":" + std::to_string(line) + ": " +
                           call + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

#define CUDA_CHECK(call)                                                         \
  do {                                                                           \
    const cudaError_t duet_err = (call);                                         \
    if (duet_err != cudaSuccess) cuda_fail(duet_err, #call, __FILE__, __LINE__); \
  } while (0)

/// The driver calls that green contexts need, taken through the runtime rather than by linking
/// libcuda: binaries then still load on machines without a driver (the GPU tests skip there).
struct driver_api {
#define DUET_DRIVER_FN(name) decltype(&::name) name = nullptr;
#define DUET_DRIVER_FNS                       \
  DUET_DRIVER_FN(cuGetErrorName)              \
  DUET_DRIVER_FN(cuGetErrorString)            \
  DUET_DRIVER_FN(cuDeviceGet)                 \
  DUET_DRIVER_FN(cuDeviceGetDevResource)      \
  DUET_DRIVER_FN(cuGreenCtxGetDevResource)    \
  DUET_DRIVER_FN(cuDevSmResourceSplitByCount) \
  DUET_DRIVER_FN(cuDevResourceGenerateDesc)   \
  DUET_DRIVER_FN(cuGreenCtxCreate)            \
  DUET_DRIVER_FN(cuCtxFromGreenCtx)           \
  DUET_DRIVER_FN(cuGreenCtxStreamCreate)      \
  DUET_DRIVER_FN(cuGreenCtxDestroy)           \
  DUET_DRIVER_FN(cuCtxGetCurrent)             \
  DUET_DRIVER_FN(cuCtxSetCurrent)
  DUET_DRIVER_FNS
#undef DUET_DRIVER_FN
  std::string missing;  // the first call the driver does not offer ("" when it offers all)
};

const driver_api& drv() {
  // Never freed: engines destroyed during static destruction still find it.
  static const driver_api* const api = [] {
    auto* a_ptr = new driver_api;
    driver_api& a = *a_ptr;
#define DUET_DRIVER_FN(name)                                                                     \
  {                                                                                              \
    void* fn = nullptr;                                                                          \
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;                  \
    if (cudaGetDriverEntryPointByVersion(#name, &fn, CUDA_VERSION, cudaEnableDefault, &found) == \
            cudaSuccess &&                                                                       \
        found == cudaDriverEntryPointSuccess && fn) {                                            \
      a.name = reinterpret_cast<decltype(a.name)>(fn);                                           \
    } else {                                                                                     \
      cudaGetLastError();                                                                        \
      if (a.missing.empty()) a.missing = #name;                                                  \
    }                                                                                            \
  }
    DUET_DRIVER_FNS
#undef DUET_DRIVER_FN
    return a_ptr;
  }();
  return *api;
}
#undef DUET_DRIVER_FNS

std::string cu_error_text(CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  const driver_api& d = drv();
  if (!d.cuGetErrorName || d.cuGetErrorName(r, &name) != CUDA_SUCCESS) name = nullptr;
  if (!d.cuGetErrorString || d.cuGetErrorString(r, &text) != CUDA_SUCCESS) text = nullptr;
  if (!name) return "CUresult " + std::to_string(static_cast<int>(r));
  return std::string(name) + (text ? std::string(" (") + text + ")" : std::string());
}

#define CU_CHECK(call)                                                          \
  do {                                                                          \
    const CUresult duet_res = (call);                                           \
    if (duet_res != CUDA_SUCCESS) {                                             \
      throw std::runtime_error(std::string("cuda_engine: ") + __FILE__ + ":" +  \
                               std::to_string(__LINE__) + ": " + #call + ": " + \
                               cu_error_text(duet_res));                        \
    }                                                                           \
  } while (0)

void kcheck(const k::kstatus& s) {
  if (!s.ok()) throw std::runtime_error("cuda_engine: " + s.message());
}

uint64_t align256(uint64_t v) {
  return (v + 255) / 256 * 256;
}

cudaStream_t as_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}

/// A device allocation freed on scope exit.
struct device_mem {
  void* ptr = nullptr;
  device_mem() = default;
  explicit device_mem(uint64_t bytes) {
    if (bytes) CUDA_CHECK(cudaMalloc(&ptr, bytes));
  }
  ~device_mem() {
    if (ptr) cudaFree(ptr);
  }
  device_mem(const device_mem&) = delete;
  device_mem& operator=(const device_mem&) = delete;
  device_mem(device_mem&& o) noexcept : ptr(std::exchange(o.ptr, nullptr)) {}
  device_mem& operator=(device_mem&& o) noexcept {
    std::swap(ptr, o.ptr);
    return *this;
  }
  template <class T>
  [[nodiscard]] T* as() const {
    return static_cast<T*>(ptr);
  }
};

bool has_penalties(const msg::sampling_params* p) {
  return p && (p->repetition_penalty != 1.0f || p->frequency_penalty != 0.0f ||
               p->presence_penalty != 0.0f);
}

}  // namespace

// ------------------------------------------------------------------------------------- weights

struct cuda_weights {
  struct layer {
    uint16_t* input_norm = nullptr;
    uint16_t* qkv = nullptr;       // [q_dim + 2 kv_dim, hidden]: q rows, then k, then v
    uint16_t* qkv_bias = nullptr;  // [q_dim + 2 kv_dim] or nullptr
    uint16_t* o = nullptr;         // [hidden, q_dim]
    uint16_t* o_bias = nullptr;
    uint16_t* post_norm = nullptr;
    uint16_t* gate_up = nullptr;  // [2 ffn, hidden]: gate rows, then up
    uint16_t* down = nullptr;     // [hidden, ffn]
  };
  int device = 0;
  transformer_config config;
  uint16_t* embedding = nullptr;
  std::vector<layer> layers;
  uint16_t* final_norm = nullptr;
  uint16_t* lm_head = nullptr;  // the embedding when tied
  std::vector<device_mem> memory;
  uint64_t bytes = 0;

  ~cuda_weights() {
    int current = 0;
    if (cudaGetDevice(&current) == cudaSuccess && current != device) cudaSetDevice(device);
    memory.clear();
    if (current != device) cudaSetDevice(current);
  }
};

namespace {

/// Host -> device copies through two pinned staging buffers.
class uploader {
 public:
  static constexpr uint64_t chunk = 64ull << 20;
  uploader() {
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (int i = 0; i < 2; ++i) {
      CUDA_CHECK(cudaMallocHost(&staging_[i], chunk));
      CUDA_CHECK(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming));
    }
  }
  ~uploader() {
    cudaStreamSynchronize(stream_);
    for (int i = 0; i < 2; ++i) {
      cudaEventDestroy(done_[i]);
      cudaFreeHost(staging_[i]);
    }
    cudaStreamDestroy(stream_);
  }
  /// Copies `bytes` produced by fill(first_byte, out) to dst.
  template <class F>
  void copy(void* dst, uint64_t bytes, F&& fill) {
    for (uint64_t at = 0; at < bytes; at += chunk) {
      const uint64_t n = std::min(chunk, bytes - at);
      CUDA_CHECK(cudaEventSynchronize(done_[cur_]));
      fill(at, std::span<std::byte>(static_cast<std::byte*>(staging_[cur_]), n));
      CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + at, staging_[cur_], n,
                                 cudaMemcpyHostToDevice, stream_));
      CUDA_CHECK(cudaEventRecord(done_[cur_], stream_));
      cur_ ^= 1;
    }
  }
  void finish() { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
  void* staging_[2] = {};
  cudaEvent_t done_[2] = {};
  int cur_ = 0;
};

/// Uploads tensor `name` (shape checked) as bf16 to dst.
void upload_tensor(uploader& up, const safetensors_checkpoint& ckpt, const std::string& name,
                   std::span<const uint64_t> shape, void* dst) {
  const st_tensor_info& info = ckpt.info(name);
  if (info.shape.size() != shape.size() ||
      !std::equal(shape.begin(), shape.end(), info.shape.begin())) {
    throw std::runtime_error("cuda_engine: " + ckpt.path().string() + ": tensor '" + name +
                             "' has shape " + shape_to_string(info.shape) + ", expected " +
                             shape_to_string(shape));
  }
  if (info.dtype == st_dtype::bf16) {
    const std::span<const std::byte> src = ckpt.file_of(name).bytes(info);
    up.copy(dst, src.size(), [&](uint64_t at, std::span<std::byte> out) {
      std::memcpy(out.data(), src.data() + at, out.size());
    });
    return;
  }
  const std::vector<float> values = ckpt.read_floats(name, shape);
  up.copy(dst, values.size() * 2, [&](uint64_t at, std::span<std::byte> out) {
    auto* o = reinterpret_cast<uint16_t*>(out.data());
    const uint64_t first = at / 2;
    for (uint64_t i = 0; i < out.size() / 2; ++i) o[i] = float_to_bf16(values[first + i]);
  });
}

std::shared_ptr<cuda_weights> load_cuda_weights(const std::filesystem::path& dir, int device) {
  CUDA_CHECK(cudaSetDevice(device));
  auto w = std::make_shared<cuda_weights>();
  w->device = device;
  w->config = load_hf_config(dir);
  const transformer_config& c = w->config;
  const safetensors_checkpoint ckpt(dir);
  const uint64_t hidden = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), ffn = c.intermediate_size;
  auto alloc = [&](uint64_t elements) {
    w->memory.emplace_back(elements * 2);
    w->bytes += elements * 2;
    return w->memory.back().as<uint16_t>();
  };
  uploader up;
  auto put = [&](const std::string& name, std::vector<uint64_t> shape, uint16_t* dst) {
    upload_tensor(up, ckpt, name, shape, dst);
  };
  w->embedding = alloc(uint64_t{c.vocab_size} * hidden);
  put("model.embed_tokens.weight", {c.vocab_size, hidden}, w->embedding);
  w->layers.resize(c.num_hidden_layers);
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    cuda_weights::layer& L = w->layers[l];
    L.input_norm = alloc(hidden);
    put(p + "input_layernorm.weight", {hidden}, L.input_norm);
    L.qkv = alloc((q + 2 * kv) * hidden);
    put(p + "self_attn.q_proj.weight", {q, hidden}, L.qkv);
    put(p + "self_attn.k_proj.weight", {kv, hidden}, L.qkv + q * hidden);
    put(p + "self_attn.v_proj.weight", {kv, hidden}, L.qkv + (q + kv) * hidden);
    if (c.qkv_bias) {
      L.qkv_bias = alloc(q + 2 * kv);
      put(p + "self_attn.q_proj.bias", {q}, L.qkv_bias);
      put(p + "self_attn.k_proj.bias", {kv}, L.qkv_bias + q);
      put(p + "self_attn.v_proj.bias", {kv}, L.qkv_bias + q + kv);
    }
    L.o = alloc(hidden * q);
    put(p + "self_attn.o_proj.weight", {hidden, q}, L.o);
    if (c.o_bias) {
      L.o_bias = alloc(hidden);
      put(p + "self_attn.o_proj.bias", {hidden}, L.o_bias);
    }
    L.post_norm = alloc(hidden);
    put(p + "post_attention_layernorm.weight", {hidden}, L.post_norm);
    L.gate_up = alloc(2 * ffn * hidden);
    put(p + "mlp.gate_proj.weight", {ffn, hidden}, L.gate_up);
    put(p + "mlp.up_proj.weight", {ffn, hidden}, L.gate_up + ffn * hidden);
    L.down = alloc(hidden * ffn);
    put(p + "mlp.down_proj.weight", {hidden, ffn}, L.down);
  }
  w->final_norm = alloc(hidden);
  put("model.norm.weight", {hidden}, w->final_norm);
  if (c.tie_word_embeddings && !ckpt.contains("lm_head.weight")) {
    w->lm_head = w->embedding;
  } else {
    w->lm_head = alloc(uint64_t{c.vocab_size} * hidden);
    put("lm_head.weight", {c.vocab_size, hidden}, w->lm_head);
  }
  up.finish();
  return w;
}

}  // namespace

std::shared_ptr<const cuda_weights> load_cuda_weights_shared(const std::filesystem::path& dir,
                                                             int device) {
  // One copy per directory and device: each GPU needs the weights in its own memory.
  static shared_loads<cuda_weights, std::pair<std::filesystem::path, int>> loads;
  return loads.get({canonical_key(dir), device}, [&] { return load_cuda_weights(dir, device); });
}

// ----------------------------------------------------------------------------- step buffers

// Per-pass metadata: one pinned host block mirrored by one device block with the same layout,
// uploaded with one copy. Regions have fixed offsets, so captured graphs read the current values.
struct meta_layout {
  uint64_t tokens = 0, positions = 0, slots = 0, seq_rows = 0, seq_start = 0, seq_table = 0,
           seq_lens = 0, out_rows = 0, requests = 0, blocks = 0, bytes = 0;
  uint32_t max_rows = 0, max_seqs = 0, max_blocks = 0;

  static meta_layout make(uint32_t rows, uint32_t seqs, uint32_t blocks) {
    meta_layout m;
    m.max_rows = rows;
    m.max_seqs = seqs;
    m.max_blocks = blocks;
    uint64_t at = 0;
    auto region = [&](uint64_t bytes) {
      const uint64_t start = at;
      at = align256(at + bytes);
      return start;
    };
    m.tokens = region(uint64_t{rows} * 4);
    m.positions = region(uint64_t{rows} * 4);
    m.slots = region(uint64_t{rows} * 4);
    m.seq_rows = region((uint64_t{seqs} + 1) * 4);
    m.seq_start = region(uint64_t{seqs} * 4);
    m.seq_table = region(uint64_t{seqs} * 4);
    m.seq_lens = region(uint64_t{seqs} * 4);
    m.out_rows = region(uint64_t{seqs} * 4);
    m.requests = region(uint64_t{seqs} * sizeof(k::sample_row));
    m.blocks = region(uint64_t{blocks} * 4);
    m.bytes = at;
    return m;
  }
};

struct cuda_engine::device_buffers {
  k::gemm_runner gemm;
  meta_layout meta;
  void* meta_host = nullptr;  // pinned
  device_mem meta_dev;
  device_mem x, h, qkv, attn, gate_up, act, delta, hsel, logits, rope_cos, rope_sin, attn_ws;
  device_mem tokens_out, logprobs_out, top_ids, top_logprobs, sample_stats;
  // Batch-1 decode in one kernel (kernels/decode_layers.cuh): its layer table, two residual
  // rows and barrier/merge workspace.
  device_mem fused_layers, fused_residual, fused_ws, fused_trace;
  void* out_host = nullptr;         // pinned: tokens, logprobs, top ids, top logprobs
  cudaEvent_t meta_sent = nullptr;  // the last upload of meta_host has been read
  uint32_t max_rows = 0, max_outputs = 0, rope_positions = 0;

  ~device_buffers() {
    if (meta_sent) cudaEventDestroy(meta_sent);
    if (meta_host) cudaFreeHost(meta_host);
    if (out_host) cudaFreeHost(out_host);
  }
  template <class T>
  T* host(uint64_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(meta_host) + offset);
  }
  template <class T>
  T* dev(uint64_t offset) const {
    return reinterpret_cast<T*>(meta_dev.as<char>() + offset);
  }
};

/// One forward pass: rows of several sequences (prefill) or one row per sequence (decode).
struct cuda_engine::pass {
  bool decode = false;
  uint32_t rows = 0;       // rows run (decode: the bucket, padding included)
  uint32_t real_rows = 0;  // decode: rows that are real sequences
  uint32_t seqs = 0;
  uint32_t max_seq_rows = 0;
  uint32_t blocks = 0;   // entries used in the blocks region
  uint32_t outputs = 0;  // rows sampled
  uint32_t max_splits = 1;
  uint32_t max_top = 0;
  // Host side of the sampled rows, in output order.
  std::vector<const msg::sampling_params*> sampling;
  std::vector<std::span<const int32_t>> context;
  std::vector<uint64_t> seeds, positions;
};

// ------------------------------------------------------------------- SM partitions and streams

namespace {

/// The SMs of one device that no green context of this process holds yet. The split API only
/// splits what a device or a (green) context reports, so the SMs left after a grant are parked
/// in a green context of their own (`rest`, never given work) and the next grant splits that:
/// the engines of one device get disjoint SMs.
struct sm_pool {
  bool started = false;       // false: nothing granted, the next grant splits the whole device
  CUdevResource left{};       // started: the SMs no engine holds (an output of the last split)
  CUgreenCtx rest = nullptr;  // a green context of `left`, so that it can be split again
  uint32_t live = 0;  // green contexts alive; at 0 the pool starts again from the whole device
};

struct sm_registry {
  std::mutex mutex;
  std::map<int, sm_pool> pools;  // by device
};

sm_registry& sm_pools() {
  static auto* const registry = new sm_registry;  // never freed, as drv()
  return *registry;
}

std::string share_text(double share) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", share);
  return text;
}

}  // namespace

struct cuda_engine::sm_partition {
  int device = 0;
  CUgreenCtx green = nullptr;
  CUcontext ctx = nullptr;  // cuCtxFromGreenCtx(green): what runtime calls see as current
  uint32_t sms = 0;
  bool registered = false;  // counted in sm_pools().pools[device].live

  sm_partition() = default;
  sm_partition(const sm_partition&) = delete;
  sm_partition& operator=(const sm_partition&) = delete;
  ~sm_partition() {
    if (green) drv().cuGreenCtxDestroy(green);
    if (!registered) return;
    sm_registry& registry = sm_pools();
    std::lock_guard lock(registry.mutex);
    sm_pool& pool = registry.pools[device];
    if (--pool.live == 0) {
      if (pool.rest) drv().cuGreenCtxDestroy(pool.rest);
      pool = sm_pool{};
    }
  }

  /// A green context of round(share x SMs) SMs (in the device's partition steps) taken from the
  /// SMs no other engine of this process holds. Needs the device's primary context current.
  static std::unique_ptr<sm_partition> make(int device, double share) {
    std::string what =
        "cuda_engine: sm_share " + share_text(share) + " on device " + std::to_string(device);
    auto fail = [&](const std::string& why) { throw std::runtime_error(what + ": " + why); };
    auto check = [&](CUresult r, const char* call) {
      if (r != CUDA_SUCCESS) fail(std::string(call) + " failed: " + cu_error_text(r));
    };
    if (!drv().missing.empty()) {
      int driver = 0;
      if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
      fail("SM shares need green contexts (a CUDA 12.4 or newer driver); this driver (" +
           std::to_string(driver / 1000) + "." + std::to_string(driver % 1000 / 10) +
           ") does not offer " + drv().missing);
    }
    CUdevice dev = 0;
    check(drv().cuDeviceGet(&dev, device), "cuDeviceGet");
    CUdevResource whole{};
    check(drv().cuDeviceGetDevResource(dev, &whole, CU_DEV_RESOURCE_TYPE_SM),
          "cuDeviceGetDevResource");
    const uint32_t total = whole.sm.smCount;
    const uint32_t step = std::max(1u, whole.sm.smCoscheduledAlignment);
    const uint32_t least = std::max(step, whole.sm.minSmPartitionSize);
    what += " (" + std::to_string(total) + " SMs, partitions of at least " + std::to_string(least) +
            " in steps of " + std::to_string(step) + ")";
    uint32_t want = static_cast<uint32_t>(partition_request(share, total, step, least));

    sm_registry& registry = sm_pools();
    std::lock_guard lock(registry.mutex);
    sm_pool& pool = registry.pools[device];
    uint32_t available = total;
    if (pool.started)
      available = pool.left.type == CU_DEV_RESOURCE_TYPE_SM ? pool.left.sm.smCount : 0;
    if (available < least) {
      fail("only " + std::to_string(available) +
           " SMs are left by the other engines of this process on the device");
    }
    // Rounding may ask for a few more than the others left: take what is left then.
    want = std::min(want, available);
    CUdevResource group{}, remaining{};
    if (pool.started && (want == available || !pool.rest)) {
      group = pool.left;  // all that is left (or what cannot be split again), whole
    } else {
      CUdevResource input = whole;
      if (pool.started) {
        check(drv().cuGreenCtxGetDevResource(pool.rest, &input, CU_DEV_RESOURCE_TYPE_SM),
              "cuGreenCtxGetDevResource");
      }
      unsigned int groups = 1;
      CUresult split =
          drv().cuDevSmResourceSplitByCount(&group, &groups, &input, &remaining, 0, want);
      if (split != CUDA_SUCCESS || groups == 0) {
        // What an earlier split left need not be aligned to whole clusters: split it SM by SM.
        groups = 1;
        split = drv().cuDevSmResourceSplitByCount(&group, &groups, &input, &remaining,
                                                  CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING,
                                                  want);
      }
      if (split != CUDA_SUCCESS || groups == 0) {
        fail("cannot split " + std::to_string(want) + " SMs from the " + std::to_string(available) +
             " available" + (split != CUDA_SUCCESS ? ": " + cu_error_text(split) : std::string()));
      }
    }
    auto part = std::make_unique<sm_partition>();
    part->device = device;
    CUdevResourceDesc desc = nullptr;
    check(drv().cuDevResourceGenerateDesc(&desc, &group, 1), "cuDevResourceGenerateDesc");
    check(drv().cuGreenCtxCreate(&part->green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM),
          "cuGreenCtxCreate");
    check(drv().cuCtxFromGreenCtx(&part->ctx, part->green), "cuCtxFromGreenCtx");
    part->sms = group.sm.smCount;
    // Park the rest for the next engine. Without a green context for it, the next engine can
    // only take it whole.
    CUgreenCtx rest = nullptr;
    if (remaining.type == CU_DEV_RESOURCE_TYPE_SM && remaining.sm.smCount > 0) {
      CUdevResourceDesc rest_desc = nullptr;
      if (drv().cuDevResourceGenerateDesc(&rest_desc, &remaining, 1) != CUDA_SUCCESS ||
          drv().cuGreenCtxCreate(&rest, rest_desc, dev, CU_GREEN_CTX_DEFAULT_STREAM) !=
              CUDA_SUCCESS) {
        rest = nullptr;
      }
    }
    if (pool.rest) drv().cuGreenCtxDestroy(pool.rest);
    pool.started = true;
    pool.left = remaining;
    pool.rest = rest;
    ++pool.live;
    part->registered = true;
    return part;
  }
};

namespace {

/// A stream destroyed with its last owner.
std::shared_ptr<void> owned_stream(cudaStream_t stream) {
  return std::shared_ptr<void>(stream, [](void* s) { cudaStreamDestroy(as_stream(s)); });
}

/// The stream that shared_stream engines of this process on `device` enqueue on, at the default
/// (lowest) priority. Needs `device` current.
std::shared_ptr<void> shared_device_stream(int device) {
  static std::mutex mutex;
  static std::map<int, std::weak_ptr<void>> streams;
  std::lock_guard lock(mutex);
  if (auto alive = streams[device].lock()) return alive;
  int least = 0, greatest = 0;
  CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, least));
  std::shared_ptr<void> owned = owned_stream(stream);
  streams[device] = owned;
  return owned;
}

}  // namespace

cuda_engine::device_scope::device_scope(void* green_ctx, int device, bool check) {
  if (!green_ctx) {
    const cudaError_t e = cudaSetDevice(device);
    if (check && e != cudaSuccess) cuda_fail(e, "cudaSetDevice(device)", __FILE__, __LINE__);
    return;
  }
  CUcontext previous = nullptr;
  CUresult r = drv().cuCtxGetCurrent(&previous);
  if (r == CUDA_SUCCESS) r = drv().cuCtxSetCurrent(static_cast<CUcontext>(green_ctx));
  if (r != CUDA_SUCCESS) {
    if (check) CU_CHECK(r);
    return;
  }
  previous_ = previous;
  restore_ = true;
}

cuda_engine::device_scope::~device_scope() {
  if (restore_) drv().cuCtxSetCurrent(static_cast<CUcontext>(previous_));
}

cuda_engine::device_scope cuda_engine::bind_device(bool check) const {
  return device_scope(partition_ ? partition_->ctx : nullptr, params_.device, check);
}

// ------------------------------------------------------------------------------------- engine

cuda_engine::cuda_engine(const std::filesystem::path& model_dir, cuda_engine_params params)
    : params_(std::move(params)), buf_(std::make_unique<device_buffers>()) {
  if (params_.block_tokens == 0)
    throw std::invalid_argument("cuda_engine: block_tokens must be positive");
  if (params_.max_context == 0)
    throw std::invalid_argument("cuda_engine: max_context must be positive");
  if (params_.max_batch == 0)
    throw std::invalid_argument("cuda_engine: max_batch must be positive");
  if (params_.prefill_tokens == 0)
    throw std::invalid_argument("cuda_engine: prefill_tokens must be positive");
  if (!(params_.sm_share > 0.0 && params_.sm_share <= 1.0))
    throw std::invalid_argument("cuda_engine: sm_share must be in (0, 1]");
  if (params_.shared_stream && params_.sm_share < 1.0)
    throw std::invalid_argument("cuda_engine: a shared stream runs on the whole GPU (sm_share 1)");
  int devices = 0;
  CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (params_.device < 0 || params_.device >= devices) {
    throw std::runtime_error("cuda_engine: device " + std::to_string(params_.device) +
                             " does not exist (" + std::to_string(devices) + " CUDA devices)");
  }
  CUDA_CHECK(cudaSetDevice(params_.device));
  {
    const transformer_config c = load_hf_config(model_dir);  // shape checks before the big load
    if (c.head_dim != 128)
      throw std::runtime_error("cuda_engine: head_dim " + std::to_string(c.head_dim) +
                               " is not supported (128 only)");
    if (c.num_attention_heads / c.num_key_value_heads > 16)
      throw std::runtime_error("cuda_engine: more than 16 query heads per KV head");
    if (c.hidden_size % 8 || c.intermediate_size % 8)
      throw std::runtime_error("cuda_engine: hidden and FFN sizes must be multiples of 8");
  }
  // Before the big load, so an impossible split fails fast; the primary context is current.
  if (params_.sm_share < 1.0) partition_ = sm_partition::make(params_.device, params_.sm_share);
  weights_ = load_cuda_weights_shared(model_dir, params_.device);  // primary context
  const device_scope bound = bind_device();  // everything below lives in the engine's context
  const transformer_config& c = weights_->config;
  const uint32_t hidden = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(),
                 ffn = c.intermediate_size;
  const uint32_t max_context = std::min(params_.max_context, c.max_position_embeddings);

  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, params_.device));
  sm_count_ = prop.multiProcessorCount;
  int least = 0, greatest = 0;
  CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  const int priority = params_.high_priority ? greatest : least;
  if (partition_) {
    // Kernel grids (split-K, attention splits) are sized for the SMs granted.
    sm_count_ = static_cast<int>(partition_->sms);
    CUstream stream = nullptr;
    CU_CHECK(
        drv().cuGreenCtxStreamCreate(&stream, partition_->green, CU_STREAM_NON_BLOCKING, priority));
    stream_owner_ = owned_stream(stream);
    std::fprintf(stderr, "cuda_engine: device %d: green context of %u of %d SMs (sm_share %g)\n",
                 params_.device, partition_->sms, prop.multiProcessorCount, params_.sm_share);
  } else if (params_.shared_stream) {
    stream_owner_ = shared_device_stream(params_.device);
    // Another engine's thread may enqueue on the shared stream at any time, which would land in
    // (and break) a capture there: decode graphs are captured on a private stream instead.
    cudaStream_t capture = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking));
    capture_owner_ = owned_stream(capture);
  } else {
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, priority));
    stream_owner_ = owned_stream(stream);
  }
  stream_ = stream_owner_.get();
  capture_stream_ = capture_owner_ ? capture_owner_.get() : stream_;
  if (partition_) {
    CUstream stream = nullptr;
    CU_CHECK(
        drv().cuGreenCtxStreamCreate(&stream, partition_->green, CU_STREAM_NON_BLOCKING, least));
    read_stream_owner_ = owned_stream(stream);
  } else {
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, least));
    read_stream_owner_ = owned_stream(stream);
  }

  device_buffers& b = *buf_;
  kcheck(b.gemm.init());
  b.max_rows = std::max(params_.prefill_tokens, params_.max_batch);
  const uint32_t max_seqs =
      std::max(params_.max_batch, std::min<uint32_t>(params_.prefill_tokens, 256));
  b.max_outputs = max_seqs;
  const uint32_t blocks_per_seq = (max_context + params_.block_tokens - 1) / params_.block_tokens;
  b.meta = meta_layout::make(b.max_rows, max_seqs, max_seqs * blocks_per_seq);
  CUDA_CHECK(cudaMallocHost(&b.meta_host, b.meta.bytes));
  CUDA_CHECK(cudaEventCreateWithFlags(&b.meta_sent, cudaEventDisableTiming));
  b.meta_dev = device_mem(b.meta.bytes);
  const uint64_t rows = b.max_rows;
  b.x = device_mem(rows * hidden * 2);
  b.h = device_mem(rows * hidden * 2);
  b.qkv = device_mem(rows * (qd + 2ull * kvd) * 2);
  b.attn = device_mem(rows * qd * 2);
  b.gate_up = device_mem(rows * 2ull * ffn * 2);
  b.act = device_mem(rows * uint64_t{ffn} * 2);
  b.delta = device_mem(rows * hidden * 2);
  b.hsel = device_mem(uint64_t{b.max_outputs} * hidden * 2);
  b.logits = device_mem(uint64_t{b.max_outputs} * c.vocab_size * 4);
  b.sample_stats = device_mem(k::sample_stats_bytes(b.max_outputs, c.vocab_size));
  const uint64_t attn_ws =
      k::decode_attention_workspace_bytes(params_.max_batch, c.num_attention_heads,
                                          c.num_key_value_heads, k::decode_attention_max_splits);
  b.attn_ws = device_mem(attn_ws);
  CUDA_CHECK(cudaMemset(b.attn_ws.ptr, 0, attn_ws));
  b.tokens_out = device_mem(uint64_t{b.max_outputs} * 4);
  b.logprobs_out = device_mem(uint64_t{b.max_outputs} * 4);
  b.top_ids = device_mem(uint64_t{b.max_outputs} * k::sampling_max_top * 4);
  b.top_logprobs = device_mem(uint64_t{b.max_outputs} * k::sampling_max_top * 4);
  CUDA_CHECK(
      cudaMallocHost(&b.out_host, uint64_t{b.max_outputs} * (2 + 2 * k::sampling_max_top) * 4));

  // RoPE tables, computed as the CPU engine computes them (transformers' float32 frequencies).
  {
    const rope_table table(c, max_context);
    const uint64_t n = uint64_t{max_context} * (c.head_dim / 2);
    b.rope_cos = device_mem(n * 4);
    b.rope_sin = device_mem(n * 4);
    CUDA_CHECK(cudaMemcpy(b.rope_cos.ptr, table.cos(0), n * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(b.rope_sin.ptr, table.sin(0), n * 4, cudaMemcpyHostToDevice));
    b.rope_positions = max_context;
  }

  // KV pool: one extra block takes the writes of padded decode rows.
  block_elems_ = k::kv_block_elems(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                   params_.block_tokens);
  const uint64_t block_bytes = block_elems_ * 2;
  allocate_pool(block_bytes);

  // The TMA prefill attention (variant 5) on Hopper when the block size suits it: 537 against 268
  // TFLOP/s for the mma.sync kernel at 8K on the H200 (docs/cuda-engine.md).
  const uint32_t bt = params_.block_tokens;
  if (k::prefill_attention_wgmma_available() && bt >= 8 && bt <= 128 && (bt & (bt - 1)) == 0)
    attention_variant_ = 5;
  if (const char* v = std::getenv("DUET_CUDA_ATTN_VARIANT"))
    attention_variant_ = static_cast<uint32_t>(std::atoi(v));
  if (const char* v = std::getenv("DUET_RESIDUAL_GEMM")) {
    residual_in_o_ = std::string_view(v) != "0";
    residual_in_down_ = residual_in_o_ && std::string_view(v) != "o";
  }
  if (const char* v = std::getenv("DUET_KV_READ_STAGING"))
    staged_reads_ = std::string_view(v) != "0";
  if (const char* v = std::getenv("DUET_SAMPLE_SPLIT")) split_sampling_ = std::string_view(v) != "0";
  // Multiples of 32 above 32: a batch of 129 runs 160 rows, not 256 (a bucket's GEMMs cost as
  // its rows do; docs/cuda-engine.md). DUET_DECODE_BUCKET_STEP=0: powers of two only.
  buckets_ = decode_graph_buckets(params_.max_batch, decode_bucket_step_from_env());
  prepare_fused_decode();

  info_.engine = "cuda";
  info_.model = params_.served_name;
  info_.vocab_size = c.vocab_size;
  info_.max_context = max_context;
  info_.block_tokens = params_.block_tokens;
  info_.block_bytes = block_bytes;
  info_.layout_hash = layout_hash(params_.served_name, "bf16", c.num_hidden_layers,
                                  c.num_key_value_heads, c.head_dim, params_.block_tokens);
  info_.eos_ids = c.eos_token_ids;
  // The worker's share, which kv_memory_fraction sized here rather than the config.
  info_.kv_blocks = params_.seat ? params_.seat.pool->arena->member_blocks(params_.seat.member) : kv_blocks_;
  if (params_.cuda_graphs && params_.graphs_at_start) capture_decode_graphs();
  if (params_.prefill_gemms_at_start) warm_prefill_gemms();
  CUDA_CHECK(cudaDeviceSynchronize());
}

void cuda_engine::warm_prefill_gemms() {
  // Every prefill pass size runs the plan of its bucket (kernels/gemm.cuh, gemm_plan_rows): make
  // and tune those now, with the shapes a pass runs, so no prompt length meets cuBLASLt's
  // heuristic, a tuning pass or a first kernel load in service. The outputs are scratch.
  const auto start = std::chrono::steady_clock::now();
  device_buffers& b = *buf_;
  const cuda_weights& w = *weights_;
  const transformer_config& c = w.config;
  const cudaStream_t s = as_stream(stream_);
  const uint32_t hidden = c.hidden_size, qd = c.q_dim(), ffn = c.intermediate_size;
  const uint32_t qkv_dim = qd + 2 * c.kv_dim();
  const cuda_weights::layer& L = w.layers.front();
  auto* x = b.x.as<uint16_t>();
  auto* h = b.h.as<uint16_t>();
  const std::vector<uint32_t> buckets = k::gemm_plan_buckets(b.max_rows);
  for (const uint32_t m : buckets) {
    k::gemm_params qkv{h, hidden, L.qkv, L.qkv_bias, b.qkv.ptr, qkv_dim, m, qkv_dim, hidden};
    k::gemm_params o{b.attn.as<uint16_t>(), qd, L.o, L.o_bias, residual_in_o_ ? b.x.ptr : b.delta.ptr,
                     hidden, m, hidden, qd};
    o.accumulate = residual_in_o_;
    k::gemm_params gate_up{h, hidden, L.gate_up, nullptr, b.gate_up.ptr, 2 * ffn, m, 2 * ffn, hidden};
    k::gemm_params down{b.act.as<uint16_t>(), ffn, L.down, nullptr,
                        residual_in_down_ ? static_cast<void*>(x) : b.delta.ptr, hidden, m, hidden, ffn};
    down.accumulate = residual_in_down_;
    for (k::gemm_params* g : {&qkv, &o, &gate_up, &down}) {
      g->w_static = true;
      kcheck(b.gemm.run(*g, s));
    }
    if (m <= b.max_outputs) {  // the LM head over the sampled rows
      k::gemm_params head{h, hidden, w.lm_head, nullptr, b.logits.ptr, c.vocab_size, m, c.vocab_size, hidden};
      head.y_fp32 = true;
      head.w_static = true;
      kcheck(b.gemm.run(head, s));
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  std::fprintf(stderr, "cuda_engine: device %d: prefill GEMMs of %zu pass sizes (%u to %u rows) ready in %lld ms\n",
               params_.device, buckets.size(), buckets.empty() ? 0 : buckets.front(),
               buckets.empty() ? 0 : buckets.back(),
               static_cast<long long>(ms));
}

void cuda_engine::capture_decode_graphs() {
  const auto start = std::chrono::steady_clock::now();
  std::vector<sample_result> results;
  std::vector<float> kept;
  // Every row padding: the pass writes only this engine's scratch block.
  for (const uint32_t rows : buckets_) decode_part({}, results, kept, rows);
  eager_steps_ = 0;  // those passes served no step
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  std::fprintf(stderr, "cuda_engine: device %d: %zu decode graphs (batches %u to %u) ready in %lld ms\n",
               params_.device, buckets_.size(), buckets_.front(), buckets_.back(),
               static_cast<long long>(ms));
}

cuda_engine::~cuda_engine() {
  {
    const device_scope bound = bind_device(false);
    // On a shared stream this also waits for the other engines' work queued there.
    if (stream_) cudaStreamSynchronize(as_stream(stream_));
    for (auto& [bucket, g] : graphs_) {
      if (g.exec) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g.exec));
    }
    for (auto& [handle, ptr] : opened_pools_) cudaIpcCloseMemHandle(ptr);
    if (copy_ids_) cudaFree(copy_ids_);
    pool_memory_.reset();  // the last member of a shared pool frees it
    buf_.reset();
    read_staging_.reset();
    capture_owner_.reset();
    stream_owner_.reset();  // a green context's streams go before the context
    read_stream_owner_.reset();
  }
  partition_.reset();
}

const transformer_config& cuda_engine::config() const {
  return weights_->config;
}
uint64_t cuda_engine::weight_bytes() const {
  return weights_->bytes;
}

std::span<const float> cuda_engine::last_logits(std::size_t i) const {
  const std::size_t v = info_.vocab_size;
  if ((i + 1) * v > logits_host_.size()) {
    throw std::out_of_range("cuda_engine::last_logits: no logits kept for output " +
                            std::to_string(i));
  }
  return {logits_host_.data() + i * v, v};
}

void cuda_engine::check_blocks(std::span<const uint32_t> blocks, uint64_t positions,
                               const char* what) const {
  const uint64_t needed = (positions + params_.block_tokens - 1) / params_.block_tokens;
  if (blocks.size() < needed) {
    throw std::invalid_argument(std::string("cuda_engine: ") + what + ": " +
                                std::to_string(positions) + " positions need " +
                                std::to_string(needed) + " blocks, the block table has " +
                                std::to_string(blocks.size()));
  }
  for (uint64_t i = 0; i < needed; ++i) {
    if (blocks[i] >= kv_blocks_) {
      throw std::invalid_argument(std::string("cuda_engine: ") + what + ": block " +
                                  std::to_string(blocks[i]) + " is outside the pool of " +
                                  std::to_string(kv_blocks_));
    }
  }
}

uint32_t cuda_engine::bucket_of(uint32_t rows) const { return decode_graph_rows(buckets_, rows); }

uint32_t cuda_engine::splits_for(uint32_t rows) const {
  return k::decode_attention_splits(rows, weights_->config.num_key_value_heads,
                                    static_cast<uint32_t>(sm_count_));
}

void cuda_engine::upload(const pass& ps) {
  const device_buffers& b = *buf_;
  const uint64_t bytes = b.meta.blocks + uint64_t{ps.blocks} * 4;
  CUDA_CHECK(cudaMemcpyAsync(b.meta_dev.ptr, b.meta_host, bytes, cudaMemcpyHostToDevice,
                             as_stream(stream_)));
  CUDA_CHECK(cudaEventRecord(b.meta_sent, as_stream(stream_)));
}

void cuda_engine::forward(const pass& ps, void* stream) {
  if (!(ps.decode && ps.rows == 1 && run_fused_layers(stream))) forward_layers(ps, stream);
  forward_head(ps, stream);
}

void cuda_engine::prepare_fused_decode() {
  const char* env = std::getenv("DUET_DECODE_FUSED");
  const bool wanted = env && *env ? std::string_view(env) != "0" : params_.fused_decode;
  const cuda_weights& w = *weights_;
  const transformer_config& c = w.config;
  if (!wanted || !k::decode_layers_supported(c.hidden_size, c.num_attention_heads,
                                             c.num_key_value_heads, c.head_dim,
                                             c.intermediate_size))
    return;
  device_buffers& b = *buf_;
  k::decode_layers_params p = fused_params();
  fused_ctas_ = k::decode_layers_ctas(p, static_cast<uint32_t>(sm_count_));
  if (fused_ctas_ == 0) return;
  std::vector<k::decode_layer_weights> table;
  for (const cuda_weights::layer& L : w.layers)
    table.push_back({L.input_norm, L.qkv, L.qkv_bias, L.o, L.o_bias, L.post_norm, L.gate_up, L.down});
  b.fused_layers = device_mem(table.size() * sizeof(k::decode_layer_weights));
  CUDA_CHECK(cudaMemcpy(b.fused_layers.ptr, table.data(), table.size() * sizeof(table[0]),
                        cudaMemcpyHostToDevice));
  b.fused_residual = device_mem(2ull * c.hidden_size * 2);
  const uint64_t ws = k::decode_layers_workspace_bytes(c.num_hidden_layers, c.num_attention_heads,
                                                       c.num_key_value_heads, fused_ctas_);
  b.fused_ws = device_mem(ws);
  CUDA_CHECK(cudaMemset(b.fused_ws.ptr, 0, ws));
  if (const char* v = std::getenv("DUET_DECODE_FUSED_POLL_NS"))
    fused_poll_ns_ = static_cast<uint32_t>(std::atoi(v));
  if (const char* v = std::getenv("DUET_DECODE_FUSED_L2_KB"))
    fused_l2_bytes_ = static_cast<uint32_t>(std::atoi(v)) * 1024;
  if (const char* v = std::getenv("DUET_DECODE_TRACE"); v && *v) {
    fused_trace_path_ = v;
    b.fused_trace = device_mem(k::decode_layers_trace_words(c.num_hidden_layers, fused_ctas_) * 8);
  }
}

void cuda_engine::write_fused_trace(uint32_t context) const {
  const uint64_t words = k::decode_layers_trace_words(weights_->config.num_hidden_layers, fused_ctas_);
  std::vector<uint64_t> t(words);
  CUDA_CHECK(cudaMemcpy(t.data(), buf_->fused_trace.ptr, words * 8, cudaMemcpyDeviceToHost));
  const uint32_t barriers = k::decode_layers_barriers(weights_->config.num_hidden_layers);
  // One file per power of two of the context: PATH.<2^k>.csv holds the last such step.
  uint32_t bucket = 1;
  while (bucket * 2 <= context) bucket *= 2;
  const std::string path = fused_trace_path_ + "." + std::to_string(bucket) + ".csv";
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return;
  std::fprintf(f, "barrier,cta,start_ns,arrive_ns,release_ns\n");
  for (uint32_t bar = 0; bar < barriers; ++bar) {
    for (uint32_t cta = 0; cta < fused_ctas_; ++cta) {
      std::fprintf(f, "%u,%u,%llu,%llu,%llu\n", bar, cta,
                   static_cast<unsigned long long>(t[2ull * barriers * fused_ctas_ + cta]),
                   static_cast<unsigned long long>(t[(2ull * bar) * fused_ctas_ + cta]),
                   static_cast<unsigned long long>(t[(2ull * bar + 1) * fused_ctas_ + cta]));
    }
  }
  std::fclose(f);
}

k::decode_layers_params cuda_engine::fused_params() const {
  const device_buffers& b = *buf_;
  const cuda_weights& w = *weights_;
  const transformer_config& c = w.config;
  k::decode_layers_params p;
  p.layers = b.fused_layers.as<k::decode_layer_weights>();
  p.layer_count = c.num_hidden_layers;
  p.embedding = w.embedding;
  p.final_norm = w.final_norm;
  p.vocab = c.vocab_size;
  p.hidden = c.hidden_size;
  p.heads = c.num_attention_heads;
  p.kv_heads = c.num_key_value_heads;
  p.ffn = c.intermediate_size;
  p.eps = static_cast<float>(c.rms_norm_eps);
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  p.token = b.dev<int32_t>(b.meta.tokens);
  p.position = b.dev<int32_t>(b.meta.positions);
  p.slot = b.dev<int32_t>(b.meta.slots);
  p.seq_len = b.dev<int32_t>(b.meta.seq_lens);
  p.block_table = b.dev<int32_t>(b.meta.blocks);  // one sequence: its table starts at 0
  p.kv = k::kv_pool_view{static_cast<uint16_t*>(pool_), block_elems_, c.num_hidden_layers,
                         c.num_key_value_heads, c.head_dim, params_.block_tokens, pool_slots_};
  p.rope_cos = b.rope_cos.as<float>();
  p.rope_sin = b.rope_sin.as<float>();
  p.rope_positions = b.rope_positions;
  p.residual = b.fused_residual.as<uint16_t>();
  p.qkv = b.qkv.as<uint16_t>();
  p.attn = b.attn.as<uint16_t>();
  p.gate_up = b.gate_up.as<uint16_t>();
  p.delta = b.delta.as<uint16_t>();
  p.out = b.h.as<uint16_t>();
  p.workspace = b.fused_ws.ptr;
  p.poll_ns = fused_poll_ns_;
  p.l2_prefetch_bytes = fused_l2_bytes_;
  p.trace = b.fused_trace.as<uint64_t>();
  return p;
}

bool cuda_engine::run_fused_layers(void* stream) {
  if (fused_ctas_ == 0) return false;
  const k::kstatus st = k::decode_layers(fused_params(), fused_ctas_, as_stream(stream));
  if (st.ok()) return true;
  if (st.code != cudaErrorCooperativeLaunchTooLarge) kcheck(st);
  // The SMs it was sized for are not all free to it (another context holds some): kernels apart.
  cudaGetLastError();
  std::fprintf(stderr, "cuda_engine: device %d: batch-1 decode kernel cannot have its %u CTAs "
               "resident; running the layers' kernels apart\n", params_.device, fused_ctas_);
  fused_ctas_ = 0;
  return false;
}

void cuda_engine::forward_layers(const pass& ps, void* stream) {
  device_buffers& b = *buf_;
  const cuda_weights& w = *weights_;
  const transformer_config& c = w.config;
  const cudaStream_t s = as_stream(stream);
  const uint32_t hidden = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(),
                 ffn = c.intermediate_size;
  const uint32_t qkv_dim = qd + 2 * kvd;
  const uint32_t rows = ps.rows;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  const k::kv_pool_view kv{static_cast<uint16_t*>(pool_), block_elems_, c.num_hidden_layers,
                           c.num_key_value_heads,         c.head_dim,   params_.block_tokens,
                           pool_slots_};
  auto* x = b.x.as<uint16_t>();
  auto* h = b.h.as<uint16_t>();
  auto* qkv = b.qkv.as<uint16_t>();
  auto* attn = b.attn.as<uint16_t>();
  auto* gu = b.gate_up.as<uint16_t>();
  auto* delta = b.delta.as<uint16_t>();
  // Prefill: the o and down GEMMs add their product to x (one rounding, where a separate add
  // rounds the product and then the sum), and the RMSNorm after each only normalizes x. Decode
  // keeps the separate add: its skinny GEMVs do not accumulate, and its activations are small.
  const bool accumulate_o = !ps.decode && residual_in_o_;
  const bool accumulate_down = !ps.decode && residual_in_down_;
  // One row (batch-1 decode) not accumulating: SwiGLU is applied inside the down projection's
  // skinny GEMM, which writes delta.
  const bool fused_swiglu = rows == 1 && !accumulate_down && k::gemm_skinny_enabled();
  const uint16_t* pending = nullptr;  // the product the next RMSNorm adds to x, if not yet added

  kcheck(k::embedding_gather(
      {w.embedding, b.dev<int32_t>(b.meta.tokens), x, rows, hidden, c.vocab_size}, s));
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    const cuda_weights::layer& L = w.layers[l];
    kcheck(k::add_rmsnorm({x, pending, L.input_norm, h, rows, hidden, eps}, s));
    k::gemm_params g{h, hidden, L.qkv, L.qkv_bias, qkv, qkv_dim, rows, qkv_dim, hidden};
    g.w_static = true;
    kcheck(b.gemm.run(g, s));
    k::rope_params rp;
    rp.x = qkv;
    rp.row_stride = qkv_dim;
    rp.positions = b.dev<int32_t>(b.meta.positions);
    rp.cos = b.rope_cos.as<float>();
    rp.sin = b.rope_sin.as<float>();
    rp.rows = rows;
    rp.q_heads = c.num_attention_heads;
    rp.k_heads = c.num_key_value_heads;
    rp.head_dim = c.head_dim;
    rp.max_positions = b.rope_positions;
    rp.slots = b.dev<int32_t>(b.meta.slots);
    rp.kv = kv;
    rp.layer = l;
    kcheck(k::rope_apply(rp, s));
    if (ps.decode) {
      k::decode_attention_params ap;
      ap.q = qkv;
      ap.q_stride = qkv_dim;
      ap.out = attn;
      ap.out_stride = qd;
      ap.kv = kv;
      ap.layer = l;
      ap.block_table = b.dev<int32_t>(b.meta.blocks);
      ap.seq_table = b.dev<int32_t>(b.meta.seq_table);
      ap.seq_lens = b.dev<int32_t>(b.meta.seq_lens);
      ap.batch = rows;
      ap.heads = c.num_attention_heads;
      ap.kv_heads = c.num_key_value_heads;
      ap.scale = scale;
      ap.max_splits = ps.max_splits;
      ap.split_min_keys = 64;
      ap.variant = attention_variant_;
      ap.workspace = b.attn_ws.ptr;
      ap.workspace_batch = params_.max_batch;  // one workspace for every bucket
      kcheck(k::decode_attention(ap, s));
    } else {
      k::prefill_attention_params ap;
      ap.q = qkv;
      ap.q_stride = qkv_dim;
      ap.out = attn;
      ap.out_stride = qd;
      ap.kv = kv;
      ap.layer = l;
      ap.block_table = b.dev<int32_t>(b.meta.blocks);
      ap.seq_rows = b.dev<int32_t>(b.meta.seq_rows);
      ap.seq_start = b.dev<int32_t>(b.meta.seq_start);
      ap.seq_table = b.dev<int32_t>(b.meta.seq_table);
      ap.seqs = ps.seqs;
      ap.max_seq_rows = ps.max_seq_rows;
      ap.heads = c.num_attention_heads;
      ap.kv_heads = c.num_key_value_heads;
      ap.scale = scale;
      ap.variant = attention_variant_;
      kcheck(k::prefill_attention(ap, s));
    }
    k::gemm_params o{attn, qd, L.o, L.o_bias, accumulate_o ? x : delta, hidden, rows, hidden, qd};
    o.w_static = true;
    o.accumulate = accumulate_o;
    kcheck(b.gemm.run(o, s));
    kcheck(k::add_rmsnorm({x, accumulate_o ? nullptr : delta, L.post_norm, h, rows, hidden, eps}, s));
    k::gemm_params gate_up{h, hidden, L.gate_up, nullptr, gu, 2 * ffn, rows, 2 * ffn, hidden};
    gate_up.w_static = true;
    kcheck(b.gemm.run(gate_up, s));
    if (fused_swiglu) {
      k::gemm_params down{gu, 2 * ffn, L.down, nullptr, delta, hidden, rows, hidden, ffn};
      down.x_swiglu = true;
      down.w_static = true;
      kcheck(b.gemm.run(down, s));
    } else {
      kcheck(k::silu_mul({gu, b.act.as<uint16_t>(), rows, ffn}, s));
      k::gemm_params down{b.act.as<uint16_t>(), ffn, L.down, nullptr, accumulate_down ? x : delta,
                          hidden, rows, hidden, ffn};
      down.w_static = true;
      down.accumulate = accumulate_down;
      kcheck(b.gemm.run(down, s));
    }
    pending = accumulate_down ? nullptr : delta;
  }
  kcheck(k::add_rmsnorm({x, pending, w.final_norm, h, rows, hidden, eps}, s));
}

void cuda_engine::forward_head(const pass& ps, void* stream) {
  if (ps.outputs == 0) return;
  device_buffers& b = *buf_;
  const cuda_weights& w = *weights_;
  const transformer_config& c = w.config;
  const cudaStream_t s = as_stream(stream);
  const uint32_t hidden = c.hidden_size;
  const uint32_t rows = ps.rows;
  const uint16_t* h = b.h.as<uint16_t>();
  const uint16_t* head_in = h;
  if (!ps.decode) {
    kcheck(k::embedding_gather(
        {h, b.dev<int32_t>(b.meta.out_rows), b.hsel.as<uint16_t>(), ps.outputs, hidden, rows}, s));
    head_in = b.hsel.as<uint16_t>();
  }
  const uint32_t out_rows = ps.decode ? rows : ps.outputs;
  k::gemm_params head{head_in,      hidden,   w.lm_head,    nullptr, b.logits.ptr,
                      c.vocab_size, out_rows, c.vocab_size, hidden};
  head.y_fp32 = true;
  head.w_static = true;
  kcheck(b.gemm.run(head, s));
  k::sample_params sp;
  sp.logits = b.logits.as<float>();
  sp.ld = c.vocab_size;
  sp.rows = out_rows;
  sp.vocab = c.vocab_size;
  sp.requests = b.dev<k::sample_row>(b.meta.requests);
  sp.tokens = b.tokens_out.as<int32_t>();
  sp.logprobs = b.logprobs_out.as<float>();
  sp.top_ids = b.top_ids.as<int32_t>();
  sp.top_logprobs = b.top_logprobs.as<float>();
  sp.max_top = ps.decode ? k::sampling_max_top : ps.max_top;
  if (split_sampling_) sp.stats = b.sample_stats.ptr;
  kcheck(k::sample_tokens(sp, s));
}

void cuda_engine::finish_samples(const pass& ps, std::vector<sample_result>& results,
                                 std::vector<float>& kept_logits) {
  device_buffers& b = *buf_;
  const cudaStream_t s = as_stream(stream_);
  const uint32_t n = ps.decode ? ps.real_rows : ps.outputs;
  auto* host_tokens = static_cast<int32_t*>(b.out_host);
  auto* host_logprobs = reinterpret_cast<float*>(host_tokens + b.max_outputs);
  auto* host_top_ids = reinterpret_cast<int32_t*>(host_logprobs + b.max_outputs);
  auto* host_top_lp =
      reinterpret_cast<float*>(host_top_ids + uint64_t{b.max_outputs} * k::sampling_max_top);
  CUDA_CHECK(cudaMemcpyAsync(host_tokens, b.tokens_out.ptr, n * 4, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaMemcpyAsync(host_logprobs, b.logprobs_out.ptr, n * 4, cudaMemcpyDeviceToHost, s));
  const uint32_t max_top = ps.decode ? k::sampling_max_top : ps.max_top;
  if (ps.max_top > 0) {
    CUDA_CHECK(cudaMemcpyAsync(host_top_ids, b.top_ids.ptr, uint64_t{n} * max_top * 4,
                               cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaMemcpyAsync(host_top_lp, b.top_logprobs.ptr, uint64_t{n} * max_top * 4,
                               cudaMemcpyDeviceToHost, s));
  }
  const uint32_t vocab = info_.vocab_size;
  std::vector<float> row_logits;
  const uint64_t kept_at = kept_logits.size();
  if (keep_logits_) {
    kept_logits.resize(kept_at + uint64_t{n} * vocab);
    CUDA_CHECK(cudaMemcpyAsync(kept_logits.data() + kept_at, b.logits.ptr, uint64_t{n} * vocab * 4,
                               cudaMemcpyDeviceToHost, s));
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
  for (uint32_t i = 0; i < n; ++i) {
    sample_result r;
    const msg::sampling_params* sp = ps.sampling[i];
    if (has_penalties(sp)) {
      // Penalties depend on the whole context: this row is sampled on the host (runtime/sampler).
      row_logits.resize(vocab);
      CUDA_CHECK(cudaMemcpy(row_logits.data(), b.logits.as<float>() + uint64_t{i} * vocab,
                            uint64_t{vocab} * 4, cudaMemcpyDeviceToHost));
      r = host_sampler_[0].sample(row_logits, sp, ps.context[i], ps.seeds[i], ps.positions[i]);
    } else {
      r.token = host_tokens[i];
      r.logprob = host_logprobs[i];
      const uint32_t want = sp ? std::min(sp->top_logprobs, k::sampling_max_top) : 0;
      for (uint32_t j = 0; j < want && j < max_top; ++j) {
        const int32_t id = host_top_ids[uint64_t{i} * max_top + j];
        if (id < 0) break;
        r.top.push_back({id, host_top_lp[uint64_t{i} * max_top + j]});
      }
    }
    results.push_back(std::move(r));
  }
}

step_output cuda_engine::prefill(std::span<const prefill_chunk> chunks) {
  const device_scope bound = bind_device();
  const uint32_t vocab = info_.vocab_size;
  for (const auto& ch : chunks) {
    if (ch.tokens.empty())
      throw std::invalid_argument("cuda_engine: prefill chunk of sequence " +
                                  std::to_string(ch.seq_id) + " is empty");
    const uint64_t end = uint64_t{ch.start} + ch.tokens.size();
    if (end > info_.max_context) {
      throw std::invalid_argument(
          "cuda_engine: sequence " + std::to_string(ch.seq_id) + " reaches position " +
          std::to_string(end) + ", over the context limit of " + std::to_string(info_.max_context));
    }
    for (int32_t t : ch.tokens) {
      if (t < 0 || static_cast<uint32_t>(t) >= vocab) {
        throw std::invalid_argument("cuda_engine: token " + std::to_string(t) + " of sequence " +
                                    std::to_string(ch.seq_id) + " is outside the vocabulary of " +
                                    std::to_string(vocab));
      }
    }
    check_blocks(ch.blocks, end, "prefill");
  }
  for (const auto& ch : chunks) {
    if (has_penalties(ch.sampling)) {
      auto& seen = prompt_tokens_[ch.seq_id];
      if (ch.start == 0) seen.clear();
      seen.insert(seen.end(), ch.tokens.begin(), ch.tokens.end());
    }
  }

  device_buffers& b = *buf_;
  const uint32_t bt = params_.block_tokens;
  std::vector<sample_result> results;
  std::vector<float> kept;
  // Passes of at most max_rows rows, max_seqs sequences and max_blocks block entries; a chunk
  // longer than a pass continues in the next (chunked prefill inside the engine).
  std::size_t ci = 0;
  uint32_t done_in_chunk = 0;
  while (ci < chunks.size()) {
    CUDA_CHECK(cudaEventSynchronize(b.meta_sent));  // the previous pass's upload has read meta_host
    pass ps;
    auto* tokens = b.host<int32_t>(b.meta.tokens);
    auto* positions = b.host<int32_t>(b.meta.positions);
    auto* slots = b.host<int32_t>(b.meta.slots);
    auto* seq_rows = b.host<int32_t>(b.meta.seq_rows);
    auto* seq_start = b.host<int32_t>(b.meta.seq_start);
    auto* seq_table = b.host<int32_t>(b.meta.seq_table);
    auto* out_rows = b.host<int32_t>(b.meta.out_rows);
    auto* requests = b.host<k::sample_row>(b.meta.requests);
    auto* blocks = b.host<int32_t>(b.meta.blocks);
    seq_rows[0] = 0;
    while (ci < chunks.size() && ps.rows < b.max_rows && ps.seqs < b.meta.max_seqs) {
      const prefill_chunk& ch = chunks[ci];
      const uint32_t first = ch.start + done_in_chunk;
      const uint32_t take = std::min<uint32_t>(
          static_cast<uint32_t>(ch.tokens.size()) - done_in_chunk, b.max_rows - ps.rows);
      const uint32_t table_len = (first + take + bt - 1) / bt;
      if (ps.blocks + table_len > b.meta.max_blocks) break;
      const uint32_t seq = ps.seqs++;
      seq_start[seq] = static_cast<int32_t>(first);
      seq_table[seq] = static_cast<int32_t>(ps.blocks);
      for (uint32_t i = 0; i < table_len; ++i)
        blocks[ps.blocks + i] = static_cast<int32_t>(ch.blocks[i]);
      ps.blocks += table_len;
      for (uint32_t i = 0; i < take; ++i) {
        const uint32_t pos = first + i;
        tokens[ps.rows + i] = ch.tokens[done_in_chunk + i];
        positions[ps.rows + i] = static_cast<int32_t>(pos);
        slots[ps.rows + i] = static_cast<int32_t>(ch.blocks[pos / bt] * bt + pos % bt);
      }
      ps.rows += take;
      seq_rows[seq + 1] = static_cast<int32_t>(ps.rows);
      ps.max_seq_rows = std::max(ps.max_seq_rows, take);
      done_in_chunk += take;
      if (done_in_chunk == ch.tokens.size()) {
        if (ch.last) {
          const uint32_t o = ps.outputs++;
          out_rows[o] = static_cast<int32_t>(ps.rows - 1);
          const msg::sampling_params* sp = ch.sampling;
          const uint64_t seed = sampler_seed(sp, ch.seq_id);
          const uint64_t position = uint64_t{ch.start} + ch.tokens.size();
          k::sample_row rq;
          if (sp) {
            rq.temperature = sp->temperature;
            rq.top_p = sp->top_p;
            rq.min_p = sp->min_p;
            rq.top_k = sp->top_k;
            rq.top_logprobs = std::min(sp->top_logprobs, k::sampling_max_top);
            ps.max_top = std::max(ps.max_top, rq.top_logprobs);
          }
          rq.uniform = sampler_uniform(seed, position);
          requests[o] = rq;
          ps.sampling.push_back(sp);
          std::span<const int32_t> context = ch.tokens;
          if (auto it = prompt_tokens_.find(ch.seq_id); it != prompt_tokens_.end())
            context = it->second;
          ps.context.push_back(context);
          ps.seeds.push_back(seed);
          ps.positions.push_back(position);
        }
        ++ci;
        done_in_chunk = 0;
      }
      if (ps.outputs == b.max_outputs) break;
    }
    upload(ps);
    forward(ps, stream_);
    if (ps.outputs > 0) finish_samples(ps, results, kept);
  }
  CUDA_CHECK(cudaStreamSynchronize(as_stream(stream_)));
  for (const auto& ch : chunks) {
    if (ch.last) prompt_tokens_.erase(ch.seq_id);
  }
  samples_ = std::move(results);
  logits_host_ = std::move(kept);
  step_output out;
  std::size_t next = 0;  // samples_ follows the `last` chunks in order
  for (const auto& ch : chunks) {
    if (ch.last && next < samples_.size()) step_output_push(out, samples_[next++], ch.sampling);
  }
  return out;
}

void cuda_engine::decode_part(std::span<const decode_slot> slots,
                              std::vector<sample_result>& results,
                              std::vector<float>& kept_logits, uint32_t rows) {
  device_buffers& b = *buf_;
  const uint32_t bt = params_.block_tokens;
  CUDA_CHECK(cudaEventSynchronize(b.meta_sent));
  pass ps;
  ps.decode = true;
  ps.real_rows = static_cast<uint32_t>(slots.size());
  ps.rows = rows > 0 ? rows : params_.cuda_graphs ? bucket_of(ps.real_rows) : ps.real_rows;
  ps.seqs = ps.rows;
  ps.outputs = ps.rows;
  ps.max_splits = splits_for(ps.rows);
  auto* tokens = b.host<int32_t>(b.meta.tokens);
  auto* positions = b.host<int32_t>(b.meta.positions);
  auto* slot_ids = b.host<int32_t>(b.meta.slots);
  auto* seq_table = b.host<int32_t>(b.meta.seq_table);
  auto* seq_lens = b.host<int32_t>(b.meta.seq_lens);
  auto* requests = b.host<k::sample_row>(b.meta.requests);
  auto* blocks = b.host<int32_t>(b.meta.blocks);
  for (uint32_t i = 0; i < ps.rows; ++i) {
    if (i < ps.real_rows) {
      const decode_slot& s = slots[i];
      const uint32_t len = static_cast<uint32_t>(s.history.size());
      const uint32_t pos = len - 1;
      tokens[i] = s.history.back();
      positions[i] = static_cast<int32_t>(pos);
      slot_ids[i] = static_cast<int32_t>(s.blocks[pos / bt] * bt + pos % bt);
      seq_lens[i] = static_cast<int32_t>(len);
      seq_table[i] = static_cast<int32_t>(ps.blocks);
      const uint32_t table_len = (len + bt - 1) / bt;
      for (uint32_t j = 0; j < table_len; ++j)
        blocks[ps.blocks + j] = static_cast<int32_t>(s.blocks[j]);
      ps.blocks += table_len;
      const msg::sampling_params* sp = s.sampling;
      const uint64_t seed = sampler_seed(sp, s.seq_id);
      k::sample_row rq;
      if (sp) {
        rq.temperature = sp->temperature;
        rq.top_p = sp->top_p;
        rq.min_p = sp->min_p;
        rq.top_k = sp->top_k;
        rq.top_logprobs = std::min(sp->top_logprobs, k::sampling_max_top);
        ps.max_top = std::max(ps.max_top, rq.top_logprobs);
      }
      rq.uniform = sampler_uniform(seed, s.history.size());
      requests[i] = rq;
      ps.sampling.push_back(sp);
      ps.context.push_back(s.history);
      ps.seeds.push_back(seed);
      ps.positions.push_back(s.history.size());
    } else {
      // Padding: one token at position 0 of the scratch block, greedy.
      tokens[i] = 0;
      positions[i] = 0;
      slot_ids[i] = static_cast<int32_t>(scratch_block_ * bt);
      seq_lens[i] = 1;
      seq_table[i] = static_cast<int32_t>(ps.blocks);
      blocks[ps.blocks++] = static_cast<int32_t>(scratch_block_);
      requests[i] = k::sample_row{};
    }
  }
  upload(ps);
  const cudaStream_t s = as_stream(stream_);
  bool replayed = false;
  if (params_.cuda_graphs) {
    decode_graph& g = graphs_[ps.rows];
    if (!g.exec && !g.failed) {
      // Warm up eagerly (GEMM plans and tuning happen outside capture), then capture (on
      // capture_stream_: nothing else enqueues there; the graph is launched on s).
      forward(ps, stream_);
      CUDA_CHECK(cudaStreamSynchronize(s));
      const cudaStream_t cs = as_stream(capture_stream_);
      CUDA_CHECK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
      bool captured = true;
      std::string why;
      try {
        forward(ps, capture_stream_);
      } catch (const std::exception& e) {
        captured = false;
        why = e.what();
      }
      cudaGraph_t graph = nullptr;
      const cudaError_t end = cudaStreamEndCapture(cs, &graph);
      cudaGraphExec_t exec = nullptr;
      if (captured && end == cudaSuccess && graph &&
          cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
        g.exec = exec;
        g.max_splits = ps.max_splits;
      } else {
        g.failed = true;
        cudaGetLastError();
        std::fprintf(stderr,
                     "cuda_engine: decode graph for batch %u not captured (%s); running eagerly\n",
                     ps.rows, why.empty() ? cudaGetErrorString(end) : why.c_str());
      }
      if (graph) cudaGraphDestroy(graph);
      // The warm-up pass already computed this step's outputs.
      ++eager_steps_;
      finish_samples(ps, results, kept_logits);
      return;
    }
    if (g.exec) {
      CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(g.exec), s));
      replayed = true;
      ++graph_steps_;
    }
  }
  if (!replayed) {
    forward(ps, stream_);
    ++eager_steps_;
  }
  finish_samples(ps, results, kept_logits);
  if (ps.rows == 1 && fused_ctas_ && !fused_trace_path_.empty())
    write_fused_trace(static_cast<uint32_t>(b.host<int32_t>(b.meta.seq_lens)[0]));
}

step_output cuda_engine::decode(std::span<const decode_slot> slots) {
  const device_scope bound = bind_device();
  const uint32_t vocab = info_.vocab_size;
  for (const auto& s : slots) {
    if (s.history.empty())
      throw std::invalid_argument("cuda_engine: decode slot of sequence " +
                                  std::to_string(s.seq_id) + " has no history");
    const uint64_t positions = s.history.size();
    if (positions > info_.max_context) {
      throw std::invalid_argument("cuda_engine: sequence " + std::to_string(s.seq_id) + " holds " +
                                  std::to_string(positions) +
                                  " tokens, over the context limit of " +
                                  std::to_string(info_.max_context));
    }
    const int32_t t = s.history.back();
    if (t < 0 || static_cast<uint32_t>(t) >= vocab) {
      throw std::invalid_argument("cuda_engine: token " + std::to_string(t) + " of sequence " +
                                  std::to_string(s.seq_id) + " is outside the vocabulary of " +
                                  std::to_string(vocab));
    }
    check_blocks(s.blocks, positions, "decode");
  }
  std::vector<sample_result> results;
  std::vector<float> kept;
  for (std::size_t at = 0; at < slots.size(); at += params_.max_batch) {
    decode_part(slots.subspan(at, std::min<std::size_t>(params_.max_batch, slots.size() - at)),
                results, kept);
  }
  samples_ = std::move(results);
  logits_host_ = std::move(kept);
  step_output out;
  for (std::size_t i = 0; i < samples_.size() && i < slots.size(); ++i) {
    step_output_push(out, samples_[i], slots[i].sampling);
  }
  return out;
}

void cuda_engine::release(uint64_t seq_id) {
  prompt_tokens_.erase(seq_id);
}

/// Two pinned buffers of at least one block each. A copy to pageable memory is staged by the
/// driver and returns only once it is done, while the step thread launches kernels on the same
/// context; here the copy engine fills one buffer while the host drains the other.
struct cuda_engine::read_staging {
  static constexpr uint64_t min_bytes = 8ull << 20;
  std::mutex mutex;  // read_blocks is const: callers on two threads must not share a buffer
  uint64_t bytes = 0;
  void* buffer[2] = {};
  cudaEvent_t filled[2] = {};
  explicit read_staging(uint64_t block_bytes) : bytes(std::max(min_bytes, block_bytes)) {
    for (int i = 0; i < 2; ++i) {
      CUDA_CHECK(cudaHostAlloc(&buffer[i], bytes, cudaHostAllocPortable));
      CUDA_CHECK(cudaEventCreateWithFlags(&filled[i], cudaEventDisableTiming));
    }
  }
  ~read_staging() {
    for (int i = 0; i < 2; ++i) {
      if (filled[i]) {
        cudaEventSynchronize(filled[i]);
        cudaEventDestroy(filled[i]);
      }
      if (buffer[i]) cudaFreeHost(buffer[i]);
    }
  }
  read_staging(const read_staging&) = delete;
  read_staging& operator=(const read_staging&) = delete;
};

void cuda_engine::read_blocks_staged(std::span<const uint32_t> blocks,
                                     std::span<std::byte> out) const {
  const uint64_t block_bytes = info_.block_bytes;
  std::call_once(read_staging_made_,
                 [&] { read_staging_ = std::make_unique<read_staging>(block_bytes); });
  read_staging& st = *read_staging_;
  const std::lock_guard lock(st.mutex);
  const cudaStream_t s = as_stream(read_stream_owner_.get());
  const std::size_t per_group = st.bytes / block_bytes;
  const std::size_t groups = (blocks.size() + per_group - 1) / per_group;
  auto drain = [&](std::size_t g) {  // group g from its buffer into `out`
    const std::size_t first = g * per_group, count = std::min(per_group, blocks.size() - first);
    CUDA_CHECK(cudaEventSynchronize(st.filled[g % 2]));
    std::memcpy(out.data() + first * block_bytes, st.buffer[g % 2], count * block_bytes);
  };
  for (std::size_t g = 0; g < groups; ++g) {
    // Its buffer was drained in the iteration before (group g - 2).
    auto* buffer = static_cast<char*>(st.buffer[g % 2]);
    const std::size_t first = g * per_group, end = std::min(first + per_group, blocks.size());
    for (std::size_t i = first; i < end;) {
      std::size_t run = 1;  // consecutive block ids: one copy
      while (i + run < end && blocks[i + run] == blocks[i] + run) ++run;
      CUDA_CHECK(
          cudaMemcpyAsync(buffer + (i - first) * block_bytes,
                          static_cast<const char*>(pool_) + uint64_t{blocks[i]} * block_bytes,
                          run * block_bytes, cudaMemcpyDeviceToHost, s));
      i += run;
    }
    CUDA_CHECK(cudaEventRecord(st.filled[g % 2], s));
    if (g > 0) drain(g - 1);
  }
  if (groups > 0) drain(groups - 1);
}

bool cuda_engine::read_blocks(std::span<const uint32_t> blocks, std::span<std::byte> out) const {
  if (out.size() != blocks.size() * info_.block_bytes) return false;
  for (uint32_t blk : blocks) {
    if (blk >= kv_blocks_) return false;
  }
  const device_scope bound = bind_device();
  if (staged_reads_) {
    read_blocks_staged(blocks, out);
    return true;
  }
  const cudaStream_t s = as_stream(read_stream_owner_.get());
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    CUDA_CHECK(cudaMemcpyAsync(out.data() + i * info_.block_bytes,
                               static_cast<char*>(pool_) + blocks[i] * info_.block_bytes,
                               info_.block_bytes, cudaMemcpyDeviceToHost, s));
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
  return true;
}

bool cuda_engine::write_blocks(std::span<const uint32_t> blocks, std::span<const std::byte> in) {
  if (in.size() != blocks.size() * info_.block_bytes) return false;
  for (uint32_t blk : blocks) {
    if (blk >= kv_blocks_) return false;
  }
  const device_scope bound = bind_device();
  const cudaStream_t s = as_stream(stream_);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(pool_) + blocks[i] * info_.block_bytes,
                               in.data() + i * info_.block_bytes, info_.block_bytes,
                               cudaMemcpyHostToDevice, s));
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
  return true;
}

namespace {

/// Blocks of a pool sized by `fraction` of `free_bytes`, less the scratch block, or `blocks`.
uint32_t pool_blocks(uint32_t blocks, double fraction, uint64_t free_bytes, uint64_t block_bytes) {
  if (fraction <= 0.0) return blocks;
  const auto sized = static_cast<uint32_t>(std::min<double>(4e9, free_bytes * fraction / block_bytes));
  if (sized < 2) throw std::runtime_error("cuda_engine: kv_memory_fraction leaves no room for a KV pool");
  return sized - 1;
}

std::shared_ptr<void> device_allocation(int device, uint64_t bytes, uint32_t blocks) {
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    char sizes[128];
    std::snprintf(sizes, sizeof sizes, " (%.1f GB; %.1f GB of %.1f free): ", bytes / 1e9, free_bytes / 1e9,
                  total / 1e9);
    throw std::runtime_error("cuda_engine: cannot allocate a KV pool of " + std::to_string(blocks) + " blocks" +
                             sizes + cudaGetErrorString(err) +
                             "; lower kv_blocks, or size the pool with kv_memory_fraction");
  }
  // Zeroed once: prefill attention's TMA variant copies whole blocks, and the slots past a
  // sequence's length, multiplied by probability 0, must hold finite values.
  if (const cudaError_t zeroed = cudaMemset(ptr, 0, bytes); zeroed != cudaSuccess) {
    cudaFree(ptr);
    throw std::runtime_error(std::string("cuda_engine: cannot clear the KV pool: ") + cudaGetErrorString(zeroed));
  }
  return std::shared_ptr<void>(ptr, [device](void* p) {
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device);
    cudaFree(p);
    cudaSetDevice(current);
  });
}

}  // namespace

void cuda_engine::allocate_pool(uint64_t block_bytes) {
  size_t free_bytes = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  if (!params_.seat) {
    kv_blocks_ = pool_blocks(params_.kv_blocks, params_.kv_memory_fraction, free_bytes, block_bytes);
    if (kv_blocks_ == 0) throw std::invalid_argument("cuda_engine: kv_blocks must be positive");
    if ((uint64_t{kv_blocks_} + 1) * params_.block_tokens >= (1ull << 31)) {
      throw std::invalid_argument("cuda_engine: KV pool over 2^31 token slots");
    }
    pool_memory_ = device_allocation(params_.device, (uint64_t{kv_blocks_} + 1) * block_bytes, kv_blocks_);
    pool_ = pool_memory_.get();
    pool_slots_ = kv_blocks_ + 1;
    scratch_block_ = kv_blocks_;
    return;
  }
  shared_kv_pool& shared = *params_.seat.pool;
  std::lock_guard lock(shared.mutex);
  if (!shared.arena) {
    // The first member sizes every member's share as if each had allocated in config order
    // (a fraction of what the members before it left free), plus a scratch block each.
    std::vector<uint32_t> blocks;
    uint64_t remaining = free_bytes, ids = 0;
    for (const actor_config* a : shared.members) {
      const uint32_t b = pool_blocks(a->kv_blocks, a->kv_memory_fraction, remaining, block_bytes);
      if (b == 0) throw std::invalid_argument("cuda_engine: kv_blocks must be positive");
      blocks.push_back(b);
      ids += b;
      remaining -= std::min<uint64_t>(remaining, (uint64_t{b} + 1) * block_bytes);
    }
    const uint64_t slots = ids + shared.members.size();
    if (slots * params_.block_tokens >= (1ull << 31)) {
      throw std::invalid_argument("cuda_engine: shared KV pool over 2^31 token slots");
    }
    shared.memory = device_allocation(params_.device, slots * block_bytes, static_cast<uint32_t>(ids));
    shared.base = static_cast<std::byte*>(shared.memory.get());
    shared.bytes = slots * block_bytes;
    shared.arena = std::make_shared<kv_arena>(blocks);
  }
  const uint64_t slots = uint64_t{shared.arena->total_blocks()} + shared.arena->members();
  if (shared.bytes != slots * block_bytes) {
    throw std::runtime_error("cuda_engine: the shared KV pool was laid out for another model or block size");
  }
  pool_memory_ = shared.memory;
  pool_ = shared.base;
  pool_slots_ = static_cast<uint32_t>(slots);
  kv_blocks_ = shared.arena->total_blocks();
  scratch_block_ = kv_blocks_ + params_.seat.member;
}

msg::kv_pool_export cuda_engine::export_pool() const {
  msg::kv_pool_export e;
  if (host_boot_id().empty()) return e;
  if (ipc_handle_hex_.empty()) {
    const device_scope bound = bind_device();
    cudaIpcMemHandle_t handle;
    if (cudaIpcGetMemHandle(&handle, pool_) != cudaSuccess) {
      cudaGetLastError();  // not shareable here (e.g. no IPC support): the stream path remains
      return e;
    }
    ipc_handle_hex_ = to_hex(std::as_bytes(std::span(handle.reserved)));
  }
  e.path = msg::kv_path::cuda_ipc;
  e.host = host_boot_id();
  e.pid = static_cast<int32_t>(::getpid());
  e.handle = ipc_handle_hex_;
  e.base = reinterpret_cast<uint64_t>(pool_);
  e.pool_bytes = uint64_t{kv_blocks_} * info_.block_bytes;
  e.device = params_.device;
  return e;
}

bool cuda_engine::import_blocks(const msg::kv_pool_export& from, std::span<const uint32_t> src,
                                std::span<const uint32_t> dst, std::string& error) {
  if (from.path != msg::kv_path::cuda_ipc || from.host != host_boot_id()) {
    error = "the source pool is not a CUDA IPC pool on this host";
    return false;
  }
  if (src.size() > dst.size()) {
    error = "fewer destination blocks than source blocks";
    return false;
  }
  const uint64_t block_bytes = info_.block_bytes;
  for (std::size_t i = 0; i < src.size(); ++i) {
    if ((uint64_t{src[i]} + 1) * block_bytes > from.pool_bytes) {
      error = "source block " + std::to_string(src[i]) + " is outside the exported pool";
      return false;
    }
    if (dst[i] >= kv_blocks_) {
      error = "destination block " + std::to_string(dst[i]) + " is outside this pool";
      return false;
    }
  }
  const device_scope bound = bind_device();
  const char* base = nullptr;
  if (from.pid == static_cast<int32_t>(::getpid())) {
    // The same process on another GPU: the gather kernel reads the pool over peer access.
    if (from.device != params_.device && !enable_peer(from.device, error)) return false;
    base = reinterpret_cast<const char*>(from.base);  // IPC handles cannot be opened by their exporter
  } else if (auto it = opened_pools_.find(from.handle); it != opened_pools_.end()) {
    base = static_cast<const char*>(it->second);
  } else {
    cudaIpcMemHandle_t handle;
    if (!from_hex(from.handle, std::as_writable_bytes(std::span(handle.reserved)))) {
      error = "malformed CUDA IPC handle";
      return false;
    }
    void* ptr = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();
      error = std::string("cannot open the owner's CUDA IPC handle: ") + cudaGetErrorString(err);
      return false;
    }
    opened_pools_[from.handle] = ptr;
    base = static_cast<const char*>(ptr);
  }
  if (src.empty()) return true;
  const cudaStream_t s = as_stream(stream_);
  if (!copy_ids_) {
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&copy_ids_), 2 * (uint64_t{kv_blocks_} + 1) * sizeof(uint32_t)));
  }
  std::vector<uint32_t> ids(src.begin(), src.end());
  ids.insert(ids.end(), dst.begin(), dst.begin() + static_cast<std::ptrdiff_t>(src.size()));
  CUDA_CHECK(cudaMemcpyAsync(copy_ids_, ids.data(), ids.size() * sizeof(uint32_t), cudaMemcpyHostToDevice, s));
  k::kv_copy_params copy;
  copy.src_pool = base;
  copy.dst_pool = pool_;
  copy.src_blocks = copy_ids_;
  copy.dst_blocks = copy_ids_ + src.size();
  copy.count = static_cast<uint32_t>(src.size());
  copy.block_bytes = block_bytes;
  const auto launched = k::kv_copy_blocks(copy, s);
  if (!launched.ok()) throw std::runtime_error("cuda_engine: " + launched.message());
  CUDA_CHECK(cudaStreamSynchronize(s));
  return true;
}

bool cuda_engine::enable_peer(int device, std::string& error) {
  if (peers_.count(device)) return true;
  int devices = 0;
  CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (device < 0 || device >= devices) {
    error = "the source pool is on device " + std::to_string(device) + ", which does not exist";
    return false;
  }
  int can = 0;
  CUDA_CHECK(cudaDeviceCanAccessPeer(&can, params_.device, device));
  if (!can) {
    error = "device " + std::to_string(params_.device) + " cannot access the memory of device " +
            std::to_string(device) + " (no peer access between them); use the stream transfer path";
    return false;
  }
  // Peer access belongs to the context (the primary one, also under a green context): once per
  // process and pair, so an earlier engine may have enabled it already.
  const cudaError_t e = cudaDeviceEnablePeerAccess(device, 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (e != cudaErrorPeerAccessAlreadyEnabled) {
      error = "cannot enable peer access from device " + std::to_string(params_.device) +
              " to device " + std::to_string(device) + ": " + cudaGetErrorString(e);
      return false;
    }
  }
  peers_.insert(device);
  return true;
}

std::unique_ptr<engine> make_cuda_engine(const deployment_config& config,
                                         const actor_config& actor, const kv_pool_seat& seat) {
  if (config.model.path.empty()) {
    throw std::runtime_error(
        "engine 'cuda' needs model.path: a Hugging Face model directory (config.json, "
        "*.safetensors)");
  }
  cuda_engine_params params;
  params.served_name = config.model.name;
  params.device = actor.device;
  params.kv_blocks = actor.kv_blocks;
  params.kv_memory_fraction = actor.kv_memory_fraction;
  params.block_tokens = config.model.block_tokens;
  params.max_context = config.model.max_context;
  params.max_batch = std::max(1u, actor.max_batch);
  params.prefill_tokens = std::max(1u, actor.chunk_tokens);
  params.high_priority = actor.role == actor_role::decode;
  // Prefill workers never decode; DUET_DECODE_GRAPHS_AT_START=0 captures on first use instead.
  const char* at_start = std::getenv("DUET_DECODE_GRAPHS_AT_START");
  params.graphs_at_start =
      actor.role == actor_role::decode && !(at_start && std::string_view(at_start) == "0");
  // Decode workers never prefill; DUET_PREFILL_GEMMS_AT_START=0 makes plans on first use instead.
  const char* gemms = std::getenv("DUET_PREFILL_GEMMS_AT_START");
  params.prefill_gemms_at_start =
      actor.role == actor_role::prefill && !(gemms && std::string_view(gemms) == "0");
  params.sm_share = actor.sm_share;
  params.shared_stream = actor.stream == "shared";
  params.seat = seat;
  return std::make_unique<cuda_engine>(config.model.path, std::move(params));
}

}  // namespace duet
