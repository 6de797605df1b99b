"""launch/train.py end to end on CPU (gloo): FSDP2 + expert parallelism on real text, its argument errors, the
torchtitan baseline, the FSDP2 path of the cuda backend (with a CPU stand-in for the kernels), and
launch/plot_train.py on a committed log (tests/data/train_tiny_log.json: ``torchrun --nproc-per-node=2
launch/train.py --preset tiny --steps 30 --no-progress --data-bytes 4000000 --log-json tests/data/train_tiny_log.json``
on CPU).

Most tests launch ``python -m torch.distributed.run`` (torchrun) as a subprocess, exactly as a user would (one
process: ``python launch/train.py``, which train.py runs as a world of one), and read the JSON log. Sizes are the
"tiny" preset; a run with the same arguments as an earlier one in the session is read back, not run again.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed
from tests._train_runs import ENV, RUNS, TRAIN

REPO = Path(__file__).resolve().parent.parent
PLOT = REPO / "launch" / "plot_train.py"
TINY_LOG = REPO / "tests" / "data" / "train_tiny_log.json"


def _script(path: Path):
    """Import a launch/ script as a module (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_test_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_train(tmp_path: Path, nproc: int, *args: str, name: str = "log", default_log: str | None = None) -> dict:
    """Run launch/train.py on ``nproc`` CPU processes; return its JSON log (fails with the output on error).

    default_log: None passes ``--log-json``; a variant name runs without ``--log-json`` in a folder of its own and
    reads the one default log ``runs/tiny_<variant>_<timestamp>.json`` there. Runs are tests/_train_runs.py's: one
    launch per distinct (nproc, default_log, args) in the session, shared by the tests that ask for the same one and
    maybe started early in the background (``PREFETCH``). ``tmp_path`` / ``name`` only label the call."""
    r = RUNS.get((nproc, default_log, *args))
    if r.returncode:
        pytest.fail(f"train.py {name} failed (rc {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}")
    log = r.where
    if default_log is not None:
        found = sorted((r.where / "runs").glob(f"tiny_{default_log}_*.json"))
        assert len(found) == 1, (found, r.stdout[-2000:])
        stamp = found[0].stem.removeprefix(f"tiny_{default_log}_")
        assert len(stamp) == 15 and stamp[8] == "-" and stamp.replace("-", "").isdigit(), found[0]  # YYYYmmdd-HHMMSS
        log = found[0]
    return json.loads(log.read_text())


# The arguments of the runs below, shared with PREFETCH (the runs each test needs, started in the background when
# the test is selected; longest first).
TWO_RANKS = ("--steps", "20", "--log-every", "5")
CAPACITY = ("--steps", "4", "--log-every", "2", "--capacity-factor", "0.5", "--profile-step", "1")
EP_COMMON = ("--steps", "4", "--log-every", "2", "--aux-loss-coef", "0")
ONE_PROCESS = (*EP_COMMON, "--batch-size", "8")
TT_COMMON = ("--steps", "6", "--log-every", "3", "--aux-loss-coef", "0")
TT_REF = ("--steps", "1", "--aux-loss-coef", "0", "--no-quantize", "--batch-size", "8")
PREFETCH: dict[str, list[tuple]] = {
    "test_ep_fsdp_matches_one_process": [
        (4, None, *EP_COMMON, "--batch-size", "2", "--ep", "2"),
        (1, None, *ONE_PROCESS),
    ],
    "test_compile_matches_eager": [(1, None, *ONE_PROCESS, "--compile"), (1, None, *ONE_PROCESS)],
    "test_torchtitan_baseline": [
        (2, None, *TT_COMMON, "--baseline", "torchtitan", "--batch-size", "4"),
        (1, "torchtitan", *TT_COMMON, "--baseline", "torchtitan", "--batch-size", "8"),
        (1, None, *TT_REF),
    ],
    "test_train_two_ranks_loss_decreases": [(2, None, *TWO_RANKS)],
    "test_activation_checkpointing_changes_nothing": [(2, None, *TWO_RANKS, "--ac"), (2, None, *TWO_RANKS)],
    "test_train_capacity_factor_logs_drops": [(2, None, *CAPACITY)],
}


def test_train_two_ranks_loss_decreases(tmp_path: Path) -> None:
    """2 ranks, EP=2: finite loss that clearly drops; the log carries what the report needs."""
    steps = 20
    log = run_train(tmp_path, 2, *TWO_RANKS)
    losses = log["loss"]
    assert len(losses) == steps and len(log["aux_loss"]) == steps
    assert all(math.isfinite(x) for x in losses + log["aux_loss"]), losses
    # Bytewise LM from a random init starts near ln(256) = 5.55; 20 steps of the tiny preset reach ~3.5-4
    # (unigram statistics alone are worth ~1.5 nats), so a 1-nat drop is a clear but safe margin.
    assert abs(losses[0] - math.log(256)) < 0.3, losses[0]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert (log["world_size"], log["ep"], log["dp"]) == (2, 2, 1)
    assert log["dist_backend"] == "gloo" and log["device_type"] == "cpu" and log["device"]
    assert log["config"]["model"]["num_experts"] % log["ep"] == 0
    assert len(log["windows"]) == steps // 5
    assert all(w["tokens_per_sec_per_gpu"] > 0 for w in log["windows"])
    assert log["summary"]["tokens_per_sec_per_gpu"] > 0 and "git_commit" in log
    # what a user reads: the variant (CPU: the reference backend, MXFP8 recipe), grad norms, drops, memory
    assert (log["variant"], log["backend"], log["quantize"]) == ("reference", "reference", True)
    assert log["config"]["args"]["expert_gather"] == "fp8"  # the FP8 variants' default (the layer's recipe)
    assert len(log["grad_norm"]) == steps and all(math.isfinite(g) and g > 0 for g in log["grad_norm"])
    assert all(w["dropped_slots"] == 0 and w["max_rss_gib"] > 0 for w in log["windows"])  # dropless
    s = log["summary"]
    assert s["finite"] and s["dropped_slots"] == 0 and s["max_memory_gib"] is None and s["max_rss_gib"] > 0


def test_train_capacity_factor_logs_drops(tmp_path: Path) -> None:
    """--capacity-factor < 1 drops slots; the log sums them per window (over ranks, layers and steps)."""
    log = run_train(tmp_path, 2, *CAPACITY)
    prof = log["profile"]  # step 1 recorded: its top ops by self time (CPU here), summing to at most the total
    assert prof["top"] and all(r["ms"] > 0 and r["count"] > 0 for r in prof["top"])
    assert sum(r["ms"] for r in prof["top"]) <= prof["device_ms"] + 1e-6
    assert log["capacity_factor"] == 0.5 and log["config"]["model"]["capacity_factor"] == 0.5
    # capacity 0.5 * T * K rows per rank of T * K routed slots per rank on average: at least a quarter is dropped
    for w in log["windows"]:
        assert w["dropped_slots"] > 0 and 0.25 < w["dropped_fraction"] < 1, w
    assert log["summary"]["dropped_slots"] == sum(w["dropped_slots"] for w in log["windows"])
    assert all(math.isfinite(x) for x in log["loss"])


def test_ep_fsdp_matches_one_process(tmp_path: Path) -> None:
    """4 ranks as dp=2 x ep=2 (batch 2 each) train the same model as 1 process with batch 8.

    The data loader gives both runs the same global batch, the experts are initialized per global expert
    index, and the aux loss is off (it is not additive over ranks: f_e and P_e are per-rank statistics). So
    the two runs compute the same function up to fp32 summation order (EP combine, FSDP reduce-scatter, the
    grad-norm all-reduce); over 4 AdamW steps that is ~1e-6 (seen: 5e-7), so 1e-4 on losses ~5 is loose.
    AdamW is blind to a constant scale on one tensor's gradient, so the losses alone would not catch expert
    grads divided by dp instead of dp*ep: the logged global grad norm (before clipping) does.
    """
    one = run_train(tmp_path, 1, *ONE_PROCESS, name="one")
    four = run_train(tmp_path, 4, *EP_COMMON, "--batch-size", "2", "--ep", "2", name="four")
    assert (four["world_size"], four["ep"], four["dp"]) == (4, 2, 2)
    assert four["config"]["args"]["expert_gather"] == "fp8"  # experts gathered over dp=2 in the layer's FP8
    assert one["loss"] == pytest.approx(four["loss"], abs=1e-4), (one["loss"], four["loss"])
    assert one["grad_norm"] == pytest.approx(four["grad_norm"], rel=1e-4), (one["grad_norm"], four["grad_norm"])


# ------------------------------------------------------------------------------------------- the torchtitan baseline
def _cpu_grouped_mm_missing() -> str | None:
    try:
        a = torch.randn(4, 32, dtype=torch.bfloat16)
        torch._grouped_mm(a, torch.randn(2, 32, 32, dtype=torch.bfloat16), offs=torch.tensor([2, 4], dtype=torch.int32))
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        return f"torch._grouped_mm does not run on this torch's CPU build ({torch.__version__}): {e}"
    return None


def test_torchtitan_baseline(tmp_path: Path) -> None:
    """--baseline torchtitan: the same model with benchmarks/torchtitan_moe.py's layer. It starts from the same
    weights as ours (the first step's loss and grad norm equal our bf16 reference's up to bf16 rounding in the
    experts), trains (finite, decreasing loss), and under EP=2 + FSDP2 matches one process with the same global batch
    (the experts' FSDP unit divides their gradients by the world size, as ours); the default log name carries the
    variant."""
    reason = _cpu_grouped_mm_missing()
    if reason:
        pytest.skip(reason)
    two = run_train(tmp_path, 2, *TT_COMMON, "--baseline", "torchtitan", "--batch-size", "4", name="tt2")
    one = run_train(tmp_path, 1, *TT_COMMON, "--baseline", "torchtitan", "--batch-size", "8", default_log="torchtitan")
    ref = run_train(tmp_path, 1, *TT_REF)
    assert (two["variant"], two["backend"], two["quantize"], two["ep"]) == ("torchtitan", None, False, 2)
    assert ref["variant"] == "reference_bf16"
    for log in (one, two):
        losses = log["loss"]
        assert len(losses) == 6 and all(math.isfinite(x) for x in losses + log["grad_norm"]), losses
        assert sum(losses[-2:]) / 2 < losses[0] - 0.3, losses
    assert one["loss"][0] == pytest.approx(ref["loss"][0], abs=1e-3)
    assert one["grad_norm"][0] == pytest.approx(ref["grad_norm"][0], rel=1e-2)
    assert one["loss"] == pytest.approx(two["loss"], abs=2e-3), (one["loss"], two["loss"])
    assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=2e-2), (one["grad_norm"], two["grad_norm"])
    assert two["params"] == ref["params"]  # same parameter count (w1 | w3 split of our w13)


# ------------------------------------------------------------------------------------------- argument errors
@pytest.mark.parametrize(
    "argv, world, match",
    [
        (["--steps", "0"], 1, "argument --steps: must be >= 1, got 0"),
        (["--steps", "-3"], 1, "argument --steps: must be >= 1"),
        (["--batch-size", "0"], 1, "argument --batch-size"),
        (["--log-every", "x"], 1, "argument --log-every: must be an integer"),
        (["--lr", "0"], 1, "argument --lr: must be a finite number > 0"),
        (["--lr", "nan"], 1, "argument --lr"),
        (["--warmup", "-1"], 1, "argument --warmup"),
        (["--clip", "-1"], 1, "argument --clip"),
        (["--min-lr-ratio", "2"], 1, "argument --min-lr-ratio"),
        (["--capacity-factor", "0"], 1, "argument --capacity-factor"),
        (["--ep", "3"], 2, "argument --ep: 3 does not divide the world size 2"),
        (["--ep", "0"], 1, "argument --ep"),
        (["--num-experts", "6", "--ep", "4"], 4, "argument --num-experts: 6 experts do not split over --ep 4"),
        (["--top-k", "5"], 1, "argument --top-k: 5 exceeds --num-experts 4"),
        (["--n-heads", "3"], 1, "argument --n-heads"),
        (["--dim", "48"], 1, "multiples of 32"),
        (["--baseline", "torchtitan", "--capacity-factor", "1.0"], 1, "dropless"),
        (["--baseline", "torchtitan", "--backend", "reference"], 1, "argument --baseline"),
        (["--data-bytes", "10"], 1, "argument --data-bytes"),
        (["--preset", "huge"], 1, "argument --preset: invalid choice"),
        (["--backend", "cuda"], 1, "argument --backend: cuda needs"),
        (["--no-quantize", "--expert-gather", "mxfp8"], 1, "argument --expert-gather: mxfp8 gathers"),
        (["--baseline", "torchtitan", "--expert-gather", "fp8"], 1, "argument --expert-gather: fp8 gathers"),
        (["--steps", "5", "--profile-step", "5"], 1, "argument --profile-step: 5 is not a step"),
    ],
)
def test_bad_arguments_fail_in_parsing(argv, world, match, capsys, monkeypatch) -> None:
    """Bad arguments exit with argparse's code 2 and a message naming the argument, from parse_args (before
    torch.distributed starts; the world size comes from $WORLD_SIZE)."""
    train = _script(TRAIN)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    if "cuda" in argv:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        train.parse_args(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_presets_parse(monkeypatch) -> None:
    """Every preset parses as it is; medium is the MoE-dominated one (16384 tokens per rank per step)."""
    train = _script(TRAIN)
    monkeypatch.setenv("WORLD_SIZE", "4")
    for name in train.PRESETS:
        a = train.parse_args(["--preset", name])
        assert a.steps >= 1 and a.transport == "nvshmem" and a.backend == "auto"
    a = train.parse_args(["--preset", "medium"])
    assert (a.dim, a.num_experts, a.top_k, a.ffn_hidden, a.n_layers, a.seq_len, a.n_heads) == (
        2048, 128, 8, 768, 8, 4096, 16,
    )  # fmt: skip
    assert a.batch_size * a.seq_len == 16384 and (a.lr, a.warmup) == (1e-3, 30)


def test_bad_ep_under_torchrun_fails_fast(tmp_path: Path) -> None:
    """Under torchrun every rank fails in argument parsing (no collective, so no hang) and rank 0 alone says why:
    the message appears once, and torchrun's report names rank 0's exit code 2 as the root cause."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(TRAIN)]
    proc = subprocess.run([*cmd, "--ep", "3"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("argument --ep: 3 does not divide the world size 2") == 1, proc.stderr
    root_cause = proc.stderr.split("Root Cause")[-1]
    assert "rank      : 0" in root_cause and "exitcode  : 2" in root_cause, proc.stderr
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------- FSDP2 + the cuda path
def _fsdp_cuda_path(rank: int, world: int) -> None:
    """The cuda layer under FSDP2 on gloo (MoE.forward through Experts.run, an FSDP forward method), with the kernels
    replaced by a CPU stand-in that
    reads experts.w13 / experts.w2 the way routed_experts_cuda does (no experts module call). It must see this rank's
    full unsharded experts (plain tensors, not DTensor shards) and train exactly as the reference backend, whose
    Experts module call FSDP2 hooks natively: same losses and grad norms, bitwise (bf16 parameters, so the layer's
    bf16 cast for the cuda backend changes nothing)."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    from launch.model import ModelConfig, MoETransformer  # noqa: PLC0415
    from moe_ep import init_ep, layer_cuda  # noqa: PLC0415
    from moe_ep.experts.reference import expert_mlp  # noqa: PLC0415
    from moe_ep.parallel import apply_fsdp, broadcast_params, clip_grad_norm_  # noqa: PLC0415
    from moe_ep.transport import combine, dispatch  # noqa: PLC0415

    seen: list[tuple] = []

    def fake_cuda(x, topk_idx, topk_w, w13, w2, cache, cfg, group):
        seen.append((isinstance(w13, DTensor) or isinstance(w2, DTensor), tuple(w13.shape), cache is None))
        cap = cfg.capacity_rows(x.shape[0])
        rows, w, handle = dispatch(x, topk_idx, topk_w, cfg.num_experts, group, cfg.quantize, capacity=cap)
        out = expert_mlp(rows, w13, w2, handle.group_sizes_host, cfg.quantize)
        return combine(out, w, handle, cfg.quantize), handle.num_dropped

    layer_cuda.resolve_backend = lambda cfg, x: "reference" if cfg.backend == "reference" else "cuda"
    layer_cuda.routed_experts_cuda = fake_cuda

    def train(ep: int, backend: str, reshard: bool) -> tuple[list[float], list[float]]:
        mesh = init_ep(ep)
        cfg = ModelConfig(
            dim=64, n_layers=2, n_heads=4, seq_len=16, ffn_hidden=64, num_experts=4, top_k=2,
            max_tokens_per_rank=32, quantize=False, backend=backend,
        )  # fmt: skip
        torch.manual_seed(0)
        model = MoETransformer(cfg, mesh)
        broadcast_params(model, mesh)
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, norms = [], []
        for step in range(2):  # the second step runs on the weights the first optimizer step changed
            tok = torch.randint(0, 256, (2 * world, 17), generator=torch.Generator().manual_seed(step))
            tok = tok[2 * rank : 2 * rank + 2]
            loss, aux = model(tok[:, :-1], tok[:, 1:])
            (loss + aux).backward()
            norms.append(float(clip_grad_norm_(model, math.inf)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses, norms

    # ep=1: experts sharded over dp=2; ep=2: dp=1 (a one-rank FSDP unit); with and without reshard_after_forward
    for ep, reshard in ((1, True), (2, True), (1, False)):
        ref = train(ep, "reference", reshard)
        assert not seen
        cuda = train(ep, "auto", reshard)
        e_local = 4 // ep
        assert len(seen) == 2 * 2, seen  # 2 steps x 2 layers, every one through the stand-in
        assert all(s == (False, (e_local, 128, 64), True) for s in seen), seen  # unsharded, no operand cache
        assert cuda == ref, (ep, reshard, cuda, ref)
        seen.clear()
        dist.barrier()


def test_fsdp_runs_the_cuda_layer_as_an_fsdp_unit() -> None:
    run_distributed(_fsdp_cuda_path, 2)


# ------------------------------------------------------------------------------------------- plots
def test_plot_data_from_the_committed_log(tmp_path: Path) -> None:
    """plot_train.load_runs (no matplotlib needed): the data the PNGs show, labels unique per run."""
    plot = _script(PLOT)
    committed = json.loads(TINY_LOG.read_text())
    other = dict(committed, variant="torchtitan", loss=[x + 0.1 for x in committed["loss"]])
    other_path = tmp_path / "tt.json"
    other_path.write_text(json.dumps(other))
    runs = plot.load_runs([TINY_LOG, other_path, TINY_LOG])
    assert [r["variant"] for r in runs] == ["reference", "torchtitan", "reference"]
    assert runs[1]["label"] == "torchtitan"
    plain = {"variant": "mxfp8", "quantize": True, "config": {"args": {"expert_gather": "plain"}}}
    assert plot.run_label(plain) == "mxfp8 plain-gather"  # an MXFP8 variant that gathered plain weights
    assert plot.run_label({**plain, "config": {"args": {"expert_gather": "mxfp8"}}}) == "mxfp8"
    assert runs[0]["label"] != runs[2]["label"] and runs[0]["label"].startswith("reference")  # made unique
    r = runs[0]
    assert r["steps"] == list(range(1, len(committed["loss"]) + 1)) and r["loss"] == committed["loss"]
    assert r["tokens_per_sec_per_gpu"] == committed["summary"]["tokens_per_sec_per_gpu"] > 0
    assert r["memory_kind"] == "host_rss" and r["memory_gib"] > 0  # a CPU log: no GPU allocator peak
    assert r["mean_loss_last_50"] == pytest.approx(sum(committed["loss"]) / len(committed["loss"]))
    assert plot.smooth([1.0, 3.0, float("nan"), 5.0], 2) == [1.0, 2.0, 3.0, 5.0]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        plot.load_runs([bad])
    # an unfinished GPU run (killed before its summary): throughput and peak memory from its windows
    windows = [dict(w, max_memory_gib=float(i + 1)) for i, w in enumerate(committed["windows"])]
    cut = {k: v for k, v in committed.items() if k != "summary"} | {"windows": windows}
    cut_path = tmp_path / "cut.json"
    cut_path.write_text(json.dumps(cut))
    (u,) = plot.load_runs([cut_path])
    steady = windows[1:] or windows
    want = sum(w["steps"] for w in steady) * committed["tokens_per_rank_per_step"] / sum(w["seconds"] for w in steady)
    assert u["tokens_per_sec_per_gpu"] == pytest.approx(want)
    assert u["memory_kind"] == "gpu_rank0" and u["memory_gib"] == float(len(windows)) and u["mean_loss_last_50"] is None


def test_plot_writes_pngs(tmp_path: Path) -> None:
    """plot_train.py on the committed log writes the loss and throughput PNGs (needs matplotlib; CI has none)."""
    pytest.importorskip("matplotlib", reason="launch/plot_train.py draws with matplotlib (not a CI dependency)")
    plot = _script(PLOT)
    out = plot.main([str(TINY_LOG), str(TINY_LOG), "--out-dir", str(tmp_path), "--prefix", "tiny", "--smooth", "3"])
    assert [f.name for f in out] == ["tiny_loss.png", "tiny_throughput.png"]
    for f in out:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 1000


def test_plot_without_matplotlib_says_so(tmp_path: Path, monkeypatch) -> None:
    """Where matplotlib is missing, the script exits with a message naming it (and writes nothing)."""
    plot = _script(PLOT)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(SystemExit, match="needs matplotlib"):
        plot.main([str(TINY_LOG), "--out-dir", str(tmp_path / "png")])
    assert not (tmp_path / "png").exists()


# ------------------------------------------------------------------------------------ checkpointing and compile
def test_activation_checkpointing_changes_nothing(tmp_path: Path) -> None:
    """--ac recomputes every block's attention half in the backward: on 2 ranks with FSDP2 the losses and grad norms
    equal the run without it, bitwise (the same ops on the same inputs, fp32 on CPU). The run without it is
    test_train_two_ranks_loss_decreases's (same arguments: read back when that test ran first)."""
    plain = run_train(tmp_path, 2, *TWO_RANKS, name="plain")
    ac = run_train(tmp_path, 2, *TWO_RANKS, "--ac", name="ac")
    assert ac["config"]["model"]["activation_checkpoint"] is True
    assert ac["loss"] == plain["loss"] and ac["grad_norm"] == plain["grad_norm"], (ac["loss"], plain["loss"])


def test_compile_matches_eager(tmp_path: Path) -> None:
    """--compile (attention and norms through torch.compile, the MoE eager) trains the same model: per-step losses
    within 1e-4 relative of eager. Not bitwise: the compiled kernels sum RMSNorm's mean and the attention's
    reductions in another order (fp32 rounding, ~1e-7 relative per op), and 4 optimizer steps carry that along.
    The eager run is test_ep_fsdp_matches_one_process's one-process run (same arguments: read back when that test
    ran first)."""
    eager = run_train(tmp_path, 1, *ONE_PROCESS, name="eager")
    comp = run_train(tmp_path, 1, *ONE_PROCESS, "--compile", name="compiled")
    assert len(comp["loss"]) == 4 and all(math.isfinite(v) for v in comp["loss"])
    assert comp["loss"] == pytest.approx(eager["loss"], rel=1e-4)


def test_activation_checkpointing_recomputes_attention_only() -> None:
    """With activation_checkpoint the attention half of each block runs twice per step (forward, recompute) and the
    MoE once; without it both run once."""
    from launch.model import Attention, ModelConfig, MoETransformer  # noqa: PLC0415
    from moe_ep.layer import MoE  # noqa: PLC0415

    calls = {"attn": 0, "moe": 0}
    attn_fwd, moe_fwd = Attention.forward, MoE.forward

    def count(name, fn):
        def wrapped(self, *a, **k):
            calls[name] += 1
            return fn(self, *a, **k)

        return wrapped

    tok = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    try:
        Attention.forward, MoE.forward = count("attn", attn_fwd), count("moe", moe_fwd)
        for ac, want_attn in ((False, 2), (True, 4)):
            calls.update(attn=0, moe=0)
            cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, seq_len=16, ffn_hidden=64, num_experts=4, top_k=2,
                              max_tokens_per_rank=64, activation_checkpoint=ac)  # fmt: skip
            loss, aux = MoETransformer(cfg)(tok[:, :-1], tok[:, 1:])
            (loss + aux).backward()
            assert calls == {"attn": want_attn, "moe": 2}, (ac, calls)
    finally:
        Attention.forward, MoE.forward = attn_fwd, moe_fwd
