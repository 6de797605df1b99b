"""Drop-in expert parallelism for other libraries' MoE models (optional dependencies, imported lazily).

- :mod:`moe_ep.integrations.hf`: Hugging Face transformers (Qwen3-MoE, DeepSeek-V3, Mixtral): ``swap_moe_blocks``.
- :mod:`moe_ep.integrations.torchtitan`: torchtitan's MoE (only when its package imports next to our torch).
"""
