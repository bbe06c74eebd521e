/* What the bind files give module.c: each its slice of pyattn._core's method table, ended by a
 * {NULL} entry, for module.c to join; and the feature maps' names, for the FM_* constants. */
#ifndef PA_BIND_H
#define PA_BIND_H

#include "args.h"

extern PyMethodDef pyattn_softmax_methods[];
extern PyMethodDef pyattn_sparse_methods[];
extern PyMethodDef pyattn_feature_map_methods[];
extern PyMethodDef pyattn_linear_methods[];
extern PyMethodDef pyattn_delta_methods[];
extern PyMethodDef pyattn_dplr_methods[];
extern PyMethodDef pyattn_loglin_methods[];
extern PyMethodDef pyattn_nn_methods[];
extern PyMethodDef pyattn_runtime_methods[];
extern PyMethodDef pyattn_bf16_methods[];

/* indexed by PA_FM_* */
extern const char *const pa_feature_map_names[PA_FM_COUNT];

#endif
