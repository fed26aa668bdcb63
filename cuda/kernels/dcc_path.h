/* The kernel families that compute a LINEAR layer's per-sample norms, as
 * dcc_linear_path (norms_linear.cu) picks them: by dtype, alignment and the
 * device. Plain C: tests and the benchmark print and compare them. */
#ifndef DC_DCC_PATH_H
#define DC_DCC_PATH_H

typedef enum dcc_path {
    DCC_PATH_SIMT = 0,     /* CUDA cores: exact f32, or mixed input/grad dtypes */
    DCC_PATH_MMA_ELEM = 1, /* bf16/f16 mma.sync, element loads (unaligned or odd widths) */
    DCC_PATH_MMA_VEC = 2,  /* bf16/f16 mma.sync, 16-byte cp.async loads */
    DCC_PATH_WGMMA = 3,    /* bf16/f16 Hopper wgmma (sm_90a) fed by TMA */
    DCC_PATH_TF32 = 4      /* f32 on TF32 mma.sync (DPCLIP_CUDA_TF32 not 0) */
} dcc_path;

#endif
