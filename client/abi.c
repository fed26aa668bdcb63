/* What a binding needs to know it matches this library: the release (one
 * number, DPCLIP_VERSION_* in dpclip.h, which CMakeLists.txt reads too) and
 * the size of every public struct as this library was built. A binding that
 * mirrors dpclip.h without including it (python/dpclip/_lib.py, ctypes)
 * checks them when it loads the library, so a struct that grew or shrank is
 * refused by name instead of being passed at the wrong size. */
#include <string.h>

#include "internal.h"

#define CL_STR_(x) #x
#define CL_STR(x) CL_STR_(x)
#define CL_STRUCT(t)                                                                               \
    { #t, sizeof(t) }

static const struct {
    const char *name;
    size_t size;
} cl_abi_structs[] = {
    CL_STRUCT(dpclip_tensor),      CL_STRUCT(dpclip_connect_opts), CL_STRUCT(dpclip_daemon_info),
    CL_STRUCT(dpclip_clip_config), CL_STRUCT(dpclip_linear),       CL_STRUCT(dpclip_embedding),
    CL_STRUCT(dpclip_norm_layer),  CL_STRUCT(dpclip_result),       CL_STRUCT(dpclip_timing),
    CL_STRUCT(dpclip_enqueued),    CL_STRUCT(dpclip_group_opts),   CL_STRUCT(dpclip_group_link),
};

DPCLIP_API const char *dpclip_version(void) {
    return CL_STR(DPCLIP_VERSION_MAJOR) "." CL_STR(DPCLIP_VERSION_MINOR) "." CL_STR(
        DPCLIP_VERSION_PATCH);
}

DPCLIP_API size_t dpclip_sizeof(const char *name) {
    if (!name) return 0;
    for (size_t i = 0; i < sizeof cl_abi_structs / sizeof cl_abi_structs[0]; i++)
        if (strcmp(cl_abi_structs[i].name, name) == 0) return cl_abi_structs[i].size;
    return 0;
}
