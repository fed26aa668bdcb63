/* The plans of the wgmma norm forms (norms_tma.cu): the direct form's tile
 * height, a K split over a cluster, or the hybrid with a split tail; the
 * ghost form's split tail. Host code only, so it is built for every
 * architecture; the kernels it plans exist on sm_90a. */
#include "dcc.h"
#include "dcc_util.cuh"

/* Tile shape of the wgmma direct form, by a wave-aware cost model. With one
 * CTA per SM a launch costs about ceil(CTAs / SMs) times one CTA's work:
 *   - 256 rows of p instead of 128 halve the bytes loaded per flop but also
 *     the CTAs; the 256-row tile runs TALL_GAIN times faster per flop
 *     (measured on an H100: 1.14-1.36);
 *   - split KS (T >= SPLIT_MIN_T) runs each tile's K range
 *     on a KS-CTA cluster: KS times the CTAs, each with 1/KS of the k-tiles
 *     plus a fixed cost (pipeline fill, epilogue; for a split CTA also the
 *     exchange), FILL_TILES / SPLIT_TILES k-tiles' worth, fitted on an H100
 *     to the (8,2048,768,3072) and (2,8192,768,3072) shapes.
 * Clusters of 4 measured far slower than this model says (cluster placement
 * on 132 SMs), and clusters of 3 no better than 2 (on (2,8192,768,3072), the
 * one benchmark shape where the model would pick 3: 1.46x the GEMM against
 * 1.46x for 2 in one run, 1.56-1.58x against 1.46-1.51x across H100s), so
 * the model's split is at most 2; 3 can be forced.
 * DPCLIP_CUDA_DIRECT_TILE=128|256 and DPCLIP_CUDA_DIRECT_SPLIT=1|2|3 force
 * the choices (tests, benchmark). */
static const double TALL_GAIN = 1.3, FILL_TILES = 4.0, SPLIT_TILES = 12.0;
/* The hybrid's second launch and its tail's fill cost about 25 k-tiles on
 * top of the model: fitted on an H100 to (2,8192,768,3072), where the
 * hybrid ran 1.37x the GEMM against 1.56x for a split of every tile, and
 * (8,2048,768,3072), where a 2-way tail ran 1.22x against 1.11x unsplit. */
static const double HYBRID_TILES = 25.0;
/* ... and about 6 when the tail's launch overlaps the unsplit one's last
 * CTAs (programmatic dependent launch, dcc_options.pdl): its clusters take
 * SMs as they free up instead of after the slowest unsplit CTA. On an H100,
 * (2,8192,768,3072) with a tail of 2, 3, 4, 6 and 8 ran 1.35, 1.21, 1.18,
 * 1.17 and 1.25x the GEMM with the overlap, 1.49, 1.36, 1.37, 1.31 and
 * 1.35x without; (8,2048,768,3072)'s 2-way tail 1.10x against 1.11x
 * unsplit. */
static const double HYBRID_PDL_TILES = 6.0;
/* The tail's cluster sizes (norms_tma.cu instantiates these). 8 measured
 * slower than 6 (above), and still with the exchange spread over the
 * cluster (slice_sq): (2,8192,768,3072) 1.08-1.13 against 1.04-1.06x. */
static const int DIRECT_KS[] = {2, 3, 4, 6};
static const int SPLIT_MIN_T = 2048;

static double direct_cost(const dcc_linear *L, int rows, int split, int sms) {
    int64_t ctas = (int64_t)((L->p + rows - 1) / rows) * ((L->d + 127) / 128) * L->B * split;
    double waves = (double)((ctas + sms - 1) / sms);
    double ktn = (double)((L->T + 63) / 64);
    return waves * (rows == 256 ? 2.0 / TALL_GAIN : 1.0) *
           (ktn / split + (split > 1 ? SPLIT_TILES : FILL_TILES));
}

static int max_split(const dcc_linear *L) {
    return dcc_wgmma_available(L->opt) && L->T >= SPLIT_MIN_T ? 2 : 1;
}

static int64_t direct_tiles(const dcc_linear *L, int rows) {
    return (int64_t)((L->p + rows - 1) / rows) * ((L->d + 127) / 128) * L->B;
}

/* The cheapest plan, for the given tile height (0: either). Besides a split
 * of every tile, the hybrid: whole waves unsplit, then the last partial wave
 * split KS (DIRECT_KS) ways so that it fills more SMs for a fraction of a wave's
 * time. Clusters of 3-4 lose to placement when they fill the GPU; a tail
 * leaves most SMs to them. */
static void direct_shape(const dcc_linear *L, int rows_only, dcc_direct_plan *pl) {
    int sms, ms = max_split(L);
    double bc = 1e300, ktn = (double)((L->T + 63) / 64);
    pl->rows = rows_only ? rows_only : 128;
    pl->split = 1;
    pl->tail_ks = 0;
    pl->full = 0;
    pl->persist = false;
    /* a device that cannot be asked gets the plain plan; its launch then
     * reports the error */
    if (dcc_sm_count(&sms) != cudaSuccess) return;
    for (int rows = 128; rows <= 256; rows *= 2) {
        if (rows_only && rows != rows_only) continue;
        for (int split = 1; split <= ms; split++) {
            double c = direct_cost(L, rows, split, sms);
            if (c < bc * 0.999) {
                bc = c;
                *pl = (dcc_direct_plan){rows, split, 0, 0, false};
            }
        }
        int64_t ctas = direct_tiles(L, rows), waves = ctas / sms, tail = ctas % sms;
        if (ms < 2 || waves < 1 || tail == 0) continue;
        double w = rows == 256 ? 2.0 / TALL_GAIN : 1.0;
        double hybrid = dcc_pdl_on(L->opt) ? HYBRID_PDL_TILES : HYBRID_TILES;
        for (int ks : DIRECT_KS) {
            /* the whole tail at once: its CTAs fit the SMs, and its
             * clusters the GPCs (a cluster runs within one) */
            if (tail * ks > sms) break;
            if (tail > dcc_direct_max_clusters(rows, ks)) continue;
            double c = (double)waves * w * (ktn + FILL_TILES) +
                       w * (ktn / ks + SPLIT_TILES + hybrid);
            if (c < bc * 0.999) {
                bc = c;
                *pl = (dcc_direct_plan){rows, 1, ks, (long long)(waves * sms), false};
            }
        }
    }
}

extern "C" int dcc_direct_ks_floor(int k) {
    int r = DIRECT_KS[0];
    for (int ks : DIRECT_KS)
        if (ks <= k) r = ks;
    return r;
}

/* The forced tile height (dcc_options.direct_tile), or 0. */
static int forced_rows(const dcc_linear *L) { return L->opt ? L->opt->direct_tile : 0; }

extern "C" int dcc_direct_tile_rows(const dcc_linear *L) {
    dcc_direct_plan pl;
    if (int rows = forced_rows(L)) return rows;
    direct_shape(L, 0, &pl);
    return pl.rows;
}

/* The split of every tile; 1 when the plan splits only the tail. */
extern "C" int dcc_direct_split(const dcc_linear *L) {
    if (int k = L->opt ? L->opt->direct_split : 0)
        return k >= 3 ? (dcc_wgmma_available(L->opt) ? 3 : 2) : k;
    dcc_direct_plan pl;
    direct_shape(L, forced_rows(L), &pl);
    return pl.split;
}

/* dcc_options.direct_split forces a split of every tile (no hybrid);
 * tail_k forces the hybrid: a K-way tail (DIRECT_KS) after tail_after unsplit
 * tiles (-1: the whole waves). */
extern "C" void dcc_direct_plan_get(const dcc_linear *L, dcc_direct_plan *pl) {
    const dcc_options *o = L->opt;
    if (o && o->tail_k && dcc_wgmma_available(o)) {
        int rows = dcc_direct_tile_rows(L);
        int64_t total = direct_tiles(L, rows);
        int sms;
        long long n = 0; /* default: the whole waves; none if the device cannot be asked */
        if (o->tail_after >= 0) n = o->tail_after;
        else if (dcc_sm_count(&sms) == cudaSuccess) n = (long long)(total / sms * sms);
        *pl = (dcc_direct_plan){rows, 1, o->tail_k, n > total ? (long long)total : n, false};
    } else if (o && o->direct_split) {
        *pl = (dcc_direct_plan){dcc_direct_tile_rows(L), dcc_direct_split(L), 0, 0, false};
    } else {
        direct_shape(L, forced_rows(L), pl); /* the model's plan, in one search */
    }
    /* Before a split tail, two or more whole waves of 256-row tiles run on
     * persistent CTAs, which pay one pipeline fill for all their tiles (the
     * next tile's loads run under the last one's epilogue), not one a tile:
     * (8,2048,768,3072) 1.06-1.10 -> 1.03-1.09x the GEMM. Without a tail
     * the hardware's dealing of tiles did better: (2,4096,2048,8192)
     * 1.04-1.05 against 1.05-1.10x persistent (H100, same runs). */
    int sms;
    pl->persist = pl->rows == 256 && pl->tail_ks > 1 && (!o || o->persist) &&
                  dcc_sm_count(&sms) == cudaSuccess && pl->full >= 2 * (long long)sms &&
                  dcc_norms_grouped_ok(L, DC_ALGO_DIRECT);
}

/* The split ghost item's exchange moves two partial Gram blocks where the
 * direct form's moves one tile: priced above SPLIT_TILES. */
static const double GHOST_SPLIT_TILES = 16.0;

/* Pairs [first, items) of the ghost form: on persistent CTAs (fill paid
 * once), or whole waves so and the partial last wave on clusters of KS
 * (DIRECT_KS) CTAs, each with 1/KS of the pair's k-steps, priced as the
 * direct form's tail. A launch after another costs `after` more. Sets
 * tail_ks and full; returns the cost in k-steps. */
static double ghost_pairs(const dcc_linear *L, int64_t first, int64_t items, int sms,
                          double ks_pair, double after, dcc_ghost_plan *pl) {
    const int64_t rest = items - first, waves = rest / sms, tail = rest % sms;
    pl->tail_ks = 0;
    pl->full = items;
    if (rest == 0) return 0.0;
    const double start = first > 0 ? after : 0.0;
    double bc = start + (double)((rest + sms - 1) / sms) * ks_pair + FILL_TILES;
    if (tail == 0) return bc;
    for (int ks : DIRECT_KS) {
        if (tail * ks > sms) break;
        if (tail > dcc_direct_max_clusters(128, ks)) continue;
        double c = start + (waves ? (double)waves * ks_pair + FILL_TILES + after : 0.0) +
                   ks_pair / ks + GHOST_SPLIT_TILES;
        if (c < bc * 0.999) {
            bc = c;
            pl->tail_ks = ks;
            pl->full = first + waves * sms;
        }
    }
    return bc;
}

/* The ghost form. Its wide items (16-bit inputs) do two pairs' work with a
 * third fewer operand bytes a flop, their wide k-steps at TALL_GAIN over a
 * pair's; whole waves of them run first, one a CTA (fill paid each), and
 * the pairs left after them (ghost_pairs), whose finer grain fills the last
 * wave. Where the K ranges are short the fills and the second launch cost
 * more than the wide steps save: the plan of pairs alone is then cheaper.
 * The ghost CTA's resources are the direct 128-row CTA's (TG_SMEM =
 * tma_direct_smem<1>, CT threads), so the same clusters fit. */
extern "C" void dcc_ghost_plan_get(const dcc_linear *L, dcc_ghost_plan *pl) {
    const dcc_options *o = L->opt;
    const int64_t nt = (L->T + 127) / 128, pairs = nt * (nt + 1) / 2, items = pairs * L->B;
    const int64_t per_b = dcc_wide_count(nt), wides = per_b * L->B;
    int sms;
    *pl = (dcc_ghost_plan){0, 0, 0, items};
    if (!dcc_wgmma_available(o) || dcc_sm_count(&sms) != cudaSuccess) return;
    const int kb = L->ta == DC_F32 ? 32 : 64; /* k per stage: 128-byte rows */
    const int64_t ka = (L->d + kb - 1) / kb, kg = (L->p + kb - 1) / kb;
    const int64_t kw = ka > kg ? ka : kg, kn = ka + kg - kw;
    const double after = dcc_pdl_on(o) ? HYBRID_PDL_TILES : HYBRID_TILES;
    /* the wide items (m64n256 takes 16-bit operands K-major only, not
     * TF32): forced, or the model's choice of whole waves or none */
    const long long fw = o ? o->ghost_wide : 0;
    int64_t wide = 0;
    if (L->ta != DC_F32 && fw > 0) {
        wide = fw < wides ? fw : wides;
    } else if (L->ta != DC_F32 && fw == 0 && wides >= sms) {
        dcc_ghost_plan a = {wides / sms * sms, 0, 0, 0}, b;
        a.first = dcc_wide_first_pair(a.wide, per_b, pairs);
        const double ca = (double)(wides / sms) *
                              ((double)kw * 2.0 / TALL_GAIN + 2.0 * (double)kn + FILL_TILES) +
                          ghost_pairs(L, a.first, items, sms, (double)(ka + kg), after, &a);
        if (ca < ghost_pairs(L, 0, items, sms, (double)(ka + kg), after, &b)) wide = a.wide;
    }
    pl->wide = wide;
    pl->first = dcc_wide_first_pair(wide, per_b, pairs);
    /* the pairs after them: a forced tail (1: never split), or the model's */
    if (o && o->ghost_tail_k) {
        const int64_t rest = items - pl->first;
        long long n = o->ghost_tail_after >= 0 ? o->ghost_tail_after
                                               : (long long)(rest / sms * sms);
        if (o->ghost_tail_k > 1) {
            pl->tail_ks = o->ghost_tail_k;
            pl->full = pl->first + (n > rest ? rest : n);
        }
        return;
    }
    ghost_pairs(L, pl->first, items, sms, (double)(ka + kg), after, pl);
}
