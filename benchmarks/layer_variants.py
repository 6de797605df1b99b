"""The variants of ``bench_layer.py`` (the layers it times, built on one set of weights) and the one check step each
runs against the bf16 variant. See bench_layer.py's docstring for what each variant is."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchtitan_moe import TorchtitanMoE

VARIANTS = (
    "torchtitan_bf16",
    "torchtitan_fp8_rowwise",
    "bf16",
    "mxfp8",
    "mxfp8_cached",
    "blockwise",
    "blockwise_cached",
)


FP8 = ("mxfp8", "mxfp8_cached", "blockwise", "blockwise_cached")  # the quantized variants (recipe = name w/o "_cached")


PEER_FP8 = ("torchtitan_fp8_rowwise",)  # FP8 peers (torchtitan's layer on torchao's FP8 grouped GEMMs)


DRY_VARIANTS = ("reference_bf16", "torchtitan_bf16", "torchtitan_bf16_align8")


SKIPPED = "skipped: a package it needs is missing"  # prefix of a skipped variant's error


class Variant:
    """One timed configuration: a layer (shared by mxfp8 and mxfp8_cached) and how a step runs on it."""

    def __init__(self, name: str, module: torch.nn.Module, kind: str, clear_cache: bool = False) -> None:
        self.name, self.module, self.kind, self.clear_cache = name, module, kind, clear_cache

    def prepare(self) -> None:
        """Before every step: gradients to None (each step allocates its own), the weight cache cleared for mxfp8."""
        for p in self.module.parameters():
            p.grad = None
        if self.clear_cache:
            self.module.experts.weight_cache.clear()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kind == "torchtitan":
            return self.module(x), None
        return self.module(x)

    @staticmethod
    def backward(y: torch.Tensor, aux: torch.Tensor | None, g: torch.Tensor, with_aux: bool = True) -> None:
        if aux is not None and with_aux:
            torch.autograd.backward([y, aux], [g, torch.ones_like(aux)])
        else:
            y.backward(g)

    def grads(self) -> dict[str, torch.Tensor | None]:
        """Parameter gradients in moe_ep's layout (dw13 [E_l, 2F, H], dw2 [E_l, H, F], drouter [E, H])."""
        if self.kind == "torchtitan":
            return self.module.grads_moe_ep_layout()
        m = self.module
        return {"dw13": m.experts.w13.grad, "dw2": m.experts.w2.grad, "drouter": m.router.weight.grad}

    def dropped(self) -> int:
        """Slots this rank dropped in the last forward (torchtitan is dropless by construction)."""
        return 0 if self.kind == "torchtitan" else int(self.module.num_dropped)  # cuda: a host read

    def grad_bytes(self, x: torch.Tensor) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters()) + x.numel() * x.element_size()


def _moe_cfg(dims: dict, backend: str, recipe: str, transport: str):
    from moe_ep import MoEConfig  # noqa: PLC0415

    kw = dict(
        hidden=dims["H"],
        ffn_hidden=dims["F"],
        num_experts=dims["E"],
        top_k=dims["K"],
        max_tokens_per_rank=dims["T"],
        capacity_factor=None,
        recipe=recipe,
        backend=backend,
    )
    if backend == "cuda":
        kw["transport"] = transport
    return MoEConfig(**kw)


@torch.no_grad()
def _copy_params(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """Copy every parameter of ``src`` into the same-named parameter of ``dst`` (two moe_ep.MoE layers)."""
    s = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        if name not in s or s[name].shape != p.shape:
            raise ValueError(f"parameter {name} {tuple(p.shape)} has no same-shaped twin in the source layer")
        p.copy_(s[name])


def build_variants(names: list[str], dims: dict, mesh, dev: torch.device, args, errors: dict) -> dict[str, Variant]:
    """The layers of one shape, every variant on the same weights. A variant whose layer fails to build on any rank is
    left out on every rank (``errors[name]``)."""
    from moe_ep import MoE  # noqa: PLC0415

    def make(backend: str, recipe: str) -> torch.nn.Module:
        cfg = _moe_cfg(dims, backend, recipe, args.transport)
        return MoE(cfg, mesh, device=dev, dtype=torch.bfloat16, seed=args.seed)

    layers: dict[str, torch.nn.Module] = {}
    built: dict[str, Variant] = {}
    source = None  # the layer whose weights every other layer copies
    ep_group = mesh["ep"].get_group() if mesh["ep"].size() > 1 else None
    for name in names:
        try:
            if name in FP8:  # x and x_cached share one layer
                recipe = name.removesuffix("_cached")
                if recipe not in layers:
                    layers[recipe] = make("cuda", recipe)
                mod, kind = layers[recipe], "moe_ep"
            elif name == "bf16":
                mod, kind = make("cuda", "bf16"), "moe_ep"
            elif name == "reference_bf16":
                mod, kind = make("reference", "bf16"), "moe_ep"
            elif name == "torchtitan_fp8_rowwise":
                mod = TorchtitanMoE(
                    dims["H"],
                    dims["F"],
                    dims["E"],
                    dims["K"],
                    ep_group,
                    gemm="fp8_rowwise",
                    device=dev,
                    dtype=torch.bfloat16,
                )
                kind = "torchtitan"
            elif name.startswith("torchtitan_bf16"):
                align = 1 if name == "torchtitan_bf16" else int(name.removeprefix("torchtitan_bf16_align"))
                mod = TorchtitanMoE(
                    dims["H"], dims["F"], dims["E"], dims["K"], ep_group, align=align, device=dev, dtype=torch.bfloat16
                )
                kind = "torchtitan"
            else:
                raise ValueError(f"unknown variant {name!r}")
            if kind == "moe_ep" and source is None:
                source = mod
            ok = 1
        except ImportError as exc:  # an optional peer's package (torchao) is missing: skipped, not failed
            errors[name] = f"{SKIPPED} (build: ImportError: {str(exc)[:400]})"
            ok = 0
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"build: {type(exc).__name__}: {str(exc)[:400]}"
            ok = 0
        flag = torch.tensor([ok], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if ok and not flag.item():
            errors.setdefault(name, "build failed on another rank")
        if flag.item():
            built[name] = Variant(name, mod, kind, clear_cache=name in ("mxfp8", "blockwise"))
    if source is None and built:  # only torchtitan variants: a reference-backend layer supplies the weights
        source = make("reference", "bf16")
    done = {id(source)}
    for v in built.values():
        if id(v.module) in done:  # the source itself, or mxfp8's layer again for mxfp8_cached
            continue
        done.add(id(v.module))
        if v.kind == "torchtitan":
            v.module.load_from_moe_ep(source)
        else:
            _copy_params(v.module, source)
    return built


def check_step(v: Variant, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """One forward + backward of y alone; the outputs and gradients the check compares."""
    v.prepare()
    x.grad = None
    y, _aux = v.forward(x)
    y.backward(g)
    out = {"y": y.detach(), "dx": x.grad, **v.grads()}
    del y, _aux
    for p in v.module.parameters():
        p.grad = None
    x.grad = None
    return out
