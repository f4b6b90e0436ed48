"""The operations the models call, each a single entry point: projections and sums whose rows do not depend on the
pass (`rowwise`), the one dispatch to the kernels that can run them (`dispatch`), a weight read in place from its
layer stack (`stacked_weights`), products laid out as plain matmuls (`matmul_layout`), loops with one unroll
switch (`loops`), and the routing weights' spread over experts (`routing`)."""
