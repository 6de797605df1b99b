"""Ad hoc A/B (not committed): wgmma wgrad on prepared operands, MOE_EP_WGRAD_STAGES 3 vs 4, per-launch alternation."""
import json, os, sys, statistics
import numpy as np, torch
sys.path.insert(0, '.'); sys.path.insert(0, 'benchmarks')
from bench_gemm import SHAPES, uneven_sizes, round_order
from moe_ep import gemm_cuda, mxfp8_cuda
res = {}
for name, (m, k, n, g) in SHAPES.items():
    sizes = uneven_sizes(m, g, seed=sum(map(ord, name)))
    sz = torch.tensor(sizes, dtype=torch.int32, device='cuda')
    offs = torch.cumsum(sz, 0, dtype=torch.int32)
    dy = torch.randn(m, n, device='cuda').bfloat16(); x = torch.randn(m, k, device='cuda').bfloat16()
    _, _, dyp, _ = mxfp8_cuda.quantize_grouped_dual(dy, sz, colwise='bf16')
    _, _, xp, _ = mxfp8_cuda.quantize_grouped_dual(x, sz, colwise='bf16')
    row = {}
    for od in (torch.bfloat16, torch.float32):
        outs = {s: torch.empty(g, n, k, dtype=od, device='cuda') for s in ('3', '4')}
        def mk(s):
            def f():
                os.environ['MOE_EP_WGRAD_STAGES'] = s
                gemm_cuda.grouped_wgrad_prepared_out(dyp, xp, sz, outs[s], m)
            return f
        dyt = dy.t()
        fns = {'s3': mk('3'), 's4': mk('4'), 'torch': lambda: torch._grouped_mm(dyt, x, offs=offs)}
        for f in fns.values(): f()
        torch.cuda.synchronize()
        eq = bool(torch.equal(outs['3'], outs['4']))
        times = {kk: [] for kk in fns}
        for it in range(120):
            evs = []
            for kk in round_order(list(fns), it):
                s_, e_ = torch.cuda.Event(True), torch.cuda.Event(True)
                s_.record(); fns[kk](); e_.record(); evs.append((kk, s_, e_))
            torch.cuda.synchronize()
            if it >= 5:
                for kk, s_, e_ in evs: times[kk].append(s_.elapsed_time(e_))
        r = np.array(times['s4']) / np.array(times['s3'])
        row[str(od)] = {'bytes_equal': eq, 'ms': {kk: statistics.median(v) for kk, v in times.items()},
                        'time_ratio_s4_over_s3_median': float(np.median(r)), 'p10_p90': [float(q) for q in np.quantile(r, [0.1, 0.9])],
                        'vs_torch_s3': float(np.median(np.array(times['torch']) / np.array(times['s3']))),
                        'vs_torch_s4': float(np.median(np.array(times['torch']) / np.array(times['s4'])))}
        print(name, od, json.dumps(row[str(od)]), flush=True)
    res[name] = row
json.dump(res, open(os.path.join(os.environ.get('OUT', '.'), 'prof_wgrad_stages_h200.json'), 'w'), indent=1)
