/* Hostile input, framing: while one well-behaved client keeps running steps
 * (each checked against the reference), other connections send truncated,
 * oversized, undecodable or empty frames, requests before the handshake and
 * garbage. Each must get an Error naming the field (docs/protocol.md) or be
 * closed; the good client's results must stay exact and the daemon must keep
 * serving. (Buffers, shapes, data and vanishing clients: test_hostile_steps.c;
 * the fixture: support/hostile.c.) */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "dc_frame.h"
#include "hostile.h"

/* --- framing ----------------------------------------------------------------- */

static void test_truncated_frame(void **state) {
    (void)state;
    uint8_t junk[50];
    int fd = dc_hostile_raw_hello();
    Dpclip__Reply *r;
    memset(junk, 0x11, sizeof junk);
    dc_hostile_send_frame(fd, 100, junk, sizeof junk);
    shutdown(fd, SHUT_WR);
    /* either an Error{PROTOCOL, "frame"} or just the close */
    r = dc_raw_read_reply(fd, 10000);
    if (r) {
        const Dpclip__Error *e = dc_raw_error(r);
        assert_non_null(e);
        assert_int_equal(e->code, DPCLIP__ERROR_CODE__PROTOCOL);
        assert_string_equal(e->field, "frame");
        dpclip__reply__free_unpacked(r, NULL);
    }
    assert_int_equal(dc_raw_wait_eof(fd, 10000), 1);
    close(fd);

    /* half a header, then gone */
    fd = dc_hostile_raw_hello();
    assert_int_equal(dc_raw_send(fd, junk, 2), 0);
    close(fd);
}

static void test_frame_too_long(void **state) {
    (void)state;
    int fd = dc_hostile_raw_hello();
    dc_hostile_send_frame(fd, DC_HOSTILE_MAX_FRAME + 1, NULL, 0);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "frame.length");
    assert_int_equal(dc_raw_wait_eof(fd, 10000), 1); /* the stream cannot resync */
    close(fd);
    /* also before the handshake, and with the largest length there is */
    fd = dc_raw_connect(dc_hostile_h.sock);
    assert_true(fd >= 0);
    dc_hostile_send_frame(fd, UINT32_MAX, NULL, 0);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "frame.length");
    assert_int_equal(dc_raw_wait_eof(fd, 10000), 1);
    close(fd);
}

static void test_undecodable(void **state) {
    (void)state;
    static const uint8_t bad_varint[] = {0x08, 0xff, 0xff};         /* truncated varint */
    static const uint8_t bad_wiretype[] = {0x0f, 0x01, 0x02, 0x03}; /* wire type 7 */
    static const uint8_t bad_len[] = {0x6a, 0x7f, 0x08}; /* clip_step longer than the frame */
    int fd = dc_hostile_raw_hello();
    dc_hostile_send_frame(fd, sizeof bad_varint, bad_varint, sizeof bad_varint);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "request");
    dc_hostile_send_frame(fd, sizeof bad_wiretype, bad_wiretype, sizeof bad_wiretype);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "request");
    dc_hostile_send_frame(fd, sizeof bad_len, bad_len, sizeof bad_len);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "request");
    dc_hostile_send_frame(fd, 0, NULL, 0); /* N = 0 is an undecodable request */
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "request");
    dc_hostile_expect_pong(fd, 9); /* the connection survives all of them */
    close(fd);
}

static void test_empty_body(void **state) {
    (void)state;
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Reply *r;
    int fd = dc_hostile_raw_hello();
    req.id = 77;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    r = dc_raw_read_reply(fd, 10000);
    assert_non_null(dc_raw_error(r));
    assert_int_equal(r->id, 77);
    assert_int_equal(r->error->code, DPCLIP__ERROR_CODE__UNIMPLEMENTED);
    assert_string_equal(r->error->field, "request.body");
    dpclip__reply__free_unpacked(r, NULL);
    dc_hostile_expect_pong(fd, 78);
    close(fd);
}

static void test_before_handshake(void **state) {
    (void)state;
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__ClipStep cs = DPCLIP__CLIP_STEP__INIT;
    Dpclip__Ping ping = DPCLIP__PING__INIT;
    Dpclip__Hello hello = DPCLIP__HELLO__INIT;
    int fd = dc_raw_connect(dc_hostile_h.sock);
    assert_true(fd >= 0);

    cs.batch_size = 4;
    req.id = 5;
    req.body_case = DPCLIP__REQUEST__BODY_CLIP_STEP;
    req.clip_step = &cs;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__FAILED_PRECONDITION, "request");
    req.body_case = DPCLIP__REQUEST__BODY_PING;
    req.ping = &ping;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__FAILED_PRECONDITION, "request");
    /* the connection stays open: the handshake still works */
    assert_int_equal(dc_raw_hello(fd, 6), 0);
    dc_hostile_expect_pong(fd, 7);
    /* a second Hello is an error too */
    hello.protocol_version = DC_PROTOCOL_VERSION;
    req.body_case = DPCLIP__REQUEST__BODY_HELLO;
    req.hello = &hello;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__FAILED_PRECONDITION, NULL);
    close(fd);

    /* a protocol version from the future: refused, then closed */
    fd = dc_raw_connect(dc_hostile_h.sock);
    assert_true(fd >= 0);
    hello.protocol_version = DC_PROTOCOL_VERSION + 1;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__FAILED_PRECONDITION, "hello.protocol_version");
    assert_int_equal(dc_raw_wait_eof(fd, 10000), 1);
    close(fd);
}

static void test_garbage_stream(void **state) {
    (void)state;
    dc_test_rng r;
    uint8_t *junk = malloc(256 * 1024);
    assert_non_null(junk);
    dc_test_rng_seed(&r, 99);
    for (int round = 0; round < 4; round++) {
        int fd = dc_raw_connect(dc_hostile_h.sock);
        assert_true(fd >= 0);
        for (size_t i = 0; i < 256 * 1024; i++) junk[i] = (uint8_t)dc_test_next(&r);
        /* small lengths so that several frames parse before a big one */
        junk[0] = 3;
        junk[1] = junk[2] = junk[3] = 0;
        dc_raw_send(fd, junk, 256 * 1024); /* may fail once the daemon closes */
        assert_int_equal(dc_raw_wait_eof(fd, 10000), 1);
        close(fd);
    }
    free(junk);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_truncated_frame),  cmocka_unit_test(test_frame_too_long),
        cmocka_unit_test(test_undecodable),      cmocka_unit_test(test_empty_body),
        cmocka_unit_test(test_before_handshake), cmocka_unit_test(test_garbage_stream),
        cmocka_unit_test(dc_hostile_survivors),  cmocka_unit_test(dc_hostile_clean_shutdown),
    };
    return cmocka_run_group_tests_name("hostile", tests, dc_hostile_setup, dc_hostile_teardown);
}
