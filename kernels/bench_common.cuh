// Helpers shared by the benchmark-only probe kernels (bench_probe.cu, bench_nvlink.cu).
#pragma once

// 16-byte streaming load (no L1 allocation); volatile so that a probe's loads are never dropped or merged
__device__ __forceinline__ uint4 probe_ld(const unsigned char* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
