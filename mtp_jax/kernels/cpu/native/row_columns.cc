// One explicit instantiation of the row kernel's products, for the activation type ROW_X and the weight type ROW_W
// that the build names (-DROW_X=... -DROW_W=...): mtp_jax/kernels/cpu/cpu_rows.py builds one unit per pair at once.

#include "row_kernels.h"

namespace rows {
template ROWS_COLUMNS(ROW_X, ROW_W);
}  // namespace rows
