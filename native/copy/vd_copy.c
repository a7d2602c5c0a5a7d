/* vramd's batch copier (see vd_copy.h).  No Python API is used here: cffi calls it
 * with the GIL released. */
#define _GNU_SOURCE
#include "vd_copy.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "vd_xxh3.h"

#ifdef VD_HAVE_AVX2_BUILD
/* Whether vd_xxh3_avx2.c's build runs: set when the module is loaded, to whether this CPU has AVX2
 * (vd_xxh3_use_avx2). */
static int vd_avx2;

__attribute__((constructor)) static void vd_pick_xxh3(void)
{
    vd_xxh3_use_avx2(1);
}

static void xxh3_update(XXH3_state_t *st, const void *p, size_t n)
{
    if (vd_avx2)
        vd_xxh3_update_avx2(st, p, n);
    else
        XXH3_64bits_update(st, p, n);
}

static uint64_t xxh3(const void *p, size_t n)
{
    return vd_avx2 ? vd_xxh3_avx2(p, n) : XXH3_64bits(p, n);
}
#else
#define xxh3_update(st, p, n) XXH3_64bits_update((st), (p), (n))
#define xxh3(p, n) XXH3_64bits((p), (n))
#endif

/* Bytes moved, then hashed and scanned, at a time: small enough to still be in this
 * core's L2 cache when the hash reads them back.  Not with VD_WHOLE (vd_copy.h). */
#define VD_BLOCK ((size_t)256 << 10)
/* The most one VD_WHOLE move asks for (Linux moves at most 2 GiB - 4 KiB per call). */
#define VD_WHOLE_MAX ((size_t)1 << 30)
/* A chunk record's prefix: magic (4), header length (u32 LE), header checksum (8). */
#define VD_RECORD_PREFIX 16u
#define VD_MAX_CHUNK_HEADER 256u

static int all_zero(const unsigned char *p, size_t n)
{
    /* p[0] == 0 and every byte equals the next one: all are 0.  libc's memcmp is
     * vectorised and stops at the first difference (at once on random data). */
    return n == 0 || (p[0] == 0 && (n == 1 || memcmp(p, p + 1, n - 1) == 0));
}

/* Move up to n bytes at `off` of the piece; returns bytes moved, 0 at the end of an
 * fd, or -errno. */
static ssize_t move(const struct vd_copy *c, uint64_t off, size_t n)
{
    ssize_t r;
    if (c->src_fd >= 0 && c->dst_fd >= 0)
        return -EINVAL;
    do {
        if (c->src_fd >= 0)
            r = pread(c->src_fd, (void *)(uintptr_t)(c->dst + off), n, (off_t)(c->src + off));
        else if (c->dst_fd >= 0)
            r = pwrite(c->dst_fd, (const void *)(uintptr_t)(c->src + off), n, (off_t)(c->dst + off));
        else {
            memcpy((void *)(uintptr_t)(c->dst + off), (const void *)(uintptr_t)(c->src + off), n);
            r = (ssize_t)n;
        }
    } while (r < 0 && errno == EINTR);
    return r < 0 ? -errno : r;
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void run_one(struct vd_copy *c, unsigned flags)
{
    XXH3_state_t st;
    const unsigned char *mem = (const unsigned char *)(uintptr_t)(c->dst_fd >= 0 ? c->src : c->dst);
    int hashing = (flags & VD_HASH) != 0, zero = 1;
    int known = !(flags & VD_RECORD);  /* the hashed range is known */
    uint64_t lo = 0, hi = c->length, hashed = 0, off = 0;
    size_t block = !(flags & VD_WHOLE) ? VD_BLOCK : c->length < VD_WHOLE_MAX ? (size_t)c->length : VD_WHOLE_MAX;

    c->hash = 0;
    c->done = 0;
    c->payload_at = 0;
    c->err = 0;
    if (flags & VD_RECORD) {
        hi = c->rec_at + c->rec_len;
        if (hi > c->length || hi < c->rec_at)
            hi = c->length;
    }
    if (hashing)
        XXH3_64bits_reset(&st);
    while (off < c->length) {
        size_t n = c->length - off < block ? (size_t)(c->length - off) : block;
        ssize_t got = move(c, off, n);
        if (got <= 0) {
            c->err = got == 0 ? -1 : (int32_t)-got;
            break;
        }
        if ((flags & VD_ZERO) && zero)
            zero = all_zero(mem + off, (size_t)got);
        off += (uint64_t)got;
        if (!hashing)
            continue;
        if (!known && off >= c->rec_at + VD_RECORD_PREFIX) {
            uint32_t hlen = le32(mem + c->rec_at + 4);
            known = 1;
            lo = c->rec_at + VD_RECORD_PREFIX + hlen;
            if (hlen > VD_MAX_CHUNK_HEADER || lo > hi) {
                hashing = 0;  /* not a record: the caller's header check rejects it */
                continue;
            }
            c->payload_at = lo;
            hashed = lo;
        }
        if (known) {
            uint64_t upto = off < hi ? off : hi;
            if (upto > hashed) {
                xxh3_update(&st, mem + hashed, (size_t)(upto - hashed));
                hashed = upto;
            }
        }
    }
    c->done = off;
    c->zero = (flags & VD_ZERO) ? zero : 0;
    if (hashing && known)
        c->hash = XXH3_64bits_digest(&st);
}

long vd_copy_batch(struct vd_copy *c, size_t n, unsigned flags)
{
    for (size_t i = 0; i < n; i++) {
        run_one(&c[i], flags);
        if (c[i].err)
            return (long)i;
    }
    return -1;
}

int vd_xxh3_use_avx2(int want)
{
#ifdef VD_HAVE_AVX2_BUILD
    __builtin_cpu_init();
    vd_avx2 = want && __builtin_cpu_supports("avx2");
    return vd_avx2;
#else
    (void)want;
    return 0;
#endif
}

uint64_t vd_xxh3(uint64_t p, size_t n)
{
    return xxh3((const void *)(uintptr_t)p, n);
}

void vd_xor(unsigned char *dst, const unsigned char *src, size_t n)
{
    size_t i = 0;
    for (; i + sizeof(uint64_t) <= n; i += sizeof(uint64_t)) {
        uint64_t a, b;
        memcpy(&a, dst + i, sizeof a);
        memcpy(&b, src + i, sizeof b);
        a ^= b;
        memcpy(dst + i, &a, sizeof a);
    }
    for (; i < n; i++)
        dst[i] ^= src[i];
}

/* The planes transform in blocks of VD_PLANE_BLOCK words: the inner loops have a fixed
 * trip count and restrict pointers, which gcc -O2 (12+, its very cheap cost model)
 * vectorises into 16-byte loads, shuffles and stores. */
#define VD_PLANE_BLOCK 32u

static void split2(const uint8_t *restrict s, uint8_t *restrict d0, uint8_t *restrict d1, size_t w)
{
    size_t i = 0;
    for (; i + VD_PLANE_BLOCK <= w; i += VD_PLANE_BLOCK)
        for (size_t j = 0; j < VD_PLANE_BLOCK; j++) {
            d0[i + j] = s[2 * (i + j)];
            d1[i + j] = s[2 * (i + j) + 1];
        }
    for (; i < w; i++) {
        d0[i] = s[2 * i];
        d1[i] = s[2 * i + 1];
    }
}

static void split4(const uint8_t *restrict s, uint8_t *restrict d0, uint8_t *restrict d1, uint8_t *restrict d2,
                   uint8_t *restrict d3, size_t w)
{
    size_t i = 0;
    for (; i + VD_PLANE_BLOCK <= w; i += VD_PLANE_BLOCK)
        for (size_t j = 0; j < VD_PLANE_BLOCK; j++) {
            d0[i + j] = s[4 * (i + j)];
            d1[i + j] = s[4 * (i + j) + 1];
            d2[i + j] = s[4 * (i + j) + 2];
            d3[i + j] = s[4 * (i + j) + 3];
        }
    for (; i < w; i++) {
        d0[i] = s[4 * i];
        d1[i] = s[4 * i + 1];
        d2[i] = s[4 * i + 2];
        d3[i] = s[4 * i + 3];
    }
}

static void merge2(const uint8_t *restrict s0, const uint8_t *restrict s1, uint8_t *restrict d, size_t w)
{
    size_t i = 0;
    for (; i + VD_PLANE_BLOCK <= w; i += VD_PLANE_BLOCK)
        for (size_t j = 0; j < VD_PLANE_BLOCK; j++) {
            d[2 * (i + j)] = s0[i + j];
            d[2 * (i + j) + 1] = s1[i + j];
        }
    for (; i < w; i++) {
        d[2 * i] = s0[i];
        d[2 * i + 1] = s1[i];
    }
}

static void merge4(const uint8_t *restrict s0, const uint8_t *restrict s1, const uint8_t *restrict s2,
                   const uint8_t *restrict s3, uint8_t *restrict d, size_t w)
{
    size_t i = 0;
    for (; i + VD_PLANE_BLOCK <= w; i += VD_PLANE_BLOCK)
        for (size_t j = 0; j < VD_PLANE_BLOCK; j++) {
            d[4 * (i + j)] = s0[i + j];
            d[4 * (i + j) + 1] = s1[i + j];
            d[4 * (i + j) + 2] = s2[i + j];
            d[4 * (i + j) + 3] = s3[i + j];
        }
    for (; i < w; i++) {
        d[4 * i] = s0[i];
        d[4 * i + 1] = s1[i];
        d[4 * i + 2] = s2[i];
        d[4 * i + 3] = s3[i];
    }
}

void vd_planes_split(const uint8_t *src, uint8_t *dst, size_t n, unsigned word)
{
    size_t w = (word == 2 || word == 4) ? n / word : 0, body = w * word;
    if (word == 2)
        split2(src, dst, dst + w, w);
    else if (word == 4)
        split4(src, dst, dst + w, dst + 2 * w, dst + 3 * w, w);
    memcpy(dst + body, src + body, n - body);
}

void vd_planes_merge(const uint8_t *src, uint8_t *dst, size_t n, unsigned word)
{
    size_t w = (word == 2 || word == 4) ? n / word : 0, body = w * word;
    if (word == 2)
        merge2(src, src + w, dst, w);
    else if (word == 4)
        merge4(src, src + w, src + 2 * w, src + 3 * w, dst, w);
    memcpy(dst + body, src + body, n - body);
}
