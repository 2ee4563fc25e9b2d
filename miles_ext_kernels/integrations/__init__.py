"""Integrations of the cake ops into other frameworks' models (torch-free to import; each loads on first use).

- `miles_ext_kernels.integrations.transformers`: Hugging Face transformers' Qwen3-Next / Qwen3.5 models
  (`apply_to_qwen3_next`, `apply_to_qwen3_5`, `apply_to_qwen3_5_moe`) and Kimi-Linear's KDA layers
  (`apply_to_kimi_linear`).
"""
