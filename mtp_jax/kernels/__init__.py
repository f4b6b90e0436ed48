"""The dispatch's implementations beside XLA's own: the CPU row kernel and decode attention (`cpu/`, C++ in
`cpu/native/`), the fixed-tile products (`fixed_tiles`: Triton on GPU, Pallas elsewhere) and the routed experts
(`routed_kernel` for a small pass: Pallas on TPU, a gather elsewhere; `grouped_kernel` for a large one: Pallas on
TPU) and the gated DeltaNet's delta rule (`delta_rule_kernel`: Pallas on TPU). Each registers itself with
`ops.dispatch`."""
