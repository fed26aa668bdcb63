/* Test harness (harness.h): a real dpclipd per test program and raw-wire
 * helpers. */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include "dc_clock.h"
#include "dc_frame.h"

/* --- the daemon ------------------------------------------------------------ */

#define MAX_ARGS 64

int dc_harness_start(dc_harness *h, const char *extra_args) {
    const char *tmp = getenv("TMPDIR");
    char extra[512], *argv[MAX_ARGS], *save = NULL;
    char buf[64];
    size_t got = 0;
    int p[2], argc = 0;
    int64_t deadline;
    pid_t pid;

    memset(h, 0, sizeof *h);
    if (!tmp || !tmp[0]) tmp = "/tmp";
    snprintf(h->dir, sizeof h->dir, "%s/dpclip-test.XXXXXX", tmp);
    if (!mkdtemp(h->dir)) {
        fprintf(stderr, "harness: mkdtemp %s: %s\n", h->dir, strerror(errno));
        return -1;
    }
    snprintf(h->sock, sizeof h->sock, "%s/d.sock", h->dir);

    argv[argc++] = (char *)DPCLIPD_PATH;
    argv[argc++] = "--socket";
    argv[argc++] = h->sock;
    argv[argc++] = "--ready-fd";
    argv[argc++] = "3";
    argv[argc++] = "--insecure-fixed-seed";
    argv[argc++] = "1234";
    argv[argc++] = "--log-level";
    argv[argc++] = "warn";
    /* An in-memory privacy ledger: these tests are not about persistence
     * (test_ledger and test_service are), and the default state directory
     * need not exist on a test machine. */
    argv[argc++] = "--ledger-dir";
    argv[argc++] = "";
    /* Only these flags: not a config file installed on this machine. */
    argv[argc++] = "--config";
    argv[argc++] = "/dev/null";
    snprintf(extra, sizeof extra, "%s", extra_args ? extra_args : "");
    for (char *t = strtok_r(extra, " \t", &save); t && argc < MAX_ARGS - 1;
         t = strtok_r(NULL, " \t", &save))
        argv[argc++] = t;
    argv[argc] = NULL;

    if (pipe2(p, O_CLOEXEC) != 0) {
        fprintf(stderr, "harness: pipe: %s\n", strerror(errno));
        rmdir(h->dir);
        return -1;
    }
    pid = fork();
    if (pid < 0) {
        fprintf(stderr, "harness: fork: %s\n", strerror(errno));
        close(p[0]);
        close(p[1]);
        rmdir(h->dir);
        return -1;
    }
    if (pid == 0) {
        /* dup2 onto 3 clears close-on-exec; if the pipe already is fd 3,
         * clear it by hand. */
        if (p[1] == 3) fcntl(3, F_SETFD, 0);
        else if (dup2(p[1], 3) < 0) _exit(126);
        execv(argv[0], argv);
        _exit(127);
    }
    close(p[1]);
    h->pid = pid;

    deadline = dc_clock_ms() + 20000;
    while (got < sizeof buf - 1) {
        struct pollfd pf = {p[0], POLLIN, 0};
        int64_t left = deadline - dc_clock_ms();
        ssize_t n;
        if (left <= 0 || poll(&pf, 1, (int)left) <= 0) break;
        n = read(p[0], buf + got, sizeof buf - 1 - got);
        if (n <= 0) break;
        got += (size_t)n;
        buf[got] = '\0';
        if (strchr(buf, '\n')) break;
    }
    buf[got] = '\0';
    close(p[0]);
    if (strcmp(buf, "READY\n") != 0) {
        fprintf(stderr, "harness: %s did not report READY within 20 s (got '%s')\n", DPCLIPD_PATH,
                buf);
        dc_harness_stop(h);
        return -1;
    }
    return 0;
}

int dc_harness_alive(const dc_harness *h) {
    return h->pid > 0 && waitpid(h->pid, NULL, WNOHANG) == 0;
}

int dc_harness_stop(dc_harness *h) {
    if (h->pid > 0) kill(h->pid, SIGTERM);
    return dc_harness_join(h);
}

int dc_harness_join(dc_harness *h) {
    int status = 0, rc = -1;
    struct stat st;

    if (h->pid > 0) {
        int64_t deadline = dc_clock_ms() + 30000;
        pid_t w;
        while ((w = waitpid(h->pid, &status, WNOHANG)) == 0 && dc_clock_ms() < deadline) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        if (w == 0) {
            fprintf(stderr, "harness: dpclipd did not exit within 30 s; killing it\n");
            kill(h->pid, SIGKILL);
            waitpid(h->pid, &status, 0);
        } else if (w == h->pid && WIFEXITED(status)) {
            rc = WEXITSTATUS(status);
            if (rc) fprintf(stderr, "harness: dpclipd exited with status %d\n", rc);
        } else if (w == h->pid && WIFSIGNALED(status)) {
            fprintf(stderr, "harness: dpclipd died from signal %d\n", WTERMSIG(status));
        }
        h->pid = 0;
    }
    if (h->sock[0] && lstat(h->sock, &st) == 0) {
        fprintf(stderr, "harness: dpclipd left its socket %s behind\n", h->sock);
        unlink(h->sock);
        if (rc == 0) rc = -2;
    }
    if (h->dir[0]) rmdir(h->dir);
    h->dir[0] = h->sock[0] = '\0';
    return rc;
}

dpclip_client *dc_harness_connect(const dc_harness *h, const char *client_name,
                                  const char *job_id) {
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = client_name, .job_id = job_id, .timeout_ms = 10000};
    int rc = dpclip_connect(h->sock, &o, &c);
    if (rc)
        print_error("connect as '%s', job '%s': %s\n", client_name, job_id ? job_id : "",
                    dpclip_errmsg(c));
    assert_int_equal(rc, 0);
    assert_non_null(c);
    return c;
}

/* --- raw wire ------------------------------------------------------------ */

int dc_raw_connect(const char *sock) {
    struct sockaddr_un a;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    snprintf(a.sun_path, sizeof a.sun_path, "%s", sock);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

int dc_raw_send(int fd, const void *buf, size_t n) {
    const uint8_t *p = buf;
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int dc_raw_send_request(int fd, const Dpclip__Request *req) {
    size_t n = dpclip__request__get_packed_size(req);
    uint8_t *buf = malloc(DC_FRAME_HEADER + n);
    int rc;
    if (!buf) return -1;
    dc_frame_put_len(buf, (uint32_t)n);
    dpclip__request__pack(req, buf + DC_FRAME_HEADER);
    rc = dc_raw_send(fd, buf, DC_FRAME_HEADER + n);
    free(buf);
    return rc;
}

int dc_raw_send_request_fd(int fd, const Dpclip__Request *req, int pass_fd) {
    size_t n = dpclip__request__get_packed_size(req);
    uint8_t *buf = malloc(DC_FRAME_HEADER + n);
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int))];
    } cm;
    struct iovec iov;
    struct msghdr msg;
    struct cmsghdr *h;
    ssize_t w;
    int rc = -1;

    if (!buf) return -1;
    dc_frame_put_len(buf, (uint32_t)n);
    dpclip__request__pack(req, buf + DC_FRAME_HEADER);
    memset(&msg, 0, sizeof msg);
    memset(&cm, 0, sizeof cm);
    iov.iov_base = buf;
    iov.iov_len = DC_FRAME_HEADER + n;
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cm.b;
    msg.msg_controllen = sizeof cm.b;
    h = CMSG_FIRSTHDR(&msg);
    h->cmsg_level = SOL_SOCKET;
    h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(h), &pass_fd, sizeof(int));
    do {
        w = sendmsg(fd, &msg, MSG_NOSIGNAL);
    } while (w < 0 && errno == EINTR);
    if (w > 0) rc = dc_raw_send(fd, buf + w, DC_FRAME_HEADER + n - (size_t)w);
    free(buf);
    return rc;
}

uint64_t dc_raw_register_memfd(int fd, uint64_t req_id, size_t size, void **map) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__RegisterBuffer rb = DPCLIP__REGISTER_BUFFER__INIT;
    Dpclip__Reply *r;
    uint64_t id = 0;
    int mfd = memfd_create("raw", MFD_CLOEXEC | MFD_ALLOW_SEALING);

    if (map) *map = NULL;
    if (mfd < 0) return 0;
    if (ftruncate(mfd, (off_t)size) != 0 || fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) goto out;
    rb.kind = DPCLIP__BUFFER_KIND__SHM_FD;
    rb.size = size;
    req.id = req_id;
    req.body_case = DPCLIP__REQUEST__BODY_REGISTER_BUFFER;
    req.register_buffer = &rb;
    if (dc_raw_send_request_fd(fd, &req, mfd)) goto out;
    if (!(r = dc_raw_read_reply(fd, 10000))) goto out;
    if (r->body_case == DPCLIP__REPLY__BODY_REGISTER_BUFFER) id = r->register_buffer->buffer_id;
    dpclip__reply__free_unpacked(r, NULL);
    if (id && map) {
        void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
        *map = m == MAP_FAILED ? NULL : m;
    }
out:
    close(mfd);
    return id;
}

/* Reads exactly n bytes before the deadline: 0, or -1 (EOF, error, timeout). */
static int read_full(int fd, uint8_t *p, size_t n, int64_t deadline) {
    while (n) {
        struct pollfd pf = {fd, POLLIN, 0};
        int64_t left = deadline - dc_clock_ms();
        ssize_t r;
        if (left <= 0) return -1;
        int pr = poll(&pf, 1, (int)left);
        if (pr < 0 && errno == EINTR) continue;
        if (pr <= 0) return -1;
        r = recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

Dpclip__Reply *dc_raw_read_reply(int fd, int timeout_ms) {
    int64_t deadline = dc_clock_ms() + timeout_ms;
    uint8_t hdr[DC_FRAME_HEADER], *body;
    Dpclip__Reply *r;
    uint32_t n;

    if (read_full(fd, hdr, sizeof hdr, deadline)) return NULL;
    n = dc_frame_get_len(hdr);
    if (n > (64u << 20)) return NULL;
    body = malloc(n ? n : 1);
    if (!body) return NULL;
    if (read_full(fd, body, n, deadline)) {
        free(body);
        return NULL;
    }
    r = dpclip__reply__unpack(NULL, n, body);
    free(body);
    return r;
}

int dc_raw_wait_eof(int fd, int timeout_ms) {
    int64_t deadline = dc_clock_ms() + timeout_ms;
    uint8_t buf[4096];
    for (;;) {
        struct pollfd pf = {fd, POLLIN, 0};
        int64_t left = deadline - dc_clock_ms();
        ssize_t r;
        if (left <= 0) return 0;
        int pr = poll(&pf, 1, (int)left);
        if (pr < 0 && errno == EINTR) continue;
        if (pr <= 0) return 0;
        r = recv(fd, buf, sizeof buf, 0);
        if (r == 0) return 1;
        if (r < 0 && errno != EINTR) return errno == ECONNRESET ? 1 : 0;
    }
}

int dc_raw_hello(int fd, uint64_t req_id) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Hello hello = DPCLIP__HELLO__INIT;
    Dpclip__Reply *r;
    int ok;
    hello.protocol_version = DC_PROTOCOL_VERSION;
    hello.client_name = "raw";
    req.id = req_id;
    req.body_case = DPCLIP__REQUEST__BODY_HELLO;
    req.hello = &hello;
    if (dc_raw_send_request(fd, &req)) return -1;
    if (!(r = dc_raw_read_reply(fd, 10000))) return -1;
    ok = r->body_case == DPCLIP__REPLY__BODY_HELLO && r->id == req_id;
    dpclip__reply__free_unpacked(r, NULL);
    return ok ? 0 : -1;
}

const Dpclip__Error *dc_raw_error(const Dpclip__Reply *r) {
    return r && r->body_case == DPCLIP__REPLY__BODY_ERROR ? r->error : NULL;
}
