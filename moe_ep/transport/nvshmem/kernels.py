"""The CUDA transport's kernels (kernels/transport/nvshmem/layout.cu, dispatch.cu, combine.cu): every instantiation the
launchers use, their loader and the argument converters shared by :mod:`.layout` and :mod:`.cuda`. numpy + torch only:
CuPy is imported when a kernel is first loaded."""

from __future__ import annotations

from ... import _cuda

MODE_VAL, MODE_BWD = 1, 2  # ep_expand's MODE (kernels/transport/nvshmem/dispatch.cu)
# ep_dispatch<IN, QB> (IN: 0 fp32 / 1 bf16; QB: the payload's scale block, 32 MXFP8 / 128 blockwise, 0 = raw rows
# of any dtype), ep_expand<MODE, QB, OT>, ep_dispatch_mx<IN, QB>, ep_combine<YT, BWD>
PAYLOAD_BLOCKS = (32, 128)  # the scale blocks QB the kernels are built for: MXFP8, blockwise
DISPATCH_NAMES = (
    tuple(f"ep_dispatch<{i},{q}>" for q in PAYLOAD_BLOCKS for i in (0, 1))
    + ("ep_dispatch<0,0>",)
    + tuple(f"ep_expand<{m},{q},{o}>" for m in (MODE_VAL, MODE_BWD) for q in (0, *PAYLOAD_BLOCKS) for o in (0, 1))
    + tuple(f"ep_dispatch_mx<{i},{q}>" for q in PAYLOAD_BLOCKS for i in (0, 1))
)
COMBINE_NAMES = tuple(f"ep_combine<{y},{b}>" for y in (0, 1) for b in (0, 1))
LAYOUT_NAMES = ("ep_layout_count", "ep_layout_place")

fn = _cuda.get_function  # (src, kernel, name_expressions)
# kernel-argument converters (short names: the launch argument lists are long)
p, i32, i64 = _cuda.ptr, _cuda.i32, _cuda.i64


def precompile() -> None:
    """Compile (or load from CuPy's cache) every transport kernel on this rank. ``runtime.init_runtime`` calls it
    before the new runtime's barrier, so compile-time skew between ranks never eats into a spin-wait timeout."""
    for name in LAYOUT_NAMES:
        fn("transport/nvshmem/layout.cu", name)
    for name in DISPATCH_NAMES:
        fn("transport/nvshmem/dispatch.cu", name, DISPATCH_NAMES)
    for name in COMBINE_NAMES:
        fn("transport/nvshmem/combine.cu", name, COMBINE_NAMES)
