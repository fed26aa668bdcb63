/* daemon/infra/registry.c: what a shared-memory fd must be to be mapped, lookups
 * confined to one session's registry, release. */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

#include "registry.h"

static int make_memfd(size_t size, int seals) {
    int fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)size), 0);
    if (seals) assert_int_equal(fcntl(fd, F_ADD_SEALS, seals), 0);
    return fd;
}

static void test_sealed_memfd_maps(void **state) {
    (void)state;
    dc_registry r;
    dc_err e;
    const dc_buffer *b = NULL;
    int fd = make_memfd(8192, F_SEAL_SHRINK | F_SEAL_GROW);

    dc_registry_init(&r);
    assert_int_equal(dc_registry_add_shm(&r, 7, fd, 4096, &b, &e), 0);
    assert_non_null(b);
    assert_int_equal(b->id, 7);
    assert_int_equal(b->size, 4096);
    assert_int_equal(b->device, -1);
    /* The mapping is shared with the client's view of the same memory. */
    void *mine = mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(mine != MAP_FAILED);
    memset(mine, 0xab, 16);
    assert_int_equal(((unsigned char *)b->base)[15], 0xab);
    munmap(mine, 8192);
    close(fd);

    /* size 0 maps the whole object */
    fd = make_memfd(12288, F_SEAL_SHRINK);
    assert_int_equal(dc_registry_add_shm(&r, 8, fd, 0, &b, &e), 0);
    assert_int_equal(b->size, 12288);
    close(fd);
    assert_int_equal(r.n, 2);
    assert_int_equal(r.bytes, 4096 + 12288);
    dc_registry_destroy(&r);
}

static void test_bad_fds_rejected(void **state) {
    (void)state;
    dc_registry r;
    dc_err e;
    int fd;

    dc_registry_init(&r);
    /* Not sealed: the client could truncate it and SIGBUS the daemon. */
    fd = make_memfd(4096, 0);
    assert_int_equal(dc_registry_add_shm(&r, 1, fd, 0, NULL, &e), DC_EINVAL);
    assert_non_null(strstr(e.msg, "F_SEAL_SHRINK"));
    close(fd);

    /* Larger than the object. */
    fd = make_memfd(4096, F_SEAL_SHRINK);
    assert_int_equal(dc_registry_add_shm(&r, 1, fd, 4097, NULL, &e), DC_EINVAL);
    assert_string_equal(e.field, "register_buffer.size");
    close(fd);

    /* Empty object. */
    fd = make_memfd(0, F_SEAL_SHRINK);
    assert_int_equal(dc_registry_add_shm(&r, 1, fd, 0, NULL, &e), DC_EINVAL);
    close(fd);

    /* Read-only descriptor of a sealed memfd. */
    fd = make_memfd(4096, F_SEAL_SHRINK);
    char p[64];
    snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
    int ro = open(p, O_RDONLY | O_CLOEXEC);
    assert_true(ro >= 0);
    assert_int_equal(dc_registry_add_shm(&r, 1, ro, 0, NULL, &e), DC_EINVAL);
    assert_non_null(strstr(e.msg, "read-write"));
    close(ro);
    close(fd);

    /* A pipe is not shared memory. */
    int pp[2];
    assert_int_equal(pipe(pp), 0);
    assert_int_equal(dc_registry_add_shm(&r, 1, pp[0], 0, NULL, &e), DC_EINVAL);
    close(pp[0]);
    close(pp[1]);
    assert_int_equal(r.n, 0);
    dc_registry_destroy(&r);
}

/* Memfds the daemon cannot map read-write are the client's mistake
 * (INVALID_ARGUMENT naming the reason), not the daemon running out of
 * memory (RESOURCE_EXHAUSTED). */
static void test_unmappable_fds_are_invalid(void **state) {
    (void)state;
    static const struct {
        int seal;
        const char *name;
    } seals[] = {{F_SEAL_WRITE, "F_SEAL_WRITE"}, {F_SEAL_FUTURE_WRITE, "F_SEAL_FUTURE_WRITE"}};
    dc_registry r;
    dc_err e;
    int fd;

    dc_registry_init(&r);
    for (size_t i = 0; i < sizeof seals / sizeof seals[0]; i++) {
        fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        assert_true(fd >= 0);
        assert_int_equal(ftruncate(fd, 4096), 0);
        if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | seals[i].seal) != 0) { /* old kernel */
            close(fd);
            continue;
        }
        assert_int_equal(dc_registry_add_shm(&r, 1, fd, 0, NULL, &e), DC_EINVAL);
        assert_string_equal(e.field, "register_buffer");
        assert_non_null(strstr(e.msg, seals[i].name));
        close(fd);
    }

    /* hugetlb: mapped where the node has huge pages for it, else refused
     * as the client's choice of memory, naming it */
    fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
    if (fd >= 0 && ftruncate(fd, 2u << 20) == 0 && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0) {
        void *m = mmap(NULL, 2u << 20, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        int rc = dc_registry_add_shm(&r, 2, fd, 0, NULL, &e);
        if (m != MAP_FAILED) {
            assert_int_equal(rc, 0);
            munmap(m, 2u << 20);
        } else {
            assert_int_equal(rc, DC_EINVAL);
            assert_non_null(strstr(e.msg, "hugetlb"));
        }
    } else {
        fprintf(stderr, "no hugetlb memfds here: that case not run\n");
    }
    if (fd >= 0) close(fd);
    assert_true(r.n <= 1);
    dc_registry_destroy(&r);
}

static void test_isolation_and_release(void **state) {
    (void)state;
    dc_registry a, b;
    dc_err e;
    int fd = make_memfd(4096, F_SEAL_SHRINK);

    dc_registry_init(&a);
    dc_registry_init(&b);
    assert_int_equal(dc_registry_add_shm(&a, 11, fd, 0, NULL, &e), 0);
    assert_int_equal(dc_registry_add_shm(&a, 12, fd, 0, NULL, &e), 0);
    assert_int_equal(dc_registry_add_shm(&b, 13, fd, 0, NULL, &e), 0);
    close(fd);
    assert_non_null(dc_registry_find(&a, 11));
    assert_null(dc_registry_find(&b, 11)); /* another session's id */
    assert_null(dc_registry_find(&a, 13));
    assert_int_equal(dc_registry_release(&b, 11, &e), DC_ENOTFOUND);
    assert_string_equal(e.field, "release_buffer.buffer_id");
    assert_int_equal(dc_registry_release(&a, 11, &e), 0);
    assert_null(dc_registry_find(&a, 11));
    assert_non_null(dc_registry_find(&a, 12));
    assert_int_equal(dc_registry_release(&a, 11, &e), DC_ENOTFOUND);
    assert_int_equal(a.bytes, 4096);
    dc_registry_destroy(&a);
    dc_registry_destroy(&b);
}

/* The daemon-wide caps: sessions' registries count into one total and a
 * buffer that would pass a cap is refused naming it, in whichever session;
 * release and destroy give the room back. */
static void test_daemon_wide_caps(void **state) {
    (void)state;
    dc_registry_totals t = {.max_buffers = 3, .max_shm_bytes = 5 * 4096};
    dc_registry a, b;
    dc_buffer cuda = {.id = 90, .kind = DC_BUFFER_CUDA, .size = 1u << 30, .device = 0};
    dc_err e;
    int fd = make_memfd(4 * 4096, F_SEAL_SHRINK);

    dc_registry_init(&a);
    dc_registry_init(&b);
    a.totals = b.totals = &t;
    assert_int_equal(dc_registry_add_shm(&a, 1, fd, 2 * 4096, NULL, &e), 0);
    assert_int_equal(dc_registry_add_shm(&b, 2, fd, 2 * 4096, NULL, &e), 0);
    assert_int_equal(t.buffers, 2);
    assert_int_equal(t.shm_bytes, 4 * 4096);
    /* 2 more pages would pass the bytes cap, in either session */
    assert_int_equal(dc_registry_add_shm(&b, 3, fd, 2 * 4096, NULL, &e), DC_ENOSPACE);
    assert_string_equal(e.field, "limits.max_mapped_bytes");
    assert_non_null(strstr(e.msg, "limits.max_mapped_bytes"));
    assert_int_equal(dc_registry_add_shm(&a, 3, fd, 4096, NULL, &e), 0);
    /* the count cap holds for device buffers too (their bytes are not mapped) */
    assert_int_equal(dc_registry_add(&b, &cuda, &e), DC_ENOSPACE);
    assert_string_equal(e.field, "limits.max_buffers_total");
    assert_int_equal(a.n + b.n, 3);
    assert_int_equal(dc_registry_release(&a, 1, &e), 0);
    assert_int_equal(t.buffers, 2);
    assert_int_equal(t.shm_bytes, 3 * 4096);
    dc_registry_set_cuda_unmap(NULL);
    assert_int_equal(dc_registry_add(&b, &cuda, &e), 0);
    assert_int_equal(t.shm_bytes, 3 * 4096);
    /* a lowered cap (reload) refuses new mappings, keeps the old ones */
    t.max_shm_bytes = 4096;
    assert_int_equal(dc_registry_add_shm(&a, 4, fd, 4096, NULL, &e), DC_ENOSPACE);
    dc_registry_destroy(&b);
    assert_int_equal(t.buffers, 1);
    assert_int_equal(t.shm_bytes, 4096);
    dc_registry_destroy(&a);
    assert_int_equal(t.buffers, 0);
    assert_int_equal(t.shm_bytes, 0);
    close(fd);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sealed_memfd_maps),
        cmocka_unit_test(test_bad_fds_rejected),
        cmocka_unit_test(test_unmappable_fds_are_invalid),
        cmocka_unit_test(test_isolation_and_release),
        cmocka_unit_test(test_daemon_wide_caps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
