/* libdpclip: the C ABI trainers link to talk to dpclipd.
 *
 * A trainer connects once, registers shared-memory buffers once (the daemon
 * maps them), then sends one ClipStep per optimizer step that names, by
 * (buffer, offset, dtype, shape), each layer's activations and output
 * gradients. The daemon answers with per-sample norms and clipping
 * coefficients and writes the clipped, noised gradient sums into the output
 * tensors the step names.
 *
 * Conventions: every function returns 0 (DPCLIP_OK) or a positive
 * DPCLIP_E* code; the message of the last failure on a handle is
 * dpclip_errmsg(). No global state. A dpclip_client is thread-safe: calls on
 * one handle are serialized by an internal mutex (a blocking dpclip_run holds
 * it for the round trip). dpclip_step objects are not thread-safe; build
 * each on one thread.
 */
#ifndef DPCLIP_H
#define DPCLIP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The release: the one place its number is written. CMakeLists.txt reads it
 * (the daemon, the tools, the library's soname) and so does the Python
 * package (python/dpclip/_version.py). */
#define DPCLIP_VERSION_MAJOR 0
#define DPCLIP_VERSION_MINOR 1
#define DPCLIP_VERSION_PATCH 0

/* Error codes: 1..10 are the daemon's (proto ErrorCode); 100+ are local. */
enum {
    DPCLIP_OK = 0,
    DPCLIP_EINVAL = 1,    /* a field of the request is invalid (see dpclip_errfield) */
    DPCLIP_ENOTFOUND = 2, /* unknown buffer id */
    DPCLIP_EPERM = 3,
    DPCLIP_EPRECOND = 4, /* e.g. step before handshake */
    DPCLIP_ENOSPACE = 5,
    DPCLIP_ENONFINITE = 6, /* NaN/inf in an input; nothing was written */
    DPCLIP_EPROTO = 7,
    DPCLIP_EINTERNAL = 8,
    DPCLIP_EUNAVAIL = 9,
    DPCLIP_EUNIMPL = 10,
    DPCLIP_EIO = 100, /* socket error or daemon gone: the handle is dead */
    DPCLIP_ENOMEM = 101,
    DPCLIP_EAGAIN = 102, /* dpclip_wait/poll: not finished yet */
    DPCLIP_EARG = 103    /* bad argument to a library call (local check) */
};

typedef enum dpclip_dtype {
    DPCLIP_F32 = 1,
    DPCLIP_BF16 = 2,
    DPCLIP_F16 = 3,
    DPCLIP_I32 = 4,
    DPCLIP_I64 = 5
} dpclip_dtype;

typedef struct dpclip_client dpclip_client;
typedef struct dpclip_step dpclip_step;

/* A tensor reference: contiguous row-major view into a registered buffer.
 * ndim 0 (or buffer 0) means "absent" for optional tensors. */
typedef struct dpclip_tensor {
    uint64_t buffer;
    uint64_t offset; /* bytes */
    dpclip_dtype dtype;
    int ndim; /* 1..3 */
    int64_t shape[3];
} dpclip_tensor;

/* --- connection ---------------------------------------------------------- */

typedef struct dpclip_connect_opts {
    const char *client_name; /* shown in the daemon's logs/status; may be NULL */
    const char *job_id;      /* the privacy ledger's account (with the caller's uid);
                                 NULL or "": a fresh one of this handle's own,
                                 "anon-" and 16 random hex digits (dpclip_job_id) */
    int timeout_ms;          /* connect + handshake; 0 = 10000 */
} dpclip_connect_opts;

/* Default socket path: $DPCLIP_SOCKET, else /run/dpclip/dpclipd.sock. */
const char *dpclip_default_socket(void);

/* On failure *out is still set (unless DPCLIP_ENOMEM) so dpclip_errmsg works;
 * dpclip_disconnect it either way. */
int dpclip_connect(const char *socket_path, const dpclip_connect_opts *opts, dpclip_client **out);
void dpclip_disconnect(dpclip_client *c);

/* The job id the handle's Hello named: the one given, or the fresh one
 * made for it. "" for NULL. */
const char *dpclip_job_id(const dpclip_client *c);

const char *dpclip_errmsg(const dpclip_client *c);
const char *dpclip_errfield(const dpclip_client *c); /* "" if none */
const char *dpclip_strerror(int code);

/* What the daemon announced at handshake. */
typedef struct dpclip_daemon_info {
    uint32_t protocol_version;
    char daemon_version[32];
    uint32_t max_batch;
    uint32_t max_layers;
    uint32_t max_frame;
    uint64_t session_id;
    int has_cuda;   /* the daemon serves CUDA buffers */
    int mps_active; /* the CUDA MPS control daemon serves the node */
} dpclip_daemon_info;
int dpclip_daemon_info_get(dpclip_client *c, dpclip_daemon_info *info);
/* 1 once a reply said the daemon runs with --insecure-fixed-seed (every
 * reply says so, the Hello's first): its noise is predictable and nothing it
 * computes is private, whatever epsilon it reports. 0 otherwise. */
int dpclip_insecure(const dpclip_client *c);

/* --- buffers ------------------------------------------------------------- */

/* Allocate `size` bytes of shared memory (memfd, sealed against shrinking),
 * map it here and register it with the daemon. *data is the local mapping. */
int dpclip_buffer_alloc(dpclip_client *c, size_t size, uint64_t *buffer_id, void **data);
/* Register an existing memfd (must carry F_SEAL_SHRINK). The library does not
 * take ownership of fd; the daemon keeps its own reference. */
int dpclip_buffer_register_fd(dpclip_client *c, int fd, size_t size, uint64_t *buffer_id);
/* Release a buffer; for dpclip_buffer_alloc buffers also unmaps it here. */
int dpclip_buffer_release(dpclip_client *c, uint64_t buffer_id);

/* --- GPU memory (CUDA IPC) ------------------------------------------------ */

/* Register the CUDA allocation that holds dev_ptr: the library finds the
 * allocation's base and size (cuMemGetAddressRange), exports it
 * (cuIpcGetMemHandle) and registers it once; *offset receives dev_ptr's byte
 * offset inside the buffer. A pointer into an allocation this handle has
 * already registered returns the same buffer without a round trip, so
 * tensors from a caching allocator (PyTorch's) cost one registration per
 * allocation. The CUDA driver is loaded at run time (libcuda.so.1): this
 * library has no link-time CUDA dependency. The calling thread must have the
 * allocation's context current (it does after any CUDA runtime call on that
 * device). DPCLIP_EUNAVAIL without a CUDA driver. */
int dpclip_buffer_register_cuda(dpclip_client *c, const void *dev_ptr, uint64_t *buffer_id,
                                uint64_t *offset);
/* The same for n device pointers at once: refs[2i] and refs[2i + 1] are
 * ptrs[i]'s buffer and offset (an allocation looked up once per call). On
 * an error the handle's message names the pointer's index. */
int dpclip_buffer_refs_cuda(dpclip_client *c, size_t n, const uint64_t *ptrs, uint64_t *refs);
/* The same without waiting on the daemon: only allocations this handle
 * has registered (and not seen replaced) are named; any other pointer
 * fails it with DPCLIP_EAGAIN, nothing sent. The daemon answers a
 * session's requests in order, so a registration waits for the session's
 * steps in flight; a norm group member's micro-batch waits there for the
 * other members', which may wait on the device for this process's later
 * sends (a pipeline's): a registration then would never be answered. */
int dpclip_buffer_refs_cuda_cached(dpclip_client *c, size_t n, const uint64_t *ptrs,
                                   uint64_t *refs);
/* Register from a CUDA IPC memory handle the caller exported itself
 * (cudaIpcGetMemHandle on an allocation's base; 64 bytes); `size` bytes from
 * the base are addressable (0 = the whole allocation). */
int dpclip_buffer_register_cuda_handle(dpclip_client *c, const void *ipc_handle, uint64_t size,
                                       int device, uint64_t *buffer_id);
/* Done flags (dpclip_step_set_done_flag) on the GPU. dpclip_cuda_host_map:
 * host memory [ptr, ptr + size) (a dpclip_buffer_alloc buffer's page)
 * registered with the current CUDA context and mapped into it; *dev_ptr
 * is its device address. dpclip_cuda_host_unmap undoes it.
 * dpclip_cuda_wait_value: `stream` (a cudaStream_t; NULL: the legacy
 * default stream) waits until the u32 at dev_ptr reaches value, a cyclic
 * >= (cuStreamWaitValue32): work queued after it runs once the daemon
 * stored a step's done_value. Only the daemon's host (or this process's)
 * writes such a flag, so the wait depends on no other GPU work. EUNAVAIL
 * where the driver lacks these calls. */
int dpclip_cuda_host_map(void *ptr, size_t size, void **dev_ptr);
int dpclip_cuda_host_unmap(void *ptr);
int dpclip_cuda_wait_value(void *stream, const void *dev_ptr, uint32_t value);
/* `bytes` of device memory at dev_ptr zeroed on `stream` (cuMemsetD8Async,
 * in the calling thread's current context): no kernel, no allocation and no
 * stream made, so a thread may call it while another one is blocked in a
 * device synchronisation behind a done flag (which is where the trainer
 * zeroes a dead daemon's outputs before it releases their flags). It runs
 * in the context that owns dev_ptr (the thread needs none current);
 * DPCLIP_EARG where dev_ptr is no device memory of this process. */
int dpclip_cuda_zero_async(void *stream, void *dev_ptr, size_t bytes);
/* Register an interprocess event (created with cudaEventInterprocess |
 * cudaEventDisableTiming) by its cudaIpcEventHandle_t bytes (64). */
int dpclip_event_register_cuda(dpclip_client *c, const void *ipc_event_handle, int device,
                               uint64_t *event_id);

/* --- steps --------------------------------------------------------------- */

typedef enum dpclip_reduction { DPCLIP_SUM = 1, DPCLIP_MEAN = 2 } dpclip_reduction;
typedef enum dpclip_algo {
    DPCLIP_ALGO_AUTO = 0,
    DPCLIP_ALGO_DIRECT = 1,
    DPCLIP_ALGO_GHOST = 2
} dpclip_algo;
typedef enum dpclip_clip_mode { DPCLIP_FLAT = 0, DPCLIP_PER_LAYER = 1 } dpclip_clip_mode;

typedef struct dpclip_clip_config {
    float max_grad_norm; /* C > 0 */
    dpclip_reduction reduction;
    uint32_t expected_batch_size; /* MEAN: divisor of the noised sum; 0 = batch size, refused
                                     with a sample_rate in (0, 1) (it would be released) */
    float noise_multiplier;       /* sigma >= 0 */
    dpclip_clip_mode mode;
    /* Privacy accounting (the daemon's ledger for this job: connect's job_id
     * and the caller's uid). Appended fields: zero keeps the old meaning. */
    double sample_rate;    /* Poisson rate q of the batch; 0 = not given (counted as 1) */
    double target_delta;   /* delta to report epsilon at; 0 = the job's current one */
    double target_epsilon; /* job budget at that delta: steps past it are refused
                                     (DPCLIP_ENOSPACE); 0 = keep; it can only be lowered */
} dpclip_clip_config;

dpclip_step *dpclip_step_new(uint32_t batch_size, const dpclip_clip_config *cfg);
void dpclip_step_free(dpclip_step *s);
/* Reuse a step object for the next training step (keeps allocations). */
void dpclip_step_reset(dpclip_step *s, uint32_t batch_size);

typedef struct dpclip_linear {
    const char *name;          /* may be NULL */
    dpclip_tensor activations; /* [B,d] or [B,T,d] */
    dpclip_tensor output_grad; /* [B,p] or [B,T,p] */
    int has_bias;
    dpclip_algo algo;
    dpclip_tensor weight_grad_out; /* optional [p,d] */
    dpclip_tensor bias_grad_out;   /* optional [p] */
    float max_grad_norm;           /* PER_LAYER only */
} dpclip_linear;

typedef struct dpclip_embedding {
    const char *name;
    dpclip_tensor indices;     /* [B] or [B,T], I32/I64 */
    dpclip_tensor output_grad; /* [B,d] or [B,T,d] */
    uint64_t num_embeddings;
    int has_padding_idx;
    int64_t padding_idx;
    dpclip_tensor weight_grad_out; /* optional [num_embeddings,d] */
    float max_grad_norm;
} dpclip_embedding;

typedef struct dpclip_norm_layer { /* LayerNorm and RMSNorm */
    const char *name;
    dpclip_tensor input; /* the layer's input x */
    dpclip_tensor output_grad;
    float eps;
    int has_bias; /* LayerNorm only */
    dpclip_tensor weight_grad_out;
    dpclip_tensor bias_grad_out;
    float max_grad_norm;
} dpclip_norm_layer;

int dpclip_step_add_linear(dpclip_step *s, const dpclip_linear *l);
int dpclip_step_add_embedding(dpclip_step *s, const dpclip_embedding *e);
int dpclip_step_add_layernorm(dpclip_step *s, const dpclip_norm_layer *n);
int dpclip_step_add_rmsnorm(dpclip_step *s, const dpclip_norm_layer *n);
/* Optional [B] f32 outputs written by the daemon. */
int dpclip_step_set_outputs(dpclip_step *s, const dpclip_tensor *norms_out,
                            const dpclip_tensor *coefs_out);
void dpclip_step_want_layer_norms(dpclip_step *s, int yes);
/* GPU steps: the daemon's stream waits on wait_event (which the trainer
 * recorded after producing the step's tensors) and records signal_event once
 * the outputs are written. 0 = none. Without a wait_event the daemon reads
 * the tensors as soon as the request arrives, ordered after nothing in this
 * process: they must be complete on the device (synchronise first; note that
 * a cudaMemcpy from pageable memory can return before its data lands). */
void dpclip_step_set_events(dpclip_step *s, uint64_t wait_event, uint64_t signal_event);
/* GPU steps with a signal_event, submitted with dpclip_submit: ask the
 * daemon for an early notice once it has queued the step's GPU work and
 * recorded signal_event, so the trainer can queue work behind the event
 * (cudaStreamWaitEvent) while the daemon's GPU work runs, and collect the
 * result later with dpclip_wait. See dpclip_wait_enqueued. */
void dpclip_step_notify_enqueued(dpclip_step *s, int yes);
/* Completion in shared memory (with dpclip_step_notify_enqueued): flag is
 * one DPCLIP_I32 [1] in a shared-memory buffer of this client, or [2]: the
 * flag and its abandon word. The notice then comes as soon as the daemon
 * accepted the step (validated and charged), before any of its work, and
 * its done_value is what the daemon stores into the flag once the step's
 * work has finished: after success, and after a failure once every output
 * is zeroed. A stream can wait on it (dpclip_cuda_wait_value, on the page
 * registered with the device) instead of on signal_event, which may then
 * be 0. Where a failed step's outputs cannot be zeroed (the daemon's CUDA
 * context broke), they may hold clipped sums without their noise: the
 * flag is never stored, the abandon word takes done_value, and the daemon
 * closes the session after the step's error. The client then zeroes the
 * outputs itself and stores the flag: as it must also do, before storing
 * it, where the daemon went away without storing it (its process gone: no
 * work of its can write them any more). A whole step outside norm groups.
 * NULL: none. Kept by dpclip_step_reset. */
int dpclip_step_set_done_flag(dpclip_step *s, const dpclip_tensor *flag);
/* A logical step in phases, for sharded models whose clipped sums are wanted
 * one layer group at a time (docs/protocol.md, "Steps in phases"): one
 * DPCLIP_STEP_NORMS step names every layer and writes nothing (its norms and
 * coefficients come in the result, and the session keeps them), then
 * DPCLIP_STEP_SUMS steps each name some of those layers again, with the same
 * tensors and their outputs, and get their clipped sums, noised at the
 * pass's noise multiplier on the ranges dpclip_step_set_noise_range names.
 * Flat clipping only. Kept by dpclip_step_reset. */
typedef enum dpclip_phase {
    DPCLIP_STEP_WHOLE = 0,
    DPCLIP_STEP_NORMS = 1,
    DPCLIP_STEP_SUMS = 2
} dpclip_phase;
int dpclip_step_set_phase(dpclip_step *s, dpclip_phase phase);
/* A DPCLIP_STEP_SUMS step with noise (its config's noise_multiplier, which
 * must be its norm pass's): the part of layer `layer`'s output (`output` 0:
 * weight_grad_out, 1: bias_grad_out) that gets the noise, the rows this
 * rank owns: [begin, end) along `dim` (0: rows; 1: columns of a 2-D output,
 * for a weight kept transposed). Every output of a sums step with noise
 * needs one; outside data parallelism it is the whole output. Each element
 * in it gets the draw a whole step would add to it, the others none. The
 * daemon checks it against the output (docs/protocol.md, "Steps in
 * phases"). Dropped with the layers by dpclip_step_reset. DPCLIP_EARG for a
 * layer not added, an output other than 0 or 1, dim > 1 or begin > end. */
int dpclip_step_set_noise_range(dpclip_step *s, size_t layer, int output, uint32_t dim,
                                uint64_t begin, uint64_t end);

/* Data parallelism (docs/protocol.md, "Data parallelism"): W ranks with
 * their own samples each send one step per logical step, and the trainers
 * sum the clipped sums (all-reduce). Each rank's step is its member of the
 * job's logical step: `world` W (2..4096, fixed per job), `rank` in
 * [0, W), `noise_multiplier` the job's sigma (> 0, fixed per job), at
 * which the ledger charges each logical step once, to whichever member
 * comes first; the others are covered. The members that add the noise
 * (rank 0, usually) set the step's own noise multiplier
 * (dpclip_clip_config) to at least that sigma, the others to 0; at most W - 1
 * members of a logical step may be noiseless. `step`: the logical step, the
 * same on every rank; 0 = this rank's next (the daemon counts each rank's,
 * across sessions and restarts). world 0 turns it off. Kept by
 * dpclip_step_reset. DPCLIP_EARG for a value out of those ranges. */
int dpclip_step_set_data_parallel(dpclip_step *s, uint32_t world, uint32_t rank,
                                  float noise_multiplier, uint64_t step);

/* Gradient accumulation (docs/protocol.md, "Logical steps"): the step is
 * micro-batch `micro_batch` (0, 1, ... in order) of logical step `id` (> 0,
 * increasing per connection; micro-batch 0 opens it). Each micro-batch's
 * clipped sum is added into the daemon's accumulators and nothing is
 * written to the outputs; the micro-batch with `commit` adds the noise once,
 * divides by the config's expected_batch_size (the expected LOGICAL batch
 * for MEAN), writes every output and is charged once, at the config's
 * sample_rate (the logical batch's). Every micro-batch carries the same
 * config and outputs. id 0 turns it off. Kept by dpclip_step_reset.
 * DPCLIP_EARG for a micro-batch or commit without an id. */
int dpclip_step_set_logical(dpclip_step *s, uint64_t id, uint32_t micro_batch, int commit);

typedef struct dpclip_result {
    uint32_t batch;
    uint32_t n_layers;
    float *norms;       /* [batch] */
    float *coefs;       /* [batch] */
    float *layer_norms; /* [n_layers*batch] or NULL */
    float *layer_coefs; /* [n_layers*batch] (PER_LAYER) or NULL */
    uint64_t step_index;
    uint64_t compute_ns;
    double epsilon;         /* the job's epsilon after this step (inf without noise) */
    double delta;           /* ... at this delta */
    uint64_t input_wait_ns; /* of compute_ns: the GPU waiting for the step's wait_event
                               (the client's own work still running) */
    /* A micro-batch of a logical step (dpclip_step_set_logical): its id and
     * the micro-batches accumulated so far, this one included; 0 else. */
    uint64_t logical_id;
    uint32_t micro_batches;
} dpclip_result;
void dpclip_result_free(dpclip_result *r);

/* Blocking: send the step, wait for its reply. */
int dpclip_run(dpclip_client *c, const dpclip_step *s, dpclip_result *res);

/* Where the last successful dpclip_run's time went, for latency diagnosis:
 * CLOCK_MONOTONIC stamps (ns) taken here (call start, request sent, reply
 * read) and by the daemon (request taken up, reply sent: the same clock
 * when the daemon runs on this machine), and the daemon's compute time.
 * DPCLIP_EPRECOND before any such step. */
typedef struct dpclip_timing {
    uint64_t start_ns, sent_ns, daemon_received_ns, daemon_replied_ns, received_ns;
    uint64_t compute_ns;
    /* Norm groups: this member's wait for the group's totals, and the part
     * of it spent exchanging with other daemons (NCCL); 0 outside groups. */
    uint64_t group_wait_ns, group_exchange_ns;
    uint64_t input_wait_ns; /* of compute_ns: waiting for the client's wait_event */
} dpclip_timing;
int dpclip_last_timing(dpclip_client *c, dpclip_timing *t);

/* Non-blocking: send now, collect later. Replies come in submission order. */
typedef void (*dpclip_step_cb)(void *user, int status, const char *errmsg,
                               const dpclip_result *res);
int dpclip_submit(dpclip_client *c, const dpclip_step *s, uint64_t *ticket);
int dpclip_submit_cb(dpclip_client *c, const dpclip_step *s, dpclip_step_cb cb, void *user);
/* Wait up to timeout_ms (-1 forever, 0 poll) for `ticket`. DPCLIP_EAGAIN if
 * not done yet; otherwise the step's status, with *res filled on success. */
int dpclip_wait(dpclip_client *c, uint64_t ticket, int timeout_ms, dpclip_result *res);
/* For a ticket whose step asked for an early notice: wait up to timeout_ms
 * until the daemon has queued the step's GPU work and recorded its
 * signal_event (or the step finished). 0 then, with *info filled, and the
 * ticket is still to be collected with dpclip_wait. DPCLIP_EAGAIN on
 * timeout. If the step failed before any GPU work was queued, its error is
 * returned and the ticket is collected (no dpclip_wait). A step that fails
 * after its notice writes zeros to its outputs (the trainer may already
 * consume them) and its dpclip_wait returns the error. */
typedef struct dpclip_enqueued {
    uint64_t step_index; /* the index the step gets if it succeeds */
    double epsilon;      /* the job's epsilon with this step counted */
    double delta;
    uint32_t done_value; /* with dpclip_step_set_done_flag: what the flag will hold */
} dpclip_enqueued;
int dpclip_wait_enqueued(dpclip_client *c, uint64_t ticket, int timeout_ms, dpclip_enqueued *info);
/* Process replies that have arrived (run callbacks) for up to timeout_ms;
 * returns the number of completions handled, or -code on error. */
int dpclip_poll(dpclip_client *c, int timeout_ms);
/* The socket fd, to put in the caller's own poll set. */
int dpclip_fd(const dpclip_client *c);

int dpclip_ping(dpclip_client *c);

/* --- norm groups ------------------------------------------------------------
 * The sessions that together hold one model replica (tensor or pipeline
 * parallel ranks, one session each, same user) form a norm group: with flat
 * clipping the daemon sums each sample's squared norm over every member's
 * layers before it clips, so the split model is clipped exactly as the whole
 * one. After joining, each member sends one step per logical step (the
 * daemon matches them by count); a step waits for the other members up to
 * the group's timeout. Layers every member holds whole (LayerNorm weights
 * under tensor parallelism) are marked with dpclip_step_set_replicated, in
 * the same order on every member: counted once, noised identically. The
 * privacy ledger charges rank 0's job once per group step. A member that
 * disconnects or times out dissolves the group: the steps waiting fail on
 * every member, naming it, and each member must join again. */
typedef struct dpclip_group_opts {
    const char *name; /* the same on every member */
    uint32_t rank;    /* this member, in [0, size) */
    uint32_t size;
    uint32_t timeout_ms; /* 0 = the daemon's groups.timeout_ms */
    int group_wise;      /* 1: each member clips to C / sqrt(size) alone, no reduction */
} dpclip_group_opts;
int dpclip_join_group(dpclip_client *c, const dpclip_group_opts *opts, uint64_t *group_id);

/* A group whose members use several daemons (several nodes, or several
 * daemons on one node): each daemon sums its own members' norms, then the
 * daemons exchange their sums through NCCL, one communicator per group
 * with one rank per daemon. The trainers set the layout and relay the NCCL
 * id: rank 0 joins first with nccl_version 0, and its daemon (daemon 0)
 * fills nccl_id and nccl_version; the trainers pass those bytes to every
 * other member (over their own rendezvous: a broadcast, a file, ...), which
 * join with them. Every daemon needs NCCL and a GPU; daemons whose NCCL
 * versions differ are refused. */
#define DPCLIP_NCCL_ID_BYTES 128
typedef struct dpclip_group_link {
    uint32_t daemons;      /* daemons the group spans, >= 2 */
    uint32_t daemon_rank;  /* this member's daemon: 0 = rank 0's, then in any agreed order */
    uint32_t local_size;   /* members that use this member's daemon */
    uint32_t nccl_version; /* in: daemon 0's (0 on rank 0); out: the group's */
    uint8_t nccl_id[DPCLIP_NCCL_ID_BYTES]; /* in: daemon 0's; out on rank 0 */
} dpclip_group_link;
int dpclip_join_group_linked(dpclip_client *c, const dpclip_group_opts *opts,
                             dpclip_group_link *link, uint64_t *group_id);
/* Marks layer `layer` (its index in the step) as held whole by every member. */
int dpclip_step_set_replicated(dpclip_step *s, size_t layer, int yes);

/* --- tied parameters ---------------------------------------------------------
 * Marks layer `layer`'s weight as the same parameter as the weight of the
 * earlier layer `owner` (owner < layer): an embedding and a linear layer of
 * one weight shape, such as a language model's input embedding and output
 * projection. The daemon then computes each sample's norm of the sum of both
 * uses (cross term included) and writes the clipped, noised sum of both into
 * the owner's weight_grad_out; `layer` must have no weight_grad_out. FLAT
 * clipping only. DPCLIP_EARG unless owner < layer < the layers added. */
int dpclip_step_set_tied(dpclip_step *s, size_t layer, size_t owner);

/* --- the same step again -------------------------------------------------
 * A trainer's steps usually repeat one layout: the same layers, shapes and
 * outputs, with only the activations and output gradients in new memory.
 * Instead of dpclip_step_reset and adding every layer again, a step can keep
 * its layers and have their two inputs (activations, indices or input; and
 * output_grad) pointed at new memory: one call for the whole step.
 *
 * dpclip_step_rebind: refs holds 4 * n values, layer i's new
 * (buffer, offset) of its first input, then of its output_grad; n must be
 * the step's number of layers. Shapes, dtypes, outputs and every setting
 * are kept. DPCLIP_EARG (the step unchanged) for a wrong n or a buffer 0.
 *
 * dpclip_step_rebind_cuda: the same from 2 * n device pointers, each
 * registered as dpclip_buffer_register_cuda does (cached per allocation:
 * a tensor in an allocation already registered costs no round trip). On an
 * error the step is unchanged and the handle's message names the layer. */
int dpclip_step_rebind(dpclip_step *s, size_t n, const uint64_t *refs);
int dpclip_step_rebind_cuda(dpclip_client *c, dpclip_step *s, size_t n, const uint64_t *ptrs);
/* dpclip_step_rebind_outputs: the layers' outputs at new memory (a trainer
 * whose gradients are new tensors every step): refs holds 4 * n values,
 * layer i's new (buffer, offset) of its weight_grad_out, then of its
 * bias_grad_out; a layer's output that the step does not name takes
 * buffer 0 there, one it names a buffer other than 0. DPCLIP_EARG (the
 * step unchanged) for a wrong n or a mismatch. */
int dpclip_step_rebind_outputs(dpclip_step *s, size_t n, const uint64_t *refs);

/* --- ABI ----------------------------------------------------------------- */

/* "MAJOR.MINOR.PATCH" of this library (DPCLIP_VERSION_* as it was built). */
const char *dpclip_version(void);
/* sizeof the public struct named `name` ("dpclip_tensor", "dpclip_result",
 * ...) as this library was built; 0 for a name it does not know. For
 * bindings that mirror this header without compiling it. */
size_t dpclip_sizeof(const char *name);

#ifdef __cplusplus
}
#endif
#endif
