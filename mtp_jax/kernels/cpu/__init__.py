"""The CPU's kernels: products of a few rows by a weight read as stored (`cpu_rows`, native/row_kernels.h) and decode
attention (`cpu_attention`), built for this CPU's ISA level (`kernel_build`) and chosen where measured faster than
XLA (`kernel_choice`)."""
