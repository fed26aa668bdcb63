/* Seed inputs for the fuzz targets, written at test time (run.sh) so they
 * follow the protocol as built: fuzz_seeds frame|step|group DIR.
 *
 * frame (fuzz_frame.c's input: a flags byte, then frames between
 * separators): steps
 * of every layer kind on the preamble's buffer 1, sent twice (the step
 * cache), the cache's regressions (an 11-byte varint id, an id after the
 * body), releases, handshakes, garbage, a norm group of one (JoinGroup
 * sequences, group steps up to 2^64 - 1) and steps in phases.
 * step (fuzz_step.c's input: 4 u16 buffer sizes, then a ClipStep): steps
 * whose tensors end exactly at their buffer's end.
 * group (fuzz_group.c's input: 4-byte operations of up to four clients):
 * the interleavings issue 37 found (a close while a grouped step waits on
 * the ledger or its group's timeout, group steps at 2^64 - 1 then other
 * batches), phases, a member leaving mid-step. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dpclip.pb-c.h"

#define SEED_MAX 8192

typedef struct seed {
    uint8_t b[SEED_MAX];
    size_t n;
    int frames;
} seed;

/* Starts a seed of fuzz_frame (flags byte) or fuzz_step (no header). */
static void seed_reset(seed *s) {
    s->n = 0;
    s->frames = 0;
}

static void put(seed *s, const void *p, size_t n) {
    if (!n) return; /* p may be NULL */
    if (s->n + n > SEED_MAX) {
        fprintf(stderr, "fuzz_seeds: a seed over %d bytes\n", SEED_MAX);
        exit(1);
    }
    memcpy(s->b + s->n, p, n);
    s->n += n;
}

/* A frame of fuzz_frame's input: the separator (fuzz_frame.c's FZ_SEP)
 * after the flags byte and every frame before it. */
static void put_frame(seed *s, const uint8_t *p, size_t n) {
    if (s->frames++) put(s, "\xde\xc0\xad\xde", 4);
    put(s, p, n);
}

static size_t pack_req(const Dpclip__Request *r, uint8_t *out) {
    size_t n = dpclip__request__get_packed_size(r);
    if (n > SEED_MAX) exit(1);
    return dpclip__request__pack(r, out);
}

static void put_req(seed *s, const Dpclip__Request *r) {
    uint8_t b[SEED_MAX];
    put_frame(s, b, pack_req(r, b));
}

static int write_seed(const char *dir, const char *name, const seed *s) {
    char path[1024];
    FILE *f;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (!(f = fopen(path, "wb")) || fwrite(s->b, 1, s->n, f) != s->n || fclose(f) != 0) {
        perror(path);
        return 1;
    }
    return 0;
}

/* --- steps ------------------------------------------------------------------- */

/* A ClipStep and the storage its pointers refer to. */
typedef struct step {
    Dpclip__ClipStep cs;
    Dpclip__ClipConfig cc;
    Dpclip__Layer layer[4], *layers[4];
    Dpclip__LinearLayer lin;
    Dpclip__EmbeddingLayer emb;
    Dpclip__LayerNormLayer ln;
    Dpclip__RMSNormLayer rms;
    Dpclip__TensorRef t[16];
    int64_t shape[16][3];
    int nt;
    Dpclip__TensorRef *norms, *coefs;
} step;

static Dpclip__TensorRef *ref(step *s, uint64_t buf, uint64_t off, Dpclip__DType dt, int nd,
                              int64_t a, int64_t b, int64_t c) {
    Dpclip__TensorRef *t = &s->t[s->nt];
    int64_t *sh = s->shape[s->nt++];
    dpclip__tensor_ref__init(t);
    sh[0] = a;
    sh[1] = b;
    sh[2] = c;
    t->buffer_id = buf;
    t->offset = off;
    t->dtype = dt;
    t->n_shape = (size_t)nd;
    t->shape = sh;
    return t;
}

static void step_init(step *s, uint32_t B) {
    memset(s, 0, sizeof *s);
    dpclip__clip_step__init(&s->cs);
    dpclip__clip_config__init(&s->cc);
    s->cc.max_grad_norm = 1.0f;
    s->cc.loss_reduction = DPCLIP__LOSS_REDUCTION__SUM;
    s->cs.clip = &s->cc;
    s->cs.batch_size = B;
    s->cs.layers = s->layers;
}

static Dpclip__Layer *add_layer(step *s, const char *name) {
    Dpclip__Layer *l = &s->layer[s->cs.n_layers];
    dpclip__layer__init(l);
    l->name = (char *)name;
    l->max_grad_norm = 0.5f;
    s->layers[s->cs.n_layers++] = l;
    return l;
}

static void add_linear(step *s, uint64_t buf, uint64_t off, int64_t B, int64_t T, int64_t d,
                       int64_t p, int outputs) {
    Dpclip__Layer *l = add_layer(s, "lin");
    dpclip__linear_layer__init(&s->lin);
    s->lin.activations = ref(s, buf, off, DPCLIP__DTYPE__F32, 3, B, T, d);
    off += (uint64_t)(B * T * d) * 4;
    s->lin.output_grad = ref(s, buf, off, DPCLIP__DTYPE__F32, 3, B, T, p);
    off += (uint64_t)(B * T * p) * 4;
    if (outputs) {
        s->lin.has_bias = 1;
        s->lin.weight_grad_out = ref(s, buf, off, DPCLIP__DTYPE__F32, 2, p, d, 0);
        off += (uint64_t)(p * d) * 4;
        s->lin.bias_grad_out = ref(s, buf, off, DPCLIP__DTYPE__F16, 1, p, 0, 0);
    }
    l->kind_case = DPCLIP__LAYER__KIND_LINEAR;
    l->linear = &s->lin;
}

static void add_embedding(step *s, uint64_t buf, uint64_t off, int64_t B, int64_t T, int64_t d,
                          uint64_t vocab) {
    Dpclip__Layer *l = add_layer(s, "emb");
    dpclip__embedding_layer__init(&s->emb);
    s->emb.indices = ref(s, buf, off, DPCLIP__DTYPE__I64, 2, B, T, 0);
    off += (uint64_t)(B * T) * 8;
    s->emb.output_grad = ref(s, buf, off, DPCLIP__DTYPE__BF16, 3, B, T, d);
    off += (uint64_t)(B * T * d) * 2;
    s->emb.num_embeddings = vocab;
    s->emb.has_padding_idx = 1;
    s->emb.padding_idx = 0;
    s->emb.weight_grad_out = ref(s, buf, off, DPCLIP__DTYPE__BF16, 2, (int64_t)vocab, d, 0);
    l->kind_case = DPCLIP__LAYER__KIND_EMBEDDING;
    l->embedding = &s->emb;
}

static void add_norms(step *s, uint64_t buf, uint64_t off, int64_t B, int64_t d) {
    Dpclip__Layer *l = add_layer(s, "ln");
    dpclip__layer_norm_layer__init(&s->ln);
    s->ln.input = ref(s, buf, off, DPCLIP__DTYPE__F16, 2, B, d, 0);
    s->ln.output_grad = ref(s, buf, off + (uint64_t)(B * d) * 2, DPCLIP__DTYPE__F16, 2, B, d, 0);
    s->ln.eps = 1e-5f;
    s->ln.has_bias = 1;
    s->ln.weight_grad_out = ref(s, buf, off + (uint64_t)(B * d) * 4, DPCLIP__DTYPE__F32, 1, d, 0,
                                0);
    s->ln.bias_grad_out = ref(s, buf, off + (uint64_t)(B * d) * 4 + (uint64_t)d * 4,
                              DPCLIP__DTYPE__F32, 1, d, 0, 0);
    l->kind_case = DPCLIP__LAYER__KIND_LAYER_NORM;
    l->layer_norm = &s->ln;
    l = add_layer(s, "rms");
    dpclip__rmsnorm_layer__init(&s->rms);
    s->rms.input = s->ln.input;
    s->rms.output_grad = s->ln.output_grad;
    s->rms.eps = 1e-6f;
    s->rms.weight_grad_out = s->ln.weight_grad_out;
    l->kind_case = DPCLIP__LAYER__KIND_RMS_NORM;
    l->rms_norm = &s->rms;
}

static void add_outputs(step *s, uint64_t buf, uint64_t off, int64_t B) {
    s->cs.norms_out = ref(s, buf, off, DPCLIP__DTYPE__F32, 1, B, 0, 0);
    s->cs.coefficients_out = ref(s, buf, off + (uint64_t)B * 4, DPCLIP__DTYPE__F32, 1, B, 0, 0);
}

/* The frame seeds' step: every layer kind on buffer 1 (16 KiB), noised. */
static void full_step(step *s) {
    step_init(s, 2);
    add_linear(s, 1, 0, 2, 3, 4, 5, 1);
    add_embedding(s, 1, 4096, 2, 3, 4, 7);
    add_norms(s, 1, 8192, 2, 6);
    add_outputs(s, 1, 12288, 2);
    s->cs.noise_multiplier = 1.0f;
    s->cs.sample_rate = 0.01;
    s->cs.want_layer_norms = 1;
}

static size_t step_frame(step *s, uint64_t id, uint8_t *out) {
    Dpclip__Request r = DPCLIP__REQUEST__INIT;
    r.id = id;
    r.body_case = DPCLIP__REQUEST__BODY_CLIP_STEP;
    r.clip_step = &s->cs;
    return pack_req(&r, out);
}

/* --- fuzz_frame's seeds ----------------------------------------------------- */

static void put_ping(seed *s, uint64_t id) {
    Dpclip__Request r = DPCLIP__REQUEST__INIT;
    Dpclip__Ping p = DPCLIP__PING__INIT;
    p.nonce = id;
    r.id = id;
    r.body_case = DPCLIP__REQUEST__BODY_PING;
    r.ping = &p;
    put_req(s, &r);
}

static void put_hello(seed *s, uint64_t id, uint32_t version) {
    Dpclip__Request r = DPCLIP__REQUEST__INIT;
    Dpclip__Hello h = DPCLIP__HELLO__INIT;
    h.protocol_version = version;
    h.client_name = "seed";
    h.job_id = "seed";
    r.id = id;
    r.body_case = DPCLIP__REQUEST__BODY_HELLO;
    r.hello = &h;
    put_req(s, &r);
}

static int frame_seeds(const char *dir) {
    static step st;
    seed s;
    uint8_t a[SEED_MAX], b[SEED_MAX];
    size_t na, nb, body, k;
    int rc = 0;

    full_step(&st);
    na = step_frame(&st, 3, a);
    body = na - 2; /* after [0x08 0x03] */

    /* a step, the same again (the cache), a ping */
    seed_reset(&s);
    put(&s, "\0", 1);
    put_frame(&s, a, na);
    nb = step_frame(&st, 4, b);
    put_frame(&s, b, nb);
    put_ping(&s, 5);
    rc |= write_seed(dir, "step-twice", &s);

    /* the same with data from the input (NaNs, bad indices) */
    s.b[0] = 0x02;
    rc |= write_seed(dir, "step-twice-filled", &s);

    /* then an 11-byte varint id before the same body: PROTOCOL, not a step */
    seed_reset(&s);
    put(&s, "\0", 1);
    put_frame(&s, a, na);
    k = 0;
    b[k++] = 0x08;
    for (int i = 0; i < 10; i++) b[k++] = 0xff;
    b[k++] = 0x01;
    memcpy(b + k, a + 2, body);
    put_frame(&s, b, k + body);
    put_ping(&s, 6);
    rc |= write_seed(dir, "cache-long-varint-id", &s);

    /* an id after the body, twice, and one before and after */
    seed_reset(&s);
    put(&s, "\0", 1);
    put_frame(&s, a, na);
    memcpy(b, a + 2, body);
    b[body] = 0x08;
    b[body + 1] = 0x09;
    put_frame(&s, b, body + 2);
    put_frame(&s, b, body + 2);
    memcpy(b, "\x08\x07", 2);
    memcpy(b + 2, a + 2, body);
    memcpy(b + 2 + body, "\x08\x09", 2);
    put_frame(&s, b, body + 4);
    rc |= write_seed(dir, "cache-id-after-body", &s);

    /* per-layer clipping, mean reduction; a budget too small; then a
     * release and the step again */
    st.cc.mode = DPCLIP__CLIPPING_MODE__PER_LAYER;
    st.cc.loss_reduction = DPCLIP__LOSS_REDUCTION__MEAN;
    st.cc.expected_batch_size = 4;
    st.cs.target_epsilon = 50.0;
    seed_reset(&s);
    put(&s, "\0", 1);
    na = step_frame(&st, 3, a);
    put_frame(&s, a, na);
    st.cs.target_epsilon = 1e-3; /* the job's budget, lowered: refused */
    nb = step_frame(&st, 5, b);
    put_frame(&s, b, nb);
    {
        Dpclip__Request r = DPCLIP__REQUEST__INIT;
        Dpclip__ReleaseBuffer rb = DPCLIP__RELEASE_BUFFER__INIT;
        rb.buffer_id = 1;
        r.id = 4;
        r.body_case = DPCLIP__REQUEST__BODY_RELEASE_BUFFER;
        r.release_buffer = &rb;
        put_req(&s, &r);
    }
    put_frame(&s, a, na);
    rc |= write_seed(dir, "per-layer-release", &s);

    /* no preamble: a handshake, a registration without its fd, a step */
    seed_reset(&s);
    put(&s, "\x01", 1);
    put_ping(&s, 1);
    put_hello(&s, 2, 1);
    put_hello(&s, 3, 1);
    {
        Dpclip__Request r = DPCLIP__REQUEST__INIT;
        Dpclip__RegisterBuffer rb = DPCLIP__REGISTER_BUFFER__INIT;
        rb.kind = DPCLIP__BUFFER_KIND__SHM_FD;
        rb.size = 4096;
        r.id = 4;
        r.body_case = DPCLIP__REQUEST__BODY_REGISTER_BUFFER;
        r.register_buffer = &rb;
        put_req(&s, &r);
    }
    put_frame(&s, a, na);
    rc |= write_seed(dir, "handshake", &s);

    /* another protocol version ends the session */
    seed_reset(&s);
    put(&s, "\x01", 1);
    put_hello(&s, 7, 2);
    put_ping(&s, 8);
    rc |= write_seed(dir, "handshake-version", &s);

    /* garbage, an empty frame, an unknown body, a truncated step */
    seed_reset(&s);
    put(&s, "\0", 1);
    put_frame(&s, (const uint8_t *)"\xff\xff\xff", 3);
    put_frame(&s, NULL, 0);
    put_frame(&s, (const uint8_t *)"\x08\x01\x82\x01\x00", 5);
    put_frame(&s, a, na / 2);
    put_ping(&s, 9);
    rc |= write_seed(dir, "garbage", &s);

    /* a norm group of one: join, grouped steps (the next, one given, the
     * largest there is and past it), a join refused on its terms, again */
    full_step(&st);
    seed_reset(&s);
    put(&s, "\0", 1);
    {
        Dpclip__Request r = DPCLIP__REQUEST__INIT;
        Dpclip__JoinGroup j = DPCLIP__JOIN_GROUP__INIT;
        static const uint64_t steps[4] = {0, 5, (uint64_t)1 << 62, UINT64_MAX};
        j.name = "seed";
        j.rank = 0;
        j.size = 1;
        r.id = 3;
        r.body_case = DPCLIP__REQUEST__BODY_JOIN_GROUP;
        r.join_group = &j;
        put_req(&s, &r);
        for (int i = 0; i < 4; i++) {
            st.cs.group_step = steps[i];
            na = step_frame(&st, 4 + (uint64_t)i, a);
            put_frame(&s, a, na);
        }
        st.cs.group_step = 0;
        j.size = 0;
        r.id = 8;
        put_req(&s, &r);
        j.size = 1;
        j.timeout_ms = 0xffffffffu;
        r.id = 9;
        put_req(&s, &r);
    }
    rc |= write_seed(dir, "group-of-one", &s);

    /* steps in phases: a norm pass (no outputs), its sums (with them), a
     * sums step too many */
    step_init(&st, 2);
    add_linear(&st, 1, 0, 2, 3, 4, 5, 0);
    seed_reset(&s);
    put(&s, "\0", 1);
    st.cs.phase = DPCLIP__STEP_PHASE__STEP_NORMS;
    na = step_frame(&st, 3, a);
    put_frame(&s, a, na);
    step_init(&st, 2);
    add_linear(&st, 1, 0, 2, 3, 4, 5, 1);
    st.cs.phase = DPCLIP__STEP_PHASE__STEP_SUMS;
    na = step_frame(&st, 4, a);
    put_frame(&s, a, na);
    put_frame(&s, a, na);
    rc |= write_seed(dir, "phases", &s);
    return rc;
}

/* --- fuzz_step's seeds ------------------------------------------------------- */

static int step_seed(const char *dir, const char *name, const uint16_t sizes[4], step *st) {
    seed s;
    seed_reset(&s);
    for (int i = 0; i < 4; i++) {
        uint8_t h[2] = {(uint8_t)(sizes[i] - 1), (uint8_t)((sizes[i] - 1) >> 8)};
        put(&s, h, 2);
    }
    if (dpclip__clip_step__get_packed_size(&st->cs) > SEED_MAX - s.n) return 1;
    s.n += dpclip__clip_step__pack(&st->cs, s.b + s.n);
    return write_seed(dir, name, &s);
}

static int step_seeds(const char *dir) {
    /* buffer 1: 4 KiB, 2: 306 bytes, 3: 64 bytes, 4: 1 KiB */
    static const uint16_t sizes[4] = {4096, 306, 64, 1024};
    static step st;
    int rc = 0;

    /* a linear layer filling buffer 2 exactly (96 + 120 + 80 + 10 bytes) */
    step_init(&st, 2);
    add_linear(&st, 2, 0, 2, 3, 4, 5, 1);
    rc |= step_seed(dir, "linear", sizes, &st);
    /* norms and coefficients ending at buffer 3's last byte (B = 8) */
    step_init(&st, 8);
    add_linear(&st, 1, 0, 8, 1, 4, 4, 0);
    add_outputs(&st, 3, 0, 8);
    rc |= step_seed(dir, "outputs", sizes, &st);
    /* an embedding and the norm layers */
    step_init(&st, 2);
    add_embedding(&st, 1, 0, 2, 3, 4, 7);
    add_norms(&st, 4, 0, 2, 6);
    st.cc.mode = DPCLIP__CLIPPING_MODE__PER_LAYER;
    rc |= step_seed(dir, "kinds", sizes, &st);
    /* a 2D linear at an offset, 4 bytes short of buffer 3's end */
    step_init(&st, 2);
    add_linear(&st, 3, 4, 2, 1, 4, 3, 0);
    st.lin.activations->n_shape = 2;
    st.lin.activations->shape[1] = 4;
    st.lin.output_grad->n_shape = 2;
    st.lin.output_grad->shape[1] = 3;
    rc |= step_seed(dir, "linear-2d", sizes, &st);
    return rc;
}

/* --- fuzz_group's seeds ------------------------------------------------------ */

/* fuzz_group.c's operations: [client | action << 2, a, b, c]. */
enum { G_CONNECT, G_JOIN, G_STEP, G_CLOSE, G_SHUT, G_RUN, G_DRAIN, G_PING };

static void gop(seed *s, unsigned client, unsigned action, uint8_t a, uint8_t b, uint8_t c) {
    uint8_t op[4] = {(uint8_t)(client | action << 2), a, b, c};
    put(s, op, 4);
}

/* A step's (a, b, c): batch, layers; sigma, group step choice; sample rate
 * choice (0 none, 1 one, 2 new to the ledger), phase, replicated. */
static void gstep(seed *s, unsigned client, unsigned B, unsigned sigma, unsigned step_choice,
                  unsigned rate, unsigned phase) {
    gop(s, client, G_STEP, (uint8_t)(B - 1), (uint8_t)(sigma | step_choice << 2),
        (uint8_t)(rate << 2 | phase << 4));
}

/* A join's (a, b, c): group, timeout choice (0 the default, 1 2 ms, 2 8 ms,
 * 3 over the maximum); rank, group-wise; size. */
static void gjoin(seed *s, unsigned client, unsigned group, unsigned timeout, unsigned rank,
                  unsigned size) {
    gop(s, client, G_JOIN, (uint8_t)(group | timeout << 4), (uint8_t)rank, (uint8_t)size);
}

static int group_seeds(const char *dir) {
    seed s;
    int rc = 0;
    /* join (reply unread), a step that waits on the ledger, close */
    seed_reset(&s);
    gop(&s, 0, G_CONNECT, 0, 0, 0);
    gjoin(&s, 0, 0, 0, 0, 1);
    gstep(&s, 0, 2, 2, 0, 2, 0);
    gop(&s, 0, G_CLOSE, 0, 0, 0);
    rc |= write_seed(dir, "ledger-wait-close", &s);
    /* rank 0 of 2 with a short timeout: a step, half-close, the timeout */
    seed_reset(&s);
    gop(&s, 0, G_CONNECT, 0, 0, 0);
    gjoin(&s, 0, 1, 2, 0, 2);
    gop(&s, 0, G_DRAIN, 0, 0, 0);
    gstep(&s, 0, 2, 0, 0, 0, 0);
    gop(&s, 0, G_SHUT, 0, 0, 0);
    gop(&s, 0, G_RUN, 12, 0, 0);
    gop(&s, 0, G_CLOSE, 0, 0, 0);
    rc |= write_seed(dir, "timeout-close", &s);
    /* two members at group step 2^64 - 1, then batches 8 and 4 */
    seed_reset(&s);
    gop(&s, 0, G_CONNECT, 0, 0, 0);
    gop(&s, 1, G_CONNECT, 0, 0, 0);
    gjoin(&s, 0, 2, 0, 0, 2);
    gjoin(&s, 1, 2, 0, 1, 2);
    gstep(&s, 0, 4, 0, 5, 0, 0);
    gstep(&s, 1, 4, 0, 5, 0, 0);
    gop(&s, 0, G_RUN, 2, 0, 0);
    gstep(&s, 0, 8, 0, 0, 0, 0);
    gstep(&s, 1, 4, 0, 0, 0, 0);
    gop(&s, 0, G_RUN, 4, 0, 0);
    rc |= write_seed(dir, "wrap-batches", &s);
    /* a norm pass, its sums, a whole step, a pass again and a close */
    seed_reset(&s);
    gop(&s, 2, G_CONNECT, 1, 0, 0);
    gstep(&s, 2, 4, 0, 0, 1, 1);
    gstep(&s, 2, 4, 0, 0, 0, 2);
    gstep(&s, 2, 4, 1, 0, 1, 0);
    gstep(&s, 2, 4, 0, 0, 1, 1);
    gop(&s, 2, G_CLOSE, 0, 0, 0);
    rc |= write_seed(dir, "phases", &s);
    /* members that step and leave while the others wait: a group of 3 */
    seed_reset(&s);
    for (unsigned k = 0; k < 3; k++) gop(&s, k, G_CONNECT, 0, 0, 0);
    for (unsigned k = 0; k < 3; k++) gjoin(&s, k, 0, 0, k, 3);
    gstep(&s, 0, 3, 1, 0, 2, 0);
    gstep(&s, 1, 3, 1, 0, 2, 0);
    gop(&s, 1, G_CLOSE, 0, 0, 0);
    gstep(&s, 2, 3, 1, 0, 2, 0);
    gop(&s, 0, G_RUN, 3, 0, 0);
    gjoin(&s, 0, 0, 0, 0, 0); /* size 0: refused */
    gop(&s, 3, G_PING, 0, 0, 0);
    rc |= write_seed(dir, "leave-mid-step", &s);
    /* a logical step's micro-batches (the step's c top bit; b bit 6 a new
     * logical step, bit 5 the commit), grouped, then one closed mid-way */
    seed_reset(&s);
    gop(&s, 0, G_CONNECT, 0, 0, 0);
    gop(&s, 1, G_CONNECT, 0, 0, 0);
    gjoin(&s, 0, 1, 0, 0, 2);
    gjoin(&s, 1, 1, 0, 1, 2);
    for (unsigned m = 0; m < 3; m++)
        for (unsigned k = 0; k < 2; k++)
            gop(&s, k, G_STEP, 2, (uint8_t)((m == 0) << 6 | (m == 2) << 5 | 1), 0x80 | 1 << 2);
    gop(&s, 0, G_RUN, 4, 0, 0);
    gop(&s, 1, G_STEP, 2, 1 << 6, 0x80);
    gop(&s, 1, G_CLOSE, 0, 0, 0);
    rc |= write_seed(dir, "logical-steps", &s);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[1], "frame") != 0 && strcmp(argv[1], "step") != 0 &&
                      strcmp(argv[1], "group") != 0)) {
        fprintf(stderr, "usage: fuzz_seeds frame|step|group DIR\n");
        return 2;
    }
    if (strcmp(argv[1], "group") == 0) return group_seeds(argv[2]);
    return strcmp(argv[1], "frame") == 0 ? frame_seeds(argv[2]) : step_seeds(argv[2]);
}
