/* The GPU requests of a session: registering CUDA IPC buffers and
 * interprocess events. Both open handles on the GPU's worker thread (never on
 * the loop), so the session waits for the open to finish before its next
 * request, exactly as it waits for a step. */
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "server.h"
#include "session_int.h"

/* Room for one more event; on failure the table is unchanged. */
static int grow_events(dc_session *s) {
    size_t n = s->cap_events ? s->cap_events * 2 : 8;
    struct dc_session_event *p;
    if (s->n_events < s->cap_events) return 0;
    if (s->cap_events >= 4096) return -1;
    p = realloc(s->events, n * sizeof *p);
    if (!p) return -1;
    s->events = p;
    s->cap_events = n;
    return 0;
}

static void register_cuda_done(dc_gpu_open_job *j) {
    dc_session *s = j->user;
    dc_err e;
    s->async_ops--;
    if (j->rc == 0) {
        j->buf.id = ++s->srv->next_buffer_id;
        if (s->gone || dc_registry_add(&s->reg, &j->buf, &e) != 0) {
            /* No registry holds it: hand the handle back. */
            dc_gpu_close_buffer(&s->srv->gpu, &j->buf);
            if (!s->gone) dc_session_reject(s, j->req_id, &e);
        } else {
            Dpclip__Reply reply = DPCLIP__REPLY__INIT;
            Dpclip__RegisterBufferReply rr = DPCLIP__REGISTER_BUFFER_REPLY__INIT;
            rr.buffer_id = j->buf.id;
            rr.size = j->buf.size;
            reply.id = j->req_id;
            reply.body_case = DPCLIP__REPLY__BODY_REGISTER_BUFFER;
            reply.register_buffer = &rr;
            dc_session_send(s, &reply);
        }
    } else if (!s->gone) {
        dc_session_reject(s, j->req_id, &j->err);
    }
    free(j);
    if (s->gone) dc_session_destroy(s);
    else dc_session_process(s);
}

void dc_session_register_cuda(dc_session *s, uint64_t id, const Dpclip__RegisterBuffer *m) {
    dc_gpu_open_job *j;
    dc_err e;
    if (s->srv->gpu.n == 0) {
        dc_err_set(&e, DC_EPRECOND, "register_buffer.kind",
                   "this daemon has no GPU backend; CUDA buffers cannot be registered");
        goto fail;
    }
    if (m->device < 0 || m->device >= s->srv->gpu.n) {
        dc_err_set(&e, DC_EINVAL, "register_buffer.device", "device %d outside [0, %d)",
                   (int)m->device, s->srv->gpu.n);
        goto fail;
    }
    if (m->cuda_ipc_handle.len != 64) {
        dc_err_set(&e, DC_EINVAL, "register_buffer.cuda_ipc_handle",
                   "a CUDA IPC handle is 64 bytes, got %zu", m->cuda_ipc_handle.len);
        goto fail;
    }
    j = calloc(1, sizeof *j);
    if (!j) {
        dc_err_set(&e, DC_ENOSPACE, "register_buffer", "out of memory");
        goto fail;
    }
    j->device = m->device;
    memcpy(j->handle, m->cuda_ipc_handle.data, 64);
    j->size = m->size;
    j->user = s;
    j->req_id = id;
    j->done = register_cuda_done;
    s->async_ops++;
    dc_gpu_open_buffer(&s->srv->gpu, j);
    return;
fail:
    dc_session_reject(s, id, &e);
}

static void register_event_done(dc_gpu_event_job *j) {
    dc_session *s = j->user;
    dc_err e;
    s->async_ops--;
    if (j->rc != 0) {
        if (!s->gone) dc_session_reject(s, j->req_id, &j->err);
    } else if (s->gone) {
        dc_gpu_close_event(&s->srv->gpu, j->device, j->event);
    } else if (grow_events(s) != 0) {
        dc_gpu_close_event(&s->srv->gpu, j->device, j->event);
        dc_err_set(&e, DC_ENOSPACE, "register_event", "too many events in this session");
        dc_session_reject(s, j->req_id, &e);
    } else {
        Dpclip__Reply reply = DPCLIP__REPLY__INIT;
        Dpclip__RegisterEventReply rr = DPCLIP__REGISTER_EVENT_REPLY__INIT;
        struct dc_session_event *ev = &s->events[s->n_events++];
        ev->id = ++s->srv->next_buffer_id;
        ev->device = j->device;
        ev->event = j->event;
        rr.event_id = ev->id;
        reply.id = j->req_id;
        reply.body_case = DPCLIP__REPLY__BODY_REGISTER_EVENT;
        reply.register_event = &rr;
        dc_session_send(s, &reply);
    }
    free(j);
    if (s->gone) dc_session_destroy(s);
    else dc_session_process(s);
}

void dc_session_register_event(dc_session *s, uint64_t id, const Dpclip__RegisterEvent *m) {
    dc_gpu_event_job *j;
    dc_err e;
    if (s->srv->gpu.n == 0) {
        dc_err_set(&e, DC_EPRECOND, "register_event",
                   "this daemon has no GPU backend; CUDA events cannot be registered");
        goto fail;
    }
    if (m->device < 0 || m->device >= s->srv->gpu.n) {
        dc_err_set(&e, DC_EINVAL, "register_event.device", "device %d outside [0, %d)",
                   (int)m->device, s->srv->gpu.n);
        goto fail;
    }
    if (m->cuda_ipc_event_handle.len != 64) {
        dc_err_set(&e, DC_EINVAL, "register_event.cuda_ipc_event_handle",
                   "a CUDA IPC event handle is 64 bytes, got %zu", m->cuda_ipc_event_handle.len);
        goto fail;
    }
    j = calloc(1, sizeof *j);
    if (!j) {
        dc_err_set(&e, DC_ENOSPACE, "register_event", "out of memory");
        goto fail;
    }
    j->device = m->device;
    memcpy(j->handle, m->cuda_ipc_event_handle.data, 64);
    j->user = s;
    j->req_id = id;
    j->done = register_event_done;
    s->async_ops++;
    dc_gpu_open_event(&s->srv->gpu, j);
    return;
fail:
    dc_session_reject(s, id, &e);
}

const struct dc_session_event *dc_session_find_event(const dc_session *s, uint64_t id) {
    for (size_t i = 0; i < s->n_events; i++)
        if (s->events[i].id == id) return &s->events[i];
    return NULL;
}

