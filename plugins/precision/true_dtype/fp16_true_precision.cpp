// Built-in precision `16-true`; see true_dtype_precision.inc.
#define FULGUR_TRUE_DTYPE Half
#define FULGUR_TRUE_DTYPE_NAME "16-true"
#define FULGUR_TRUE_DTYPE_DESCRIPTION "float16 parameters, buffers, inputs and compute"
#define FULGUR_TRUE_DTYPE_ALTERNATIVES "\"bf16-true\" or \"bf16-mixed\" (or \"32-true\")"
#include "true_dtype_precision.inc"
