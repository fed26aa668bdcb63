/* The keyed checksum (common/dc_hash.h) on the host, against its definition
 * written out here word by word: NH per 1 KiB block, each block's keyed mix
 * summed; and what it is for: any one bit, a block moved, a tail byte or
 * another key changes it. The GPU's equals the host's (test_cuda_logical). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "dc_hash.h"

#define N 5000 /* four whole blocks and a tail */

static unsigned char g_data[N];

static void fill(void) {
    uint64_t x = 12345;
    for (size_t i = 0; i < N; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        g_data[i] = (unsigned char)(x >> 56);
    }
}

/* The definition, one 32-bit word at a time. */
static uint64_t by_definition(const unsigned char *p, size_t n, uint64_t key) {
    uint64_t sum = 0;
    const size_t words = (n + 3) / 4, blocks = (words + DC_HASH_BLOCK - 1) / DC_HASH_BLOCK;
    for (size_t j = 0; j < blocks; j++) {
        uint64_t y = 0;
        for (size_t t = 0; t < DC_HASH_BLOCK; t += 2) {
            uint32_t w[2] = {0, 0};
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < 4; c++) {
                    size_t at = 4 * (j * DC_HASH_BLOCK + t + (size_t)h) + (size_t)c;
                    if (at < n) w[h] |= (uint32_t)p[at] << (8 * c);
                }
            uint32_t a = w[0] + dc_hash_key_word(key, (uint32_t)t);
            uint32_t b = w[1] + dc_hash_key_word(key, (uint32_t)t + 1);
            y += (uint64_t)a * b;
        }
        sum += dc_hash_mix(y ^ dc_hash_mix(key + j));
    }
    return sum;
}

static void test_matches_definition(void **state) {
    (void)state;
    fill();
    for (size_t n = 0; n <= N; n += n < 40 ? 1 : 997)
        for (uint64_t key = 1; key < 4; key++)
            assert_true(dc_hash_bytes(g_data, n, key) == by_definition(g_data, n, key));
}

static void test_changes_are_seen(void **state) {
    (void)state;
    fill();
    const uint64_t h = dc_hash_bytes(g_data, N, 99);
    assert_true(h != dc_hash_bytes(g_data, N, 100)); /* another key */
    for (size_t i = 0; i < N; i += 131)
        for (int bit = 0; bit < 8; bit += 3) {
            g_data[i] ^= (unsigned char)(1u << bit);
            assert_true(dc_hash_bytes(g_data, N, 99) != h);
            g_data[i] ^= (unsigned char)(1u << bit);
        }
    assert_true(dc_hash_bytes(g_data, N, 99) == h);
    /* blocks 0 and 1 swapped: the same words, other places */
    unsigned char *swapped = malloc(N);
    assert_non_null(swapped);
    memcpy(swapped, g_data + 1024, 1024);
    memcpy(swapped + 1024, g_data, 1024);
    memcpy(swapped + 2048, g_data + 2048, N - 2048);
    assert_true(dc_hash_bytes(swapped, N, 99) != h);
    /* zero padding: within a block a zero tail reads as none (both phases
     * check the shapes that give the length); another block count differs */
    memset(swapped, 0, N);
    assert_true(dc_hash_bytes(swapped, 4, 99) == dc_hash_bytes(swapped, 1, 99));
    assert_true(dc_hash_bytes(swapped, 1025, 99) != dc_hash_bytes(swapped, 1024, 99));
    free(swapped);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_definition),
        cmocka_unit_test(test_changes_are_seen),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
