"""The report side of ``bench_layer.py``: the issues' targets, the check bounds, the phase groups, the speedup and
memory ratios of one shape, and the table printed on stdout."""

from __future__ import annotations

from layer_variants import FP8, PEER_FP8

# The issue's targets. Speedups: baseline fwd_bwd_ms / variant fwd_bwd_ms (>= target); memory: act_mem_gb ratio (<=).
TARGETS = {  # issue 40 (one H200, EP=1 with the per-rank expert load of EP=4)
    "dsv3": {
        "mxfp8_vs_bf16": 0.95,
        "mxfp8_cached_vs_bf16": 1.0,
        "blockwise_vs_bf16": 1.3,
        "blockwise_vs_torchtitan_bf16": 1.8,
        "blockwise_cached_vs_bf16": 1.5,
        "blockwise_cached_vs_torchtitan_bf16": 2.1,
        "blockwise_vs_torchtitan_fp8_rowwise": 1.6,
        "saved_blockwise_over_bf16": 0.7,
    },
    "small": {
        "mxfp8_vs_bf16": 0.95,
        "mxfp8_cached_vs_bf16": 1.0,
        "blockwise_vs_bf16": 1.15,
        "blockwise_vs_torchtitan_bf16": 2.0,
        "blockwise_vs_torchtitan_fp8_rowwise": 1.6,
        "saved_blockwise_over_bf16": 0.7,
    },
}


BF16_BOUND = 3e-2  # norm-relative, bf16 variants against each other


MXFP8_BOUND = 0.15  # norm-relative, MXFP8 variants against bf16 (see the module docstring)


FP8_ROWWISE_BOUND = MXFP8_BOUND  # norm-relative, torchtitan_fp8_rowwise against bf16 (see the module docstring)


PHASE_GROUPS = {
    "router": "router",
    "router_bwd": "router",
    "layout": "layout",
    "dispatch": "dispatch",
    "dispatch_bwd": "dispatch",
    "combine": "combine",
    "combine_bwd": "combine",
    "weight_prep": "weight_prep",
    "experts_fwd": "gemms",
    "experts_bwd": "gemms",
    "gemm1": "gemms",
    "gemm2": "gemms",
    "dgrad2": "gemms",
    "wgrad2": "gemms",
    "dgrad1": "gemms",
    "wgrad1": "gemms",
    "swiglu_quant": "swiglu_quant",
    "quant_dy": "swiglu_quant",
    "swiglu_bwd_quant": "swiglu_quant",
    "x_colwise": "swiglu_quant",
}


GROUPS = ("router", "layout", "dispatch", "gemms", "swiglu_quant", "combine", "weight_prep", "other")


def phase_groups(phases: dict[str, float]) -> dict[str, float]:
    out = dict.fromkeys(GROUPS, 0.0)
    for name, ms in phases.items():
        out[PHASE_GROUPS.get(name, "other")] += ms
    return out


def ratios(shape: str, rows: list[dict]) -> dict:
    """Speedups (baseline fwd_bwd_ms / variant's; > 1: the variant is faster) and activation-memory ratios of one
    shape, with the issue's target where it sets one."""
    by = {r["variant"]: r for r in rows if r.get("fwd_bwd_ms")}
    tg = TARGETS.get(shape, {})
    out: dict = {}
    # ours against bf16 and torchtitan_bf16; ours against the FP8 peer (torchtitan on torchao's FP8 rowwise GEMMs);
    # the peer against torchtitan_bf16 (what FP8 gives the torchtitan layer)
    pairs = [(a, b) for a in (*FP8, "bf16") for b in ("bf16", "torchtitan_bf16")]
    pairs += [(a, b) for a in (*FP8, "bf16") for b in PEER_FP8] + [(b, "torchtitan_bf16") for b in PEER_FP8]
    for a, b in pairs:
        if a == b or a not in by or b not in by:
            continue
        key = f"{a}_vs_{b}"
        m = by[b]["fwd_bwd_ms"] / by[a]["fwd_bwd_ms"]
        t = tg.get(key)
        out[key] = {"measured": m, "target": t, "met": None if t is None else m >= t}
        out[f"{key}_fwd"] = {"measured": by[b]["fwd_ms"] / by[a]["fwd_ms"], "target": None, "met": None}
    for a in FP8:
        for field in ("act_mem_gb", "saved_gb"):
            if a in by and "bf16" in by and by[a].get(field) and by["bf16"].get(field):
                key = f"{'act_mem' if field == 'act_mem_gb' else 'saved'}_{a}_over_bf16"
                m = by[a][field] / by["bf16"][field]
                t = tg.get(key)
                out[key] = {"measured": m, "target": t, "met": None if t is None else m <= t}
    for key, t in tg.items():  # targets whose variants did not run
        out.setdefault(key, {"measured": None, "target": t, "met": None})
    return out


def print_table(results: list[dict], meta: dict) -> None:
    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    head = (
        f"{'shape':6s} {'variant':24s} {'fwd ms':>8s} {'fwd+bwd':>8s} {'act GB':>7s} {'saved':>6s} {'wprep':>6s} "
        f"{'drop':>4s} {'err':>8s}  phases (ms): " + " ".join(GROUPS)
    )
    print(head)
    for r in results:
        pg = r.get("phase_groups") or {}
        print(
            f"{r['shape']:6s} {r['variant']:24s} {f(r.get('fwd_ms'), '8.3f'):>8s} {f(r.get('fwd_bwd_ms'), '8.3f'):>8s} "
            f"{f(r.get('act_mem_gb'), '7.2f'):>7s} {f(r.get('saved_gb'), '6.2f'):>6s} "
            f"{f(r.get('weight_prep_ms'), '6.3f'):>6s} {f(r.get('dropped_slots'), 'd'):>4s} "
            f"{f((r.get('check') or {}).get('max_rel_err'), '8.2e'):>8s}  "
            + " ".join(f(pg.get(k), ".3f") for k in GROUPS)
            + (f"  ERROR {r['error']}" if "error" in r else "")
        )
    for shape, rs in meta["ratios"].items():
        parts = []
        for k, v in rs.items():
            if k.endswith("_fwd"):
                continue
            m = "-" if v["measured"] is None else f"{v['measured']:.3f}"
            t = "" if v["target"] is None else f" (target {v['target']}: {'met' if v['met'] else 'NOT met'})"
            parts.append(f"{k} {m}{t}")
        print(f"[{shape}] " + "; ".join(parts))
