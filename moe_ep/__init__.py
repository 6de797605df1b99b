"""moe_ep: expert-parallel MoE for PyTorch training with MXFP8 dispatch and grouped GEMMs.

GPU packages (CuPy, nvshmem4py) are imported lazily: ``import moe_ep`` works on any machine.
"""

from .config import MoEConfig
from .layer import MoE, update_expert_bias
from .mxfp8 import MXFP8Tensor, dequantize, quantize, to_blocked, to_blocked_grouped
from .parallel import finish, init_ep

__all__ = [
    "MoE",
    "MoEConfig",
    "MXFP8Tensor",
    "dequantize",
    "finish",
    "init_ep",
    "quantize",
    "to_blocked",
    "to_blocked_grouped",
    "update_expert_bias",
]
__version__ = "0.1.0"
