"""Attention backends and fused ops. `torch` runs everywhere (CPU and fallback); others are per device.

Note: Hugging Face `transformers` probes for a different package also named `kernels`; it only uses
one whose installed version lies in its supported range, which this project's version does not
(tests/test_packaging.py checks that importing transformers here never picks this package up).
"""
