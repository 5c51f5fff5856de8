// Built-in precision `bf16-true`; see true_dtype_precision.inc.
#define FULGUR_TRUE_DTYPE BFloat16
#define FULGUR_TRUE_DTYPE_NAME "bf16-true"
#define FULGUR_TRUE_DTYPE_DESCRIPTION "bfloat16 parameters, buffers, inputs and compute"
#define FULGUR_TRUE_DTYPE_ALTERNATIVES "\"16-mixed\" or \"32-true\""
#include "true_dtype_precision.inc"
