#include "kernels/device_util.cuh"
#include "kernels/kv_copy.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {

namespace {

constexpr uint32_t threads = 256;
constexpr uint32_t unroll = 4;
constexpr uint64_t piece_bytes = uint64_t{threads} * unroll * 16;  // 16 KiB per CTA

__global__ void kv_copy_kernel(kv_copy_params p, uint64_t pieces_per_block) {
  dev::pdl_wait();
  const uint64_t piece = blockIdx.x;
  const uint32_t i = static_cast<uint32_t>(piece / pieces_per_block);
  const uint64_t offset = (piece % pieces_per_block) * piece_bytes;
  const auto* src = reinterpret_cast<const uint4*>(static_cast<const char*>(p.src_pool) +
                                                   uint64_t{p.src_blocks[i]} * p.block_bytes + offset);
  auto* dst = reinterpret_cast<uint4*>(static_cast<char*>(p.dst_pool) + uint64_t{p.dst_blocks[i]} * p.block_bytes +
                                       offset);
  const uint64_t vectors = min(piece_bytes, p.block_bytes - offset) / 16;
  uint4 v[unroll];
#pragma unroll
  for (uint32_t k = 0; k < unroll; ++k) {
    const uint64_t at = threadIdx.x + uint64_t{k} * threads;
    if (at < vectors) v[k] = __ldg(src + at);
  }
#pragma unroll
  for (uint32_t k = 0; k < unroll; ++k) {
    const uint64_t at = threadIdx.x + uint64_t{k} * threads;
    if (at < vectors) dst[at] = v[k];
  }
}

}  // namespace

kstatus kv_copy_blocks(const kv_copy_params& p, cudaStream_t stream) {
  DUET_KREQUIRE(p.block_bytes > 0 && p.block_bytes % 16 == 0, "kv_copy_blocks: block_bytes must be a positive multiple of 16");
  if (p.count == 0) return {};
  DUET_KREQUIRE(p.src_pool && p.dst_pool && p.src_blocks && p.dst_blocks, "kv_copy_blocks: null pointer");
  const uint64_t pieces_per_block = (p.block_bytes + piece_bytes - 1) / piece_bytes;
  const uint64_t pieces = pieces_per_block * p.count;
  DUET_KREQUIRE(pieces < (1ull << 31), "kv_copy_blocks: too many blocks for one launch");
  DUET_KCHECK(launch(kv_copy_kernel, dim3(static_cast<uint32_t>(pieces)), dim3(threads), 0, stream, p,
                     pieces_per_block));
  return {};
}

}  // namespace duet::kernels
