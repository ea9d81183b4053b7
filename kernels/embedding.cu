#include "kernels/device_util.cuh"
#include "kernels/embedding.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {

namespace {

__global__ void embedding_kernel(embedding_params p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const uint32_t row = blockIdx.x;
  const int32_t id = p.ids[row];
  const bool valid = id >= 0 && static_cast<uint32_t>(id) < p.vocab;
  const uint4* src =
      reinterpret_cast<const uint4*>(p.table + static_cast<uint64_t>(valid ? id : 0) * p.hidden);
  uint4* dst = reinterpret_cast<uint4*>(p.out + static_cast<uint64_t>(row) * p.hidden);
  for (uint32_t c = threadIdx.x; c < p.hidden / 8; c += blockDim.x)
    dst[c] = valid ? src[c] : make_uint4(0, 0, 0, 0);
}

}  // namespace

kstatus embedding_gather(const embedding_params& p, cudaStream_t stream) {
  DUET_KREQUIRE(p.hidden % 8 == 0 && p.hidden > 0,
                "embedding_gather: hidden must be a positive multiple of 8");
  DUET_KREQUIRE(p.table && p.ids && p.out, "embedding_gather: null pointer");
  if (p.rows == 0) return {};
  DUET_KCHECK(launch(embedding_kernel, dim3(p.rows), dim3(128), 0, stream, p));
  return {};
}

}  // namespace duet::kernels
