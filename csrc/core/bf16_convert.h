/* bfloat16 <-> float32 conversion of whole arrays, for the ops that compute a bfloat16 call in
 * float32 (pyattn's portable bf16 path). Not a template: bf16 is stored as its 16 bits. */
#ifndef PA_BF16_CONVERT_H
#define PA_BF16_CONVERT_H

#include <stdint.h>

/* dst[i] = the float32 of src[i]'s bits (exact: bf16 is float32's upper half) */
void pa_f32_from_bf16(int64_t n, const uint16_t *src, float *dst);
/* dst[i] = src[i] rounded to the nearest bf16, ties to even; NaN stays a (quiet) NaN of its sign */
void pa_bf16_from_f32(int64_t n, const float *src, uint16_t *dst);

#endif
