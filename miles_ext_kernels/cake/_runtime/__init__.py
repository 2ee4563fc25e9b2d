"""The shared runtime of `miles_ext_kernels.cake`: op specs, registry, configuration, builds, workspace pool.

Torch-free at import: `spec`, `registry` and `config` import neither torch nor triton; `build`, `workspace`,
`checks` and `testing` import torch (and triton, for `build`) only where a function needs it.
"""
