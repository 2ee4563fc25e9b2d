"""Named constants of the kernels (Triton constexprs: a kernel reads them as compile-time values, the same code as a
literal). Torch-free; imports triton."""
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)    # ln(2): log(x) = log2(x) * LN2
