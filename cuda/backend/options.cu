/* The DPCLIP_CUDA_* switches, read from the environment in this one place
 * (dcc.h, dcc_options). A backend reads them when it is made; kernels and
 * tests get them passed down, never from getenv. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "dcc.h"

namespace {

/* "0" turns a switch off; anything else (or nothing) leaves it on. */
bool on(const char *name) {
    const char *v = getenv(name);
    return !(v && v[0] == '0');
}

const char *set(const char *name) {
    const char *v = getenv(name);
    return v && v[0] ? v : NULL;
}

/* A tail switch's "K[:N]": K, and N in *after (-1 without one). */
int tail_spec(const char *v, long long *after) {
    const char *c = strchr(v, ':');
    *after = c ? atoll(c + 1) : -1;
    return atoi(v);
}

} // namespace

extern "C" void dcc_options_default(dcc_options *o) {
    memset(o, 0, sizeof *o);
    o->tf32 = o->grouped = o->one_pass = o->profile = o->wgmma = o->pdl = o->persist = true;
    o->sgrad = DCC_SGRAD_AUTO;
    o->bk_direct = DCC_DIRECT_AUTO;
    o->grouped_min = -1;
    o->grouped_layers = INT_MAX;
    o->noise = DCC_NOISE_FAST;
    o->tail_after = o->ghost_tail_after = -1;
}

extern "C" void dcc_options_from_env(dcc_options *o) {
    const char *v;
    dcc_options_default(o);
    o->tf32 = on("DPCLIP_CUDA_TF32");
    o->grouped = on("DPCLIP_CUDA_GROUPED");
    o->one_pass = on("DPCLIP_CUDA_ONE_PASS");
    o->bk_direct = on("DPCLIP_CUDA_BK_DIRECT") ? DCC_DIRECT_AUTO : DCC_DIRECT_OFF;
    o->profile = on("DPCLIP_CUDA_PROFILE");
    o->wgmma = on("DPCLIP_CUDA_WGMMA");
    o->pdl = on("DPCLIP_CUDA_PDL");
    o->persist = on("DPCLIP_CUDA_DIRECT_PERSIST");
    if ((v = set("DPCLIP_CUDA_SGRAD")))
        o->sgrad = v[0] == '0'             ? DCC_SGRAD_OFF
                   : strcmp(v, "all") == 0 ? DCC_SGRAD_ALL
                                           : DCC_SGRAD_AUTO;
    if ((v = set("DPCLIP_CUDA_NOISE")) && strcmp(v, "exact") == 0) o->noise = DCC_NOISE_EXACT;
    if ((v = set("DPCLIP_CUDA_GROUPED_MIN"))) o->grouped_min = atoi(v);
    if ((v = set("DPCLIP_CUDA_GROUPED_LAYERS")))
        o->grouped_layers = atoi(v); /* clamped where used */
    if ((v = set("DPCLIP_CUDA_DIRECT_TILE"))) o->direct_tile = atoi(v) >= 256 ? 256 : 128;
    if ((v = set("DPCLIP_CUDA_DIRECT_SPLIT"))) {
        int k = atoi(v);
        o->direct_split = k >= 3 ? 3 : k == 2 ? 2 : 1;
    }
    if ((v = set("DPCLIP_CUDA_OUT_BLOCKS"))) o->out_blocks = atoi(v) > 0 ? atoi(v) : 0;
    if ((v = set("DPCLIP_CUDA_DIRECT_TAIL")))
        o->tail_k = dcc_direct_ks_floor(tail_spec(v, &o->tail_after));
    if ((v = set("DPCLIP_CUDA_GHOST_TAIL"))) {
        const int k = tail_spec(v, &o->ghost_tail_after);
        o->ghost_tail_k = k <= 1 ? 1 : dcc_direct_ks_floor(k);
    }
    if ((v = set("DPCLIP_CUDA_GHOST_WIDE"))) o->ghost_wide = atoll(v) > 0 ? atoll(v) : -1;
}
