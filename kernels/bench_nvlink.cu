// NVLink store probes for benchmarks/prof_nvlink.py (not used by the library): how fast can one rank push bytes
// into every other rank's symmetric buffer (all ranks at once, all-to-all), and through which store path.
//   nvl_st   each warp copies 4 KB chunks: 8 x 16-byte loads per lane, then 16-byte st.global to every peer
//            (the dispatch kernels' path)
//   nvl_tma  each warp stages the chunk in shared memory (two buffers), then one lane issues one bulk copy
//            (cp.async.bulk.global.shared::cta, the TMA engine) per peer; a buffer is refilled once the bulk
//            copies that read it are done reading
// Rank me writes peer r's region at dst_off + me * bytes_per_peer (+ chunk offset); src holds bytes_per_peer bytes.
#define NVL_THREADS 512
#define NVL_CHUNK 4096

#include "bench_common.cuh"

extern "C" __global__ void __launch_bounds__(NVL_THREADS) nvl_st(const unsigned char* __restrict__ src,
                                                                 const unsigned long long* __restrict__ peers,
                                                                 long long dst_off, int W, int me,
                                                                 long long bytes_per_peer) {
    const int lane = threadIdx.x & 31;
    const long long nchunks = bytes_per_peer / NVL_CHUNK;
    const long long nw = (long long)gridDim.x * (NVL_THREADS / 32);
    for (long long c = blockIdx.x * (NVL_THREADS / 32) + (threadIdx.x >> 5); c < nchunks; c += nw) {
        uint4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = probe_ld(src + c * NVL_CHUNK + j * 512 + lane * 16);
        for (int k = 1; k < W; ++k) {
            const int r = (me + k) % W;
            unsigned char* dst = reinterpret_cast<unsigned char*>(peers[r] + dst_off) + me * bytes_per_peer +
                                 c * NVL_CHUNK;
#pragma unroll
            for (int j = 0; j < 8; ++j)
                asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst + j * 512 + lane * 16),
                             "r"(v[j].x), "r"(v[j].y), "r"(v[j].z), "r"(v[j].w)
                             : "memory");
        }
    }
}

extern "C" __global__ void __launch_bounds__(NVL_THREADS) nvl_tma(const unsigned char* __restrict__ src,
                                                                  const unsigned long long* __restrict__ peers,
                                                                  long long dst_off, int W, int me,
                                                                  long long bytes_per_peer) {
    extern __shared__ __align__(128) unsigned char nvl_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned char* buf = nvl_smem + warp * 2 * NVL_CHUNK;
    const long long nchunks = bytes_per_peer / NVL_CHUNK;
    const long long nw = (long long)gridDim.x * (NVL_THREADS / 32);
    int it = 0;
    for (long long c = blockIdx.x * (NVL_THREADS / 32) + warp; c < nchunks; c += nw, ++it) {
        unsigned char* b = buf + (it & 1) * NVL_CHUNK;
        uint4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = probe_ld(src + c * NVL_CHUNK + j * 512 + lane * 16);
        // the bulk copies issued two chunks ago read b: wait until at most one group (the last chunk's) is pending
        if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        __syncwarp();
#pragma unroll
        for (int j = 0; j < 8; ++j) *reinterpret_cast<uint4*>(b + j * 512 + lane * 16) = v[j];
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic-proxy smem writes -> TMA reads
        __syncwarp();
        if (lane == 0) {
            const unsigned sb = (unsigned)__cvta_generic_to_shared(b);
            for (int k = 1; k < W; ++k) {
                const int r = (me + k) % W;
                unsigned char* dst = reinterpret_cast<unsigned char*>(peers[r] + dst_off) + me * bytes_per_peer +
                                     c * NVL_CHUNK;
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(sb),
                             "r"(NVL_CHUNK)
                             : "memory");
            }
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
    }
    if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
