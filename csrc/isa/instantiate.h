/* Included by each csrc/isa/<name>.c with PA_ISA, PA_VBYTES and a target in force:
 * instantiates every kernel for float and double and defines their pa_kernels tables. */
#undef PA_DOUBLE
#define PA_DOUBLE 0
#include "instantiate_dtype.h"
#undef PA_DOUBLE
#define PA_DOUBLE 1
#include "instantiate_dtype.h"
