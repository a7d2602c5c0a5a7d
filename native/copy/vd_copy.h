/* vramd's batch copier: the CPU copy backends' per-batch loop in one C call.
 *
 * One call moves every piece of a batch, one after another, between a BO (an fd read
 * or written with pread/pwrite, or memory) and a staging buffer, and on the way
 * computes what the transform needs: whether the piece is all zeros, and the xxh3-64
 * of its bytes (or of a chunk record's payload).  The bytes are hashed block by block
 * right after each block was moved, while they are still in the CPU cache.
 * Python calls it through cffi with the GIL released.
 */
#ifndef VD_COPY_H
#define VD_COPY_H

#include <stddef.h>
#include <stdint.h>

#define VD_HASH 1u      /* compute `hash` over the moved bytes (or the record payload) */
#define VD_ZERO 2u      /* compute `zero`: every moved byte is 0 */
#define VD_RECORD 4u    /* the bytes hold a chunk record starting at `rec_at`: hash only its payload */
#define VD_WHOLE 8u     /* move each copy in one call (up to 1 GiB), not 256 KiB at a time: for reads that
                         * wait on a device (O_DIRECT from a disk), where each call is a request the thread
                         * waits for; the hash then reads the bytes back from memory */

struct vd_copy {
    /* in */
    int32_t src_fd;       /* >= 0: pread(src_fd, ..., src); < 0: copy from memory at address src */
    int32_t dst_fd;       /* >= 0: pwrite(dst_fd, ..., dst); < 0: copy to memory at address dst */
    uint64_t src;         /* file offset or address */
    uint64_t dst;         /* file offset or address */
    uint64_t length;
    uint64_t rec_at;      /* VD_RECORD: where the record starts within the moved bytes */
    uint64_t rec_len;     /* VD_RECORD: the record's length */
    /* out */
    uint64_t hash;        /* xxh3-64 (VD_HASH) */
    uint64_t done;        /* bytes moved; < length only on error */
    uint64_t payload_at;  /* VD_RECORD: where the payload starts within the moved bytes (0: no valid prefix) */
    int32_t err;          /* 0; an errno; or -1: the fd ended (a read of 0 bytes, a write of 0 bytes) */
    int32_t zero;         /* VD_ZERO: 1 when every byte is zero */
};

/* Runs c[0..n) in order and stops at the first that fails.  Returns the index of the
 * failed piece, or -1 when all succeeded.  Pieces after a failure are not touched. */
long vd_copy_batch(struct vd_copy *c, size_t n, unsigned flags);

/* Which xxh3 build runs from now on: the AVX2 one when `want` and this CPU has AVX2, else the
 * baseline.  Returns 1 when the AVX2 build is in use.  Set once at load to the CPU's best; the
 * tests call it to run both builds on one machine (it is not safe during a copy in another thread). */
int vd_xxh3_use_avx2(int want);

/* xxh3-64 of n bytes at address p (the image format's checksum). */
uint64_t vd_xxh3(uint64_t p, size_t n);

/* dst[i] ^= src[i] for n bytes (format v2's delta records against their base chunk). */
void vd_xor(unsigned char *dst, const unsigned char *src, size_t n);

/* The byte-plane transform of the planes codec (vramd/image/planes.py).  The n bytes at
 * src, read as n / word little-endian words of `word` bytes (2 or 4), are written to dst
 * as `word` planes: every word's byte 0, then every word's byte 1, ...; the last
 * n % word bytes follow unchanged.  vd_planes_merge is its inverse.  src and dst must not
 * overlap; any other `word` copies the bytes unchanged. */
void vd_planes_split(const uint8_t *src, uint8_t *dst, size_t n, unsigned word);
void vd_planes_merge(const uint8_t *src, uint8_t *dst, size_t n, unsigned word);

#endif
