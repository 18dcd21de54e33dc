/* BLAKE2b with a 16-byte digest and no key (RFC 7693), what hashlib.blake2b(data,
 * digest_size=16).digest() gives: the prefix cache's block hashes, without a Python
 * object a block. Little-endian hosts only (the words are read and written in place);
 * elsewhere the build fails and sendpath hashes in Python. */
#ifndef SENDPATH_BLAKE2B_H
#define SENDPATH_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "blake2b.h reads message words in place: little-endian hosts only"
#endif

static const uint64_t b2_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* the message schedule of rounds 0-9; rounds 10 and 11 repeat 0 and 1 */
static const uint8_t b2_sigma[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint64_t b2_rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define B2_MIX(a, b, c, d, x, y)           \
    do {                                   \
        v[a] = v[a] + v[b] + (x);          \
        v[d] = b2_rotr(v[d] ^ v[a], 32);   \
        v[c] = v[c] + v[d];                \
        v[b] = b2_rotr(v[b] ^ v[c], 24);   \
        v[a] = v[a] + v[b] + (y);          \
        v[d] = b2_rotr(v[d] ^ v[a], 16);   \
        v[c] = v[c] + v[d];                \
        v[b] = b2_rotr(v[b] ^ v[c], 63);   \
    } while (0)

/* HOT: a function compiled at -O2, where the extensions build with -Os, for the loops
 * that run many times a call: a prompt's blocks are hashed in one loop, and the
 * compression runs a quarter faster (kv_native.c marks its index probe and prefix walk
 * with it too) */
#if defined(__GNUC__) && !defined(__clang__)
#define HOT __attribute__((optimize("O2")))
#else
#define HOT
#endif

/* one 128-byte block into the state; ``count``: bytes hashed so far, this block's too */
static HOT void b2_compress(uint64_t h[8], const uint8_t block[128], uint64_t count, int last) {
    uint64_t v[16], m[16];
    memcpy(m, block, sizeof m);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = b2_iv[i];
    }
    v[12] ^= count; /* the counter's high word stays 0: no input is 2^64 bytes */
    if (last)
        v[14] = ~v[14];
    /* rounds written out: each round's message indices are then constants */
#define B2_ROUND(r)                                                     \
    do {                                                                \
        B2_MIX(0, 4, 8, 12, m[b2_sigma[r][0]], m[b2_sigma[r][1]]);     \
        B2_MIX(1, 5, 9, 13, m[b2_sigma[r][2]], m[b2_sigma[r][3]]);     \
        B2_MIX(2, 6, 10, 14, m[b2_sigma[r][4]], m[b2_sigma[r][5]]);    \
        B2_MIX(3, 7, 11, 15, m[b2_sigma[r][6]], m[b2_sigma[r][7]]);    \
        B2_MIX(0, 5, 10, 15, m[b2_sigma[r][8]], m[b2_sigma[r][9]]);    \
        B2_MIX(1, 6, 11, 12, m[b2_sigma[r][10]], m[b2_sigma[r][11]]);  \
        B2_MIX(2, 7, 8, 13, m[b2_sigma[r][12]], m[b2_sigma[r][13]]);   \
        B2_MIX(3, 4, 9, 14, m[b2_sigma[r][14]], m[b2_sigma[r][15]]);   \
    } while (0)
    B2_ROUND(0);
    B2_ROUND(1);
    B2_ROUND(2);
    B2_ROUND(3);
    B2_ROUND(4);
    B2_ROUND(5);
    B2_ROUND(6);
    B2_ROUND(7);
    B2_ROUND(8);
    B2_ROUND(9);
    B2_ROUND(0);
    B2_ROUND(1);
#undef B2_ROUND
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b-128 of ``len`` bytes at ``data`` into ``out`` */
static void blake2b_128(const uint8_t *data, size_t len, uint8_t out[16]) {
    uint64_t h[8];
    memcpy(h, b2_iv, sizeof h);
    h[0] ^= 0x01010000ULL ^ 16; /* fanout 1, depth 1, no key, 16-byte digest */
    uint64_t count = 0;
    while (len > 128) { /* every block but the last, which is flagged (even if full) */
        count += 128;
        b2_compress(h, data, count, 0);
        data += 128;
        len -= 128;
    }
    uint8_t last[128] = {0};
    memcpy(last, data, len);
    b2_compress(h, last, count + len, 1);
    memcpy(out, h, 16);
}

#endif
