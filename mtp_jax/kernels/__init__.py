"""The execution plan (`execution_plan`: which implementation each operation takes) and the operations' dispatch to
its choice (`dispatch`), with the implementations it may name beside XLA's own: the CPU row kernel and decode
attention (`cpu/`, C++ in `cpu/native/`), the fixed-tile products (`fixed_tiles`: Triton on GPU, Pallas elsewhere),
the routed experts (`routed_kernel` for a small pass: Pallas on TPU, a gather elsewhere; `grouped_kernel` for a
large one: Pallas on TPU) and the gated DeltaNet's delta rule (`delta_rule_kernel`: Pallas on TPU)."""
