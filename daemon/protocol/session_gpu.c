/* The GPU requests of a session: registering CUDA IPC buffers and
 * interprocess events. Both open handles on the GPU's worker thread (never on
 * the loop), so the session waits for the open to finish before its next
 * request, exactly as it waits for a step. */
#include <stdlib.h>
#include <string.h>

#include "host.h"
#include "log.h"
#include "session_int.h"

/* Whether the session may hold one more event (limits.max_events, read
 * where it is used: the setting is reloadable); fills e if not. */
static int events_room(const dc_session *s, dc_err *e) {
    const uint32_t max = s->host->cfg.max_events;
    if (s->n_events < max) return 0;
    return dc_err_set(e, DC_ENOSPACE, "limits.max_events",
                      "this session holds %zu events, the most it may (limits.max_events)",
                      s->n_events);
}

/* Room for one more event in the table; on failure it is unchanged. */
static int grow_events(dc_session *s) {
    size_t n = s->cap_events ? s->cap_events * 2 : 8;
    struct dc_session_event *p;
    if (s->n_events < s->cap_events) return 0;
    p = realloc(s->events, n * sizeof *p);
    if (!p) return -1;
    s->events = p;
    s->cap_events = n;
    return 0;
}

/* What a CUDA IPC registration's errors name: a buffer's or an event's. */
typedef struct ipc_names {
    const char *gpu_field, *kind, *device_field, *uuid_field, *handle_field, *handle;
} ipc_names;
static const ipc_names k_buffer_names = {"register_buffer.kind",
                                         "buffers",
                                         "register_buffer.device",
                                         "register_buffer.device_uuid",
                                         "register_buffer.cuda_ipc_handle",
                                         "handle"};
static const ipc_names k_event_names = {"register_event",
                                        "events",
                                        "register_event.device",
                                        "register_event.device_uuid",
                                        "register_event.cuda_ipc_event_handle",
                                        "event handle"};

/* The daemon's device for a registration: the one of the client's UUID, or
 * (a client that sent none) its ordinal taken as the daemon's. A UUID this
 * daemon does not serve is refused rather than opened through peer access
 * on another GPU, which would run every step across NVLink. */
static int ipc_device(const dc_session *s, int32_t device, const ProtobufCBinaryData *uuid,
                      const ipc_names *nm, int *out, dc_err *e) {
    const dc_gpu *g = s->host->gpu;
    char want[DC_GPU_UUID_STR], have[DC_MAX_GPUS * DC_GPU_UUID_STR + 2 * DC_MAX_GPUS];
    size_t used = 0;
    if (uuid->len == 0) {
        if (device < 0 || device >= g->n)
            return dc_err_set(e, DC_EINVAL, nm->device_field, "device %d outside [0, %d)",
                              (int)device, g->n);
        *out = device;
        return 0;
    }
    if (uuid->len != DC_GPU_UUID_LEN)
        return dc_err_set(e, DC_EINVAL, nm->uuid_field, "a GPU UUID is %d bytes, got %zu",
                          DC_GPU_UUID_LEN, uuid->len);
    if ((*out = dc_gpu_find_uuid(g, uuid->data)) >= 0) return 0;
    have[0] = 0;
    for (int i = 0; i < g->n; i++) {
        char one[DC_GPU_UUID_STR];
        if (!g->has_uuid[i]) continue;
        dc_gpu_uuid_str(g->uuids[i], one);
        used += (size_t)snprintf(have + used, sizeof have - used, "%s%s", used ? ", " : "", one);
    }
    dc_gpu_uuid_str(uuid->data, want);
    return dc_err_set(e, DC_ENOTFOUND, nm->uuid_field,
                      "%s (the client's device %d) is not a GPU this daemon serves (%s); its "
                      "CUDA_VISIBLE_DEVICES must include the trainer's GPU",
                      want, (int)device, have[0] ? have : "none");
}

/* The checks both registrations make before the open: a GPU backend, a
 * device it serves, a 64-byte handle. */
static int ipc_request_ok(const dc_session *s, int32_t device, const ProtobufCBinaryData *uuid,
                          size_t handle_len, const ipc_names *nm, int *dev, dc_err *e) {
    int rc;
    if (s->host->gpu->n == 0)
        return dc_err_set(e, DC_EPRECOND, nm->gpu_field,
                          "this daemon has no GPU backend; CUDA %s cannot be registered", nm->kind);
    if ((rc = ipc_device(s, device, uuid, nm, dev, e))) return rc;
    if (handle_len != 64)
        return dc_err_set(e, DC_EINVAL, nm->handle_field, "a CUDA IPC %s is 64 bytes, got %zu",
                          nm->handle, handle_len);
    return 0;
}

static void register_cuda_done(dc_gpu_open_task *t) {
    dc_session *s = t->user;
    dc_err e;
    s->async_ops--;
    if (t->rc == 0) {
        t->buf.id = ++*s->host->next_buffer_id;
        if (s->gone || dc_registry_add(&s->reg, &t->buf, &e) != 0) {
            /* No registry holds it: hand the handle back. */
            dc_gpu_close_buffer(s->host->gpu, &t->buf);
            if (!s->gone) dc_session_reject(s, t->req_id, &e);
        } else {
            Dpclip__Reply reply = DPCLIP__REPLY__INIT;
            Dpclip__RegisterBufferReply rr = DPCLIP__REGISTER_BUFFER_REPLY__INIT;
            rr.buffer_id = t->buf.id;
            rr.size = t->buf.size;
            reply.id = t->req_id;
            reply.body_case = DPCLIP__REPLY__BODY_REGISTER_BUFFER;
            reply.register_buffer = &rr;
            dc_session_send(s, &reply);
        }
    } else if (!s->gone) {
        dc_session_reject(s, t->req_id, &t->err);
    }
    free(t);
    if (s->gone) dc_session_destroy(s);
    else dc_session_process(s);
}

void dc_session_register_cuda(dc_session *s, uint64_t id, const Dpclip__RegisterBuffer *m) {
    dc_gpu_open_task *t;
    dc_err e;
    int dev;
    if (ipc_request_ok(s, m->device, &m->device_uuid, m->cuda_ipc_handle.len, &k_buffer_names, &dev,
                       &e))
        goto fail;
    t = calloc(1, sizeof *t);
    if (!t) {
        dc_err_set(&e, DC_ENOSPACE, "register_buffer", "out of memory");
        goto fail;
    }
    t->device = dev;
    memcpy(t->handle, m->cuda_ipc_handle.data, 64);
    t->size = m->size;
    t->user = s;
    t->req_id = id;
    t->done = register_cuda_done;
    s->async_ops++;
    dc_gpu_open_buffer(s->host->gpu, t);
    return;
fail:
    dc_session_reject(s, id, &e);
}

static void register_event_done(dc_gpu_event_task *t) {
    dc_session *s = t->user;
    dc_err e;
    s->async_ops--;
    if (t->rc != 0) {
        if (!s->gone) dc_session_reject(s, t->req_id, &t->err);
    } else if (s->gone) {
        dc_gpu_close_event(s->host->gpu, t->device, t->event);
    } else if (events_room(s, &e) != 0) { /* the setting may have shrunk meanwhile */
        dc_gpu_close_event(s->host->gpu, t->device, t->event);
        dc_session_reject(s, t->req_id, &e);
    } else if (grow_events(s) != 0) {
        dc_gpu_close_event(s->host->gpu, t->device, t->event);
        dc_err_set(&e, DC_ENOSPACE, "register_event", "out of memory");
        dc_session_reject(s, t->req_id, &e);
    } else {
        Dpclip__Reply reply = DPCLIP__REPLY__INIT;
        Dpclip__RegisterEventReply rr = DPCLIP__REGISTER_EVENT_REPLY__INIT;
        struct dc_session_event *ev = &s->events[s->n_events++];
        ev->id = ++*s->host->next_buffer_id;
        ev->device = t->device;
        ev->event = t->event;
        rr.event_id = ev->id;
        reply.id = t->req_id;
        reply.body_case = DPCLIP__REPLY__BODY_REGISTER_EVENT;
        reply.register_event = &rr;
        dc_session_send(s, &reply);
    }
    free(t);
    if (s->gone) dc_session_destroy(s);
    else dc_session_process(s);
}

void dc_session_register_event(dc_session *s, uint64_t id, const Dpclip__RegisterEvent *m) {
    dc_gpu_event_task *t;
    dc_err e;
    int dev;
    if (ipc_request_ok(s, m->device, &m->device_uuid, m->cuda_ipc_event_handle.len, &k_event_names,
                       &dev, &e))
        goto fail;
    /* before the open: a session at its limit costs the GPU thread nothing
     * (registrations are serialized, so none is in flight here) */
    if (events_room(s, &e)) goto fail;
    t = calloc(1, sizeof *t);
    if (!t) {
        dc_err_set(&e, DC_ENOSPACE, "register_event", "out of memory");
        goto fail;
    }
    t->device = dev;
    memcpy(t->handle, m->cuda_ipc_event_handle.data, 64);
    t->user = s;
    t->req_id = id;
    t->done = register_event_done;
    s->async_ops++;
    dc_gpu_open_event(s->host->gpu, t);
    return;
fail:
    dc_session_reject(s, id, &e);
}

const struct dc_session_event *dc_session_find_event(const dc_session *s, uint64_t id) {
    for (size_t i = 0; i < s->n_events; i++)
        if (s->events[i].id == id) return &s->events[i];
    return NULL;
}
