/* The portable instantiation: 16-byte vectors (SSE2 on x86-64, NEON on ARM, or scalars),
 * for every CPU the other paths do not cover. */
#include "prelude.h"

#define PA_ISA generic
#define PA_VBYTES 16
#include "instantiate.h"
