"""The dispatch's implementations beside XLA's own: the CPU row kernel and decode attention (`cpu/`, C++ in
`cpu/native/`), the fixed-tile products (`fixed_tiles`: Triton on GPU, Pallas elsewhere) and the routed experts
(`routed_kernel`: Pallas on TPU, a gather elsewhere). Each registers itself with `ops.dispatch`."""
