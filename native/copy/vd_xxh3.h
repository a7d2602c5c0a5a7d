/* The batch copier's xxh3-64, as vd_copy.c and vd_xxh3_avx2.c share it (internal). */
#ifndef VD_XXH3_H
#define VD_XXH3_H

#include <stddef.h>
#include <stdint.h>

/* Built where gcc targets x86 (vd_xxh3_avx2.c uses gcc's target pragma; other compilers and
 * CPUs keep the baseline build alone). */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
#define VD_HAVE_AVX2_BUILD 1
/* XXH3_state_t comes from <xxhash.h>, included (XXH_INLINE_ALL) before this header. */
uint64_t vd_xxh3_avx2(const void *p, size_t n);
void vd_xxh3_update_avx2(XXH3_state_t *st, const void *p, size_t n);
#endif

#endif
