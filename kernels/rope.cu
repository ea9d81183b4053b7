#include "kernels/device_util.cuh"
#include "kernels/launch.cuh"
#include "kernels/rope.cuh"

namespace duet::kernels {

namespace {

// One CTA per row; thread t rotates pairs t, t + blockDim, ... of (head, i < half), then the
// V heads are copied in 16-byte chunks.
__global__ void rope_kernel(rope_params p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const uint32_t row = blockIdx.x;
  const uint32_t half = p.head_dim / 2;
  int32_t pos = p.positions[row];
  pos = pos < 0 ? 0
                : (static_cast<uint32_t>(pos) >= p.max_positions
                       ? static_cast<int32_t>(p.max_positions) - 1
                       : pos);
  const float* cs = p.cos + static_cast<uint64_t>(pos) * half;
  const float* sn = p.sin + static_cast<uint64_t>(pos) * half;
  uint16_t* x = p.x + static_cast<uint64_t>(row) * p.row_stride;
  const int32_t s = p.slots ? p.slots[row] : -1;
  uint16_t* block = nullptr;
  uint32_t slot = 0;
  if (s >= 0) {
    block = p.kv.pool +
            static_cast<uint64_t>(static_cast<uint32_t>(s) / p.kv.block_tokens) * p.kv.block_elems;
    slot = static_cast<uint32_t>(s) % p.kv.block_tokens;
  }
  const uint32_t pairs = (p.q_heads + p.k_heads) * half;
  for (uint32_t t = threadIdx.x; t < pairs; t += blockDim.x) {
    const uint32_t head = t / half, i = t % half;
    uint16_t* h = x + static_cast<uint64_t>(head) * p.head_dim;
    const float c = dev::rbf(cs[i]), sv = dev::rbf(sn[i]);
    const float a = dev::bf(h[i]), b = dev::bf(h[i + half]);
    const uint16_t ra = dev::to_bf(dev::rbf(a * c) + dev::rbf(-b * sv));
    const uint16_t rb = dev::to_bf(dev::rbf(b * c) + dev::rbf(a * sv));
    h[i] = ra;
    h[i + half] = rb;
    if (block && head >= p.q_heads) {
      uint16_t* k = block + p.kv.offset(p.layer, 0, head - p.q_heads, slot);
      k[i] = ra;
      k[i + half] = rb;
    }
  }
  if (block) {
    const uint32_t per_head = p.head_dim / 8;
    const uint4* v = reinterpret_cast<const uint4*>(
        x + static_cast<uint64_t>(p.q_heads + p.k_heads) * p.head_dim);
    for (uint32_t c = threadIdx.x; c < p.k_heads * per_head; c += blockDim.x) {
      uint16_t* dst = block + p.kv.offset(p.layer, 1, c / per_head, slot) + (c % per_head) * 8;
      *reinterpret_cast<uint4*>(dst) = v[c];
    }
  }
}

// The same, 8 pairs (16-byte vectors of both halves) per thread, when head_dim is a multiple of 16
// and rows are 16-byte aligned: ncu at 8,192 rows showed the pair-per-thread kernel at 1.8 TB/s
// (104 us per layer, floor 47 us), its 2-byte accesses using a fraction of each sector.
__global__ void rope_kernel_vec8(rope_params p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const uint32_t row = blockIdx.x;
  const uint32_t half = p.head_dim / 2, vecs = half / 8;
  int32_t pos = p.positions[row];
  pos = pos < 0 ? 0
                : (static_cast<uint32_t>(pos) >= p.max_positions
                       ? static_cast<int32_t>(p.max_positions) - 1
                       : pos);
  const float4* cs = reinterpret_cast<const float4*>(p.cos + static_cast<uint64_t>(pos) * half);
  const float4* sn = reinterpret_cast<const float4*>(p.sin + static_cast<uint64_t>(pos) * half);
  uint16_t* x = p.x + static_cast<uint64_t>(row) * p.row_stride;
  const int32_t s = p.slots ? p.slots[row] : -1;
  uint16_t* block = nullptr;
  uint32_t slot = 0;
  if (s >= 0) {
    block = p.kv.pool +
            static_cast<uint64_t>(static_cast<uint32_t>(s) / p.kv.block_tokens) * p.kv.block_elems;
    slot = static_cast<uint32_t>(s) % p.kv.block_tokens;
  }
  const uint32_t rotations = (p.q_heads + p.k_heads) * vecs;
  const uint32_t v_copies = block ? p.k_heads * (p.head_dim / 8) : 0;
  for (uint32_t t = threadIdx.x; t < rotations + v_copies; t += blockDim.x) {
    if (t >= rotations) {  // a 16-byte chunk of a V head into its slot
      const uint32_t c = t - rotations, per_head = p.head_dim / 8;
      const uint4* v = reinterpret_cast<const uint4*>(
          x + static_cast<uint64_t>(p.q_heads + p.k_heads) * p.head_dim);
      uint16_t* dst = block + p.kv.offset(p.layer, 1, c / per_head, slot) + (c % per_head) * 8;
      *reinterpret_cast<uint4*>(dst) = v[c];
      continue;
    }
    const uint32_t head = t / vecs, i = (t % vecs) * 8;
    uint4* lo_half = reinterpret_cast<uint4*>(x + static_cast<uint64_t>(head) * p.head_dim + i);
    uint4* hi_half =
        reinterpret_cast<uint4*>(x + static_cast<uint64_t>(head) * p.head_dim + half + i);
    float a[8], b[8], c[8], sv[8], ra[8], rb[8];
    dev::unpack8(*lo_half, a);
    dev::unpack8(*hi_half, b);
    const float4 c0 = cs[i / 4], c1 = cs[i / 4 + 1], s0 = sn[i / 4], s1 = sn[i / 4 + 1];
    c[0] = c0.x, c[1] = c0.y, c[2] = c0.z, c[3] = c0.w, c[4] = c1.x, c[5] = c1.y, c[6] = c1.z,
    c[7] = c1.w;
    sv[0] = s0.x, sv[1] = s0.y, sv[2] = s0.z, sv[3] = s0.w, sv[4] = s1.x, sv[5] = s1.y,
    sv[6] = s1.z, sv[7] = s1.w;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float ce = dev::rbf(c[e]), se = dev::rbf(sv[e]);
      ra[e] = dev::rbf(a[e] * ce) + dev::rbf(-b[e] * se);
      rb[e] = dev::rbf(b[e] * ce) + dev::rbf(a[e] * se);
    }
    const uint4 out_lo = dev::pack8(ra), out_hi = dev::pack8(rb);
    *lo_half = out_lo;
    *hi_half = out_hi;
    if (block && head >= p.q_heads) {
      uint16_t* k = block + p.kv.offset(p.layer, 0, head - p.q_heads, slot);
      *reinterpret_cast<uint4*>(k + i) = out_lo;
      *reinterpret_cast<uint4*>(k + half + i) = out_hi;
    }
  }
}

}  // namespace

kstatus rope_apply(const rope_params& p, cudaStream_t stream) {
  DUET_KREQUIRE(p.head_dim % 2 == 0 && p.head_dim > 0,
                "rope_apply: head_dim must be positive and even");
  DUET_KREQUIRE(p.max_positions > 0, "rope_apply: empty tables");
  DUET_KREQUIRE(p.x && p.positions && p.cos && p.sin, "rope_apply: null pointer");
  if (p.slots) {
    DUET_KREQUIRE(p.row_stride >= (p.q_heads + 2 * p.k_heads) * p.head_dim && p.row_stride % 8 == 0,
                  "rope_apply: row_stride must hold q, k and v heads and be a multiple of 8");
    DUET_KREQUIRE(p.head_dim % 8 == 0 && p.kv.head_dim == p.head_dim && p.kv.kv_heads == p.k_heads,
                  "rope_apply: KV pool shape differs from the heads");
    DUET_KREQUIRE(p.kv.pool && p.kv.block_tokens > 0 && p.layer < p.kv.layers,
                  "rope_apply: bad KV pool or layer");
  } else {
    DUET_KREQUIRE(p.row_stride >= (p.q_heads + p.k_heads) * p.head_dim,
                  "rope_apply: row_stride shorter than the heads");
  }
  if (p.rows == 0) return {};
  const bool vec8 =
      p.head_dim % 16 == 0 && p.row_stride % 8 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(p.cos) % 16 == 0 && reinterpret_cast<uintptr_t>(p.sin) % 16 == 0;
  DUET_KCHECK(launch(vec8 ? rope_kernel_vec8 : rope_kernel, dim3(p.rows), dim3(vec8 ? 128 : 256), 0,
                     stream, p));
  return {};
}

}  // namespace duet::kernels
