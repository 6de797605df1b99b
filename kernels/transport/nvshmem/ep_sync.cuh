// Flags, waits with timeouts and error reporting shared by the NVSHMEM transport kernels
// (layout.cu, dispatch.cu, combine.cu; moe_ep/transport/layout.py and cuda.py launch them; the protocol:
// docs/design-transport.md).
//
// Every rank owns one NVSHMEM symmetric region; `peers[r]` is the address of rank r's region as seen from this
// GPU (nvshmem_ptr; peers[me] is the local address). The first bytes of the region are flag words:
//   flags[kind * EP_MAX_RANKS + src]   (u64, written by rank `src` into this rank's region with st.release.sys)
// Each transport phase (layout, dispatch, combine) uses a monotonically increasing epoch u, every rank advancing it
// in the same order; no device-side reset of a flag is ever needed. The count of completed uses of each phase lives
// in device memory (`epoch_ctr`, one u64 per phase, never in a launch argument): every kernel of a use reads
// u = *epoch_ctr + 1 at its start, and the kernel that ends the use (the one that signals *_FREE) stores u from its
// last CTA, after every CTA has read it. So a captured CUDA graph replays any number of times, interleaved with eager
// calls, and each replay takes the next epoch.
//   *_READY[src] = u   rank src finished writing its rows for use u into this rank's buffer
//   *_FREE[dst]  = u   rank dst finished reading what this rank wrote for use u (its buffer may be reused)
// A sender of use u waits FREE[r] >= u-1 for every receiver r; a receiver waits READY[s] >= u for every sender s.
// The fused kernels (ep_dispatch_mx, ep_combine) replace READY by per-row flags (below); FREE stays.
//
// Errors: the first error is recorded in `err` (device, elects one writer) and mirrored with details into
// host-mapped pinned memory `herr` (read by the host without a CUDA sync). Timeouts are fatal (err[1] = 1): every
// later wait returns at once instead of spinning. Other errors keep the protocol consistent (the offending rows
// are skipped, nothing is written past a buffer) so the runtime stays usable after the host raises.
#pragma once

typedef unsigned long long ep_u64;

#define EP_MAX_RANKS 8
#define EP_MAX_TOPK 32

#define F_LAYOUT_READY 0
#define F_LAYOUT_FREE 1
#define F_DISP_READY 2
#define F_DISP_FREE 3
#define F_COMB_READY 4
#define F_COMB_FREE 5
#define F_NUM 6

#define EP_ERR_INVALID_EXPERT 1   // a: token, b: slot, c: expert id
#define EP_ERR_RECV_OVERFLOW 2    // a: receiving rank, b: rows it would receive, c: capacity
#define EP_ERR_EXPAND_OVERFLOW 3  // a: receiving rank, b: expanded rows, c: capacity
#define EP_ERR_TIMEOUT 4          // a: flag kind, b: peer, c: this rank

// Control block passed to every kernel (by pointers): err [4] int32 device, herr [8] int32 host-mapped,
// ctr [8] u32 device (last-CTA counters, one per kernel kind), timeout in nanoseconds.
struct EpCtl {
    int* err;
    volatile int* herr;
    unsigned* ctr;
    long long timeout_ns;
};

__device__ __forceinline__ ep_u64 ep_ld_acquire(const ep_u64* p) {
    ep_u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void ep_st_release(ep_u64* p, ep_u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ long long ep_now_ns() {
    ep_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (long long)t;
}

__device__ __forceinline__ void ep_error(const EpCtl& c, int code, int a, int b, int d, bool fatal) {
    if (fatal) atomicExch(c.err + 1, 1);
    if (atomicCAS(c.err, 0, code) == 0) {
        c.herr[1] = a;
        c.herr[2] = b;
        c.herr[3] = d;
        __threadfence_system();
        c.herr[0] = code;
        __threadfence_system();
    }
}

__device__ __forceinline__ bool ep_fatal(const EpCtl& c) { return *(volatile int*)(c.err + 1) != 0; }

__device__ __forceinline__ ep_u64* ep_flag(ep_u64 base, int kind, int src) {
    return reinterpret_cast<ep_u64*>(base) + kind * EP_MAX_RANKS + src;
}

// The epoch of the use that this kernel belongs to (see the top of this file).
__device__ __forceinline__ ep_u64 ep_epoch(const ep_u64* epoch_ctr) { return *(const volatile ep_u64*)epoch_ctr + 1; }

// Spin until *flag >= target; on timeout record a fatal error and return false. Returns at once (false) when a
// fatal error is already set, so one lost peer does not make every later wait time out in turn.
__device__ bool ep_wait(const EpCtl& c, const ep_u64* flag, ep_u64 target, int kind, int peer, int me) {
    if (ep_ld_acquire(flag) >= target) return true;
    long long t0 = ep_now_ns();
    while (true) {
        if (ep_ld_acquire(flag) >= target) return true;
        if (ep_fatal(c)) return false;
        if (ep_now_ns() - t0 > c.timeout_ns) {
            ep_error(c, EP_ERR_TIMEOUT, kind, peer, me, true);
            return false;
        }
        __nanosleep(128);
    }
}

// Threads 0..W-1 of the CTA each wait for one peer's flag in this rank's region; the CTA then proceeds.
__device__ __forceinline__ void ep_cta_wait_all(const EpCtl& c, ep_u64 own_base, int kind, ep_u64 target, int W,
                                                int me) {
    if ((int)threadIdx.x < W && target > 0) ep_wait(c, ep_flag(own_base, kind, threadIdx.x), target, kind,
                                                    threadIdx.x, me);
    __syncthreads();
}

// Store `val` into flags[kind][me] of every peer (release, system scope). Call from one thread after a fence.
__device__ __forceinline__ void ep_signal_all(const ep_u64* peers, int kind, int me, int W, ep_u64 val) {
    for (int r = 0; r < W; ++r) ep_st_release(ep_flag(peers[r], kind, me), val);
}

// Grid-wide completion: every CTA fences its stores and counts itself in; the last CTA resets the counter (the
// next kernel sees it by stream order) and signals every peer. reset_a / reset_b (>= 0): further counters (work
// tickets of the fused kernels) the last CTA zeroes -- every CTA has taken its last ticket before counting in.
// advance (kernels that end a use): the phase's epoch counter, set to val -- every CTA has read it by then.
__device__ void ep_grid_signal(const EpCtl& c, int ctr_idx, const ep_u64* peers, int kind, int me, int W,
                               ep_u64 val, int reset_a = -1, int reset_b = -1, ep_u64* advance = nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        unsigned prev = atomicAdd(c.ctr + ctr_idx, 1u);
        if (prev == gridDim.x - 1) {
            atomicExch(c.ctr + ctr_idx, 0u);
            if (reset_a >= 0) atomicExch(c.ctr + reset_a, 0u);
            if (reset_b >= 0) atomicExch(c.ctr + reset_b, 0u);
            if (advance != nullptr) *(volatile ep_u64*)advance = val;
            __threadfence_system();
            ep_signal_all(peers, kind, me, W, val);
        }
    }
}

// ---- per-row handoff of the fused kernels (ep_dispatch_mx, ep_combine) ---------------------------------------------
// Work is taken with per-warp tickets (atomicAdd on ctr[idx]; ctr[6]: sender rows/tokens, ctr[7]: receiver rows).
// The first send_warps (>= 1) warps of every CTA take sender work until none is left and only then receiver work;
// the other warps take receiver work at once. Sender warps never wait (after the kernel's start-of-use wait on the
// previous use), so every running CTA drains the sender tickets whether or not its receiver warps spin: all sender
// work is done by resident CTAs, and no deadlock arises whatever the number of resident CTAs (on any rank).
// A sender marks a row complete with rflag[row] = epoch (u64, monotonic, in the receiver's symmetric region) after
// `ep_warp_release` (every lane fences its own stores at system scope); the receiver's lane spins with
// ld.acquire.sys (ep_wait) and the warp reads the row with L2-only (.cg) loads, never a possibly stale L1 line.
#define CTR_TICKET_SEND 6
#define CTR_TICKET_RECV 7

__device__ __forceinline__ int ep_warp_ticket(const EpCtl& c, int idx) {
    int v = 0;
    if ((threadIdx.x & 31) == 0) v = (int)atomicAdd(c.ctr + idx, 1u);
    return __shfl_sync(0xFFFFFFFFu, v, 0);
}

__device__ __forceinline__ void ep_warp_release() {
    __syncwarp();
    __threadfence_system();
    __syncwarp();
}

__device__ __forceinline__ unsigned ep_lanemask_lt() {
    unsigned m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

__device__ __forceinline__ void ep_st16(void* p, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// L2-only load (no L1 allocation): rows written by peers during the same kernel (fused handoff)
__device__ __forceinline__ uint4 ep_ld16cg(const void* p) {
    uint4 r;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ uint4 ep_ld16(const void* p) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// fp32 -> bf16 bits exactly as torch's .to(torch.bfloat16): round to nearest even, NaN -> 0x7FC0.
__device__ __forceinline__ unsigned ep_f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ float ep_bf2f(unsigned h) { return __uint_as_float(h << 16); }

// info[] indices (int32, written by the layout; read by the other kernels, and by the host through
// moe_ep/transport/nvshmem/layout.py, which reads these values from this header)
#define I_R 0          // rows this rank receives
#define I_N 1          // expanded rows on this rank
#define I_RECV_OFF 2   // [W+1]
#define I_RET_BASE 11  // [W]
#define I_SEND_OFF 19  // [W+1]
#define I_DST_BASE 28  // [W]
#define I_GSTART 36    // [L+1]; tile offsets follow at I_GSTART + L + 1 ([L+1])
#define I_DROPPED(L) (I_GSTART + 2 * (L) + 2)  // expanded rows past the capacity (dropped or overflowed)
