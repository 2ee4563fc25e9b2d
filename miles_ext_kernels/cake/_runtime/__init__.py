"""The shared runtime of `miles_ext_kernels.cake`: what every op stands on.

Torch-free (imported by the declarations and the miles hooks): `spec` (OpSpec, Flag), `registry` (the ops in order,
prebuild / release), `config` (the one argument surface; variant and options read at call time), `build` (archs,
routes, prebuild, no_build; torch and triton only inside its functions), `launch` (launches described once).
Imported by the op implementations only (they import torch, some triton, at the top): `autograd` (KernelOp: custom
ops + autograd from one description), `operands` (read in place or copy), `varlen` (tables from cu_seqlens),
`reduce` (fixed-order reductions), `workspace` (the pool), `checks` (argument checks), `constants` (kernel
constants), `testing` (error measures of the tests and demos).
"""
