"""Attention backends and fused ops. `torch` runs everywhere (CPU and fallback); others are per device.

Note: Hugging Face `transformers` probes for a different package also named `kernels`. It finds this
one by import name, then looks up its version through the installed distribution (here `engine`,
version 0.1.0) and uses it only inside its supported version range, which 0.1.0 is not.
tests/test_ipc_and_packaging.py checks that `is_kernels_available()` stays False with this project
installed.
"""
