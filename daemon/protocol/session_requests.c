/* A session's requests (session.h): the handshake, buffer registration
 * and release handled here, and every other request handed to its stage:
 * ClipStep to session_step.c, JoinGroup to session_group.c, CUDA buffers
 * and events to session_gpu.c. The connection under them (session_io.c)
 * reaches these handlers only through the dispatch function it is opened
 * with, so that dependencies run one way: handlers call the connection,
 * never the reverse. */
#include "session.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dpclip.pb-c.h"
#include "host.h"
#include "log.h"
#include "peek.h"
#include "session_int.h"

static bool id_listed(const uint32_t *ids, size_t n, uint32_t id) {
    for (size_t i = 0; i < n; i++)
        if (ids[i] == id) return true;
    return false;
}

/* [access]: with no lists, whoever can open the socket (its mode and group
 * decide); else the peer's uid, primary group or a supplementary group
 * (SO_PEERGROUPS) must be listed. */
static bool peer_allowed(const dc_session *s) {
    const dc_host_cfg *c = &s->host->cfg;
    if (!c->n_allowed_uids && !c->n_allowed_gids) return true;
    if (id_listed(c->allowed_uids, c->n_allowed_uids, (uint32_t)s->peer_uid)) return true;
    if (id_listed(c->allowed_gids, c->n_allowed_gids, (uint32_t)s->peer_gid)) return true;
#ifdef SO_PEERGROUPS
    {
        gid_t groups[256];
        socklen_t len = sizeof groups;
        if (getsockopt(s->fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0)
            for (size_t i = 0; i < len / sizeof groups[0]; i++)
                if (id_listed(c->allowed_gids, c->n_allowed_gids, (uint32_t)groups[i])) return true;
    }
#endif
    return false;
}

static void handle_hello(dc_session *s, uint64_t id, const Dpclip__Hello *h) {
    dc_host *host = s->host;
    Dpclip__Reply reply = DPCLIP__REPLY__INIT;
    Dpclip__HelloReply hr = DPCLIP__HELLO_REPLY__INIT;
    Dpclip__Device devs[9];
    Dpclip__Device *devp[9];
    char *backends[] = {"cpu", "cuda"};
    char *kinds[] = {"linear", "embedding", "layer_norm", "rms_norm"};
    char cpu_name[64];
    size_t nd = 0;
    dc_err e;

    if (s->hello_done) {
        dc_err_set(&e, DC_EPRECOND, "hello", "handshake already done");
        dc_session_reject(s, id, &e);
        return;
    }
    if (h->protocol_version != DC_PROTOCOL_VERSION) {
        dc_err_set(&e, DC_EPRECOND, "hello.protocol_version",
                   "protocol version %u is not supported; this daemon speaks %u",
                   h->protocol_version, DC_PROTOCOL_VERSION);
        dc_session_reject(s, id, &e);
        s->closing = true;
        return;
    }
    if (!peer_allowed(s)) {
        host->metrics->sessions_refused++;
        dc_err_set(&e, DC_EPERM, "hello",
                   "uid %u (gid %u) may not use this daemon: see "
                   "[access] in its configuration",
                   (unsigned)s->peer_uid, (unsigned)s->peer_gid);
        dc_log_warn("session %llu: pid %d uid %u refused by [access]", (unsigned long long)s->id,
                    (int)s->peer_pid, (unsigned)s->peer_uid);
        dc_session_reject(s, id, &e);
        s->closing = true;
        return;
    }
    /* The privacy ledger's account: this uid's of that job id, whole (an id
     * too long to keep is refused, never truncated into another account's),
     * within ledger.max_jobs_per_uid. */
    if (dc_ledger_account_open(host->ledger, (uint32_t)s->peer_uid, h->job_id ? h->job_id : "",
                               &s->account, &e)) {
        dc_session_reject(s, id, &e);
        return;
    }
    s->account->sessions++;
    snprintf(s->client_name, sizeof s->client_name, "%s", h->client_name ? h->client_name : "");
    snprintf(s->job_id, sizeof s->job_id, "%s", h->job_id ? h->job_id : "");
    s->hello_done = true;
    dc_session_limits_changed(s); /* from the handshake's deadline to the idle one */
    dc_log_info("session %llu: hello from pid %d uid %u client '%s' job '%s'",
                (unsigned long long)s->id, (int)s->peer_pid, (unsigned)s->peer_uid, s->client_name,
                s->job_id);

    snprintf(cpu_name, sizeof cpu_name, "cpu (%d workers)", host->workers);
    dpclip__device__init(&devs[nd]);
    devs[nd].backend = "cpu";
    devs[nd].name = cpu_name;
    devp[nd] = &devs[nd];
    nd++;
    for (int i = 0; i < host->gpu->n && nd < 9; i++, nd++) {
        dpclip__device__init(&devs[nd]);
        devs[nd].backend = "cuda";
        devs[nd].index = i;
        devs[nd].name = host->gpu->names[i];
        devp[nd] = &devs[nd];
    }
    hr.protocol_version = DC_PROTOCOL_VERSION;
    hr.daemon_version = DPCLIP_VERSION;
    hr.n_backends = host->gpu->n ? 2 : 1;
    hr.backends = backends;
    hr.n_devices = nd;
    hr.devices = devp;
    hr.n_layer_kinds = 4;
    hr.layer_kinds = kinds;
    hr.max_batch = host->limits->max_batch;
    hr.max_frame = host->limits->max_frame;
    hr.max_layers = host->limits->max_layers;
    hr.session_id = s->id;
    hr.mps_active = host->gpu->mps_active;
    reply.id = id;
    reply.body_case = DPCLIP__REPLY__BODY_HELLO;
    reply.hello = &hr;
    dc_session_send(s, &reply);
}

static void handle_register(dc_session *s, uint64_t id, const Dpclip__RegisterBuffer *m,
                            const int *fds, int nfds) {
    Dpclip__Reply reply = DPCLIP__REPLY__INIT;
    Dpclip__RegisterBufferReply rr = DPCLIP__REGISTER_BUFFER_REPLY__INIT;
    const dc_buffer *b = NULL;
    dc_uid_usage u;
    dc_err e;

    if (s->reg.n >= s->host->cfg.max_buffers) {
        dc_err_set(&e, DC_ENOSPACE, "limits.max_buffers",
                   "this session already has %u buffers, the limit per session "
                   "(limits.max_buffers)",
                   s->host->cfg.max_buffers);
        goto fail;
    }
    dc_host_uid_usage(s->host, (uint32_t)s->peer_uid, &u, NULL);
    if (u.buffers >= s->host->cfg.max_buffers_per_uid) {
        dc_err_set(&e, DC_ENOSPACE, "limits.max_buffers_per_uid",
                   "uid %u's sessions hold %llu buffers, its limit (limits.max_buffers_per_uid)",
                   (unsigned)s->peer_uid, (unsigned long long)u.buffers);
        goto fail;
    }
    /* Checked here too (the registry checks again when it adds) so that a
     * CUDA handle is not opened only to be refused. */
    if (s->host->buf_totals->buffers >= s->host->buf_totals->max_buffers) {
        dc_err_set(&e, DC_ENOSPACE, "limits.max_buffers_total",
                   "the daemon holds %llu buffers for all its sessions, its limit "
                   "(limits.max_buffers_total)",
                   (unsigned long long)s->host->buf_totals->buffers);
        goto fail;
    }
    if (m->kind == DPCLIP__BUFFER_KIND__CUDA_IPC) {
        dc_session_register_cuda(s, id, m);
        return;
    }
    if (m->kind != DPCLIP__BUFFER_KIND__SHM_FD) {
        dc_err_set(&e, DC_EINVAL, "register_buffer.kind", "unknown buffer kind %d", (int)m->kind);
        goto fail;
    }
    if (nfds != 1) {
        dc_err_set(&e, DC_EINVAL, "register_buffer",
                   "a SHM_FD registration needs exactly one file descriptor attached; got %d",
                   nfds);
        goto fail;
    }
    if (dc_registry_add_shm(&s->reg, ++*s->host->next_buffer_id, fds[0], m->size, &b, &e))
        goto fail;
    /* Its size is known once mapped (0 asks for the whole object). */
    if (s->host->cfg.max_mapped_bytes_per_uid &&
        u.shm_bytes + b->size > s->host->cfg.max_mapped_bytes_per_uid) {
        uint64_t size = b->size, bid = b->id;
        dc_registry_release(&s->reg, bid, &e);
        dc_err_set(&e, DC_ENOSPACE, "limits.max_mapped_bytes_per_uid",
                   "mapping %llu more bytes would take uid %u's sessions past %llu bytes of "
                   "shared memory (limits.max_mapped_bytes_per_uid; %llu mapped now)",
                   (unsigned long long)size, (unsigned)s->peer_uid,
                   (unsigned long long)s->host->cfg.max_mapped_bytes_per_uid,
                   (unsigned long long)u.shm_bytes);
        goto fail;
    }
    rr.buffer_id = b->id;
    rr.size = b->size;
    reply.id = id;
    reply.body_case = DPCLIP__REPLY__BODY_REGISTER_BUFFER;
    reply.register_buffer = &rr;
    dc_log_debug("session %llu: buffer %llu registered (%llu bytes)", (unsigned long long)s->id,
                 (unsigned long long)b->id, (unsigned long long)b->size);
    dc_session_send(s, &reply);
    return;
fail:
    dc_session_reject(s, id, &e);
}

static void handle_release(dc_session *s, uint64_t id, const Dpclip__ReleaseBuffer *m) {
    Dpclip__Reply reply = DPCLIP__REPLY__INIT;
    Dpclip__ReleaseBufferReply rr = DPCLIP__RELEASE_BUFFER_REPLY__INIT;
    dc_err e;
    if (dc_registry_release(&s->reg, m->buffer_id, &e)) {
        dc_session_reject(s, id, &e);
        return;
    }
    rr.buffer_id = m->buffer_id;
    reply.id = id;
    reply.body_case = DPCLIP__REPLY__BODY_RELEASE_BUFFER;
    reply.release_buffer = &rr;
    dc_session_send(s, &reply);
}

/* One frame, answered (or handed to the work that will answer it). */
static void dispatch(dc_session *s, const dc_frame *f) {
    Dpclip__Request *req;
    Dpclip__Reply reply = DPCLIP__REPLY__INIT;
    Dpclip__Pong pong = DPCLIP__PONG__INIT;
    const uint8_t *key = NULL;
    size_t key_len = 0, k;
    uint64_t id;
    dc_err e;

    s->t_frame = uv_hrtime();
    /* A ClipStep with the bytes of the last step that validated needs no
     * decoding (session_step.c); peek.h says which frames may be taken so. */
    if (s->hello_done && f->nfds == 0 && dc_peek_step_key(f->payload, f->len, &id, &k)) {
        key = f->payload + k;
        key_len = f->len - k;
        s->step_req_id = id;
        dc_session_prewait(s);
        if (dc_session_step_cached(s, id, key, key_len)) {
            s->host->metrics->requests[DC_REQ_STEP]++;
            return;
        }
    }
    req = dc_frame_decode(f, &e);
    s->host->metrics->requests[dc_frame_kind(req)]++;
    if (!req) {
        dc_session_reject(s, 0, &e);
        return;
    }
    if (req->body_case == DPCLIP__REQUEST__BODY__NOT_SET) {
        dc_err_set(&e, DC_EUNIMPL, "request.body", "unknown or empty request");
        dc_session_reject(s, req->id, &e);
        goto out;
    }
    if (!s->hello_done && req->body_case != DPCLIP__REQUEST__BODY_HELLO) {
        dc_err_set(&e, DC_EPRECOND, "request", "handshake required: send Hello first");
        dc_session_reject(s, req->id, &e);
        goto out;
    }
    switch (req->body_case) {
    case DPCLIP__REQUEST__BODY_HELLO: handle_hello(s, req->id, req->hello); break;
    case DPCLIP__REQUEST__BODY_REGISTER_BUFFER:
        handle_register(s, req->id, req->register_buffer, f->fds, f->nfds);
        break;
    case DPCLIP__REQUEST__BODY_RELEASE_BUFFER:
        handle_release(s, req->id, req->release_buffer);
        break;
    case DPCLIP__REQUEST__BODY_CLIP_STEP:
        s->step_req_id = req->id;
        dc_session_step(s, req->id, req->clip_step, key, key_len);
        break;
    case DPCLIP__REQUEST__BODY_REGISTER_EVENT:
        dc_session_register_event(s, req->id, req->register_event);
        break;
    case DPCLIP__REQUEST__BODY_JOIN_GROUP:
        dc_session_join_group(s, req->id, req->join_group);
        break;
    case DPCLIP__REQUEST__BODY_PING:
        pong.nonce = req->ping->nonce;
        reply.id = req->id;
        reply.body_case = DPCLIP__REPLY__BODY_PONG;
        reply.pong = &pong;
        dc_session_send(s, &reply);
        break;
    default:
        dc_err_set(&e, DC_EUNIMPL, "request.body", "unknown request %d", (int)req->body_case);
        dc_session_reject(s, req->id, &e);
        break;
    }
out:
    dpclip__request__free_unpacked(req, NULL);
}

int dc_session_start(dc_host *host, int fd, dc_session **out) {
    return dc_session_open(host, fd, dispatch, out);
}
