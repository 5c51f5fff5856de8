// Built-in precision `64-true`; see true_dtype_precision.inc.
#define FULGUR_TRUE_DTYPE Double
#define FULGUR_TRUE_DTYPE_NAME "64-true"
#define FULGUR_TRUE_DTYPE_DESCRIPTION "float64 parameters, buffers, inputs and compute"
#define FULGUR_TRUE_DTYPE_ALTERNATIVES "\"32-true\""
#include "true_dtype_precision.inc"
