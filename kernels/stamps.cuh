// Per-CTA timestamps for profiling (benchmarks/prof_quant_stamps.py), compiled in only with -DMX_STAMPS: thread 0
// of each CTA (blockIdx.x < MX_STAMP_CTAS, blockIdx.y == 0) writes %globaltimer (ns) at a few points of its life
// into mx_stamps[4 * blockIdx.x + slot] (slots 0-1; slot 3: the CTA's SM, %smid); slot 2 (mx_stamp_last) is the
// atomicMax of every warp's lane 0, so the host zeroes mx_stamps before each launch. Without MX_STAMPS, mx_stamp and
// mx_stamp_last are empty and the kernels are unchanged.
#pragma once

#ifdef MX_STAMPS
#define MX_STAMP_CTAS 16384
__device__ unsigned long long mx_stamps[4 * MX_STAMP_CTAS];

__device__ __forceinline__ void mx_stamp(int slot) {
    if (threadIdx.x == 0 && blockIdx.x < MX_STAMP_CTAS && blockIdx.y == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        mx_stamps[4 * blockIdx.x + slot] = t;
        if (slot == 0) {
            unsigned s;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
            mx_stamps[4 * blockIdx.x + 3] = s;
        }
    }
}

// The latest of the CTA's warps (lane 0 of each, atomicMax): for the exit, which thread 0 alone would place at its
// own warp's end.
__device__ __forceinline__ void mx_stamp_last(int slot) {
    if ((threadIdx.x & 31) == 0 && blockIdx.x < MX_STAMP_CTAS && blockIdx.y == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        atomicMax(&mx_stamps[4 * blockIdx.x + slot], t);
    }
}
#else
__device__ __forceinline__ void mx_stamp(int) {}
__device__ __forceinline__ void mx_stamp_last(int) {}
#endif
