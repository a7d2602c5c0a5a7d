/* Stub (ours): zeroed allocation and its free. */
#ifndef VRAMD_STUB_XMALLOC_H
#define VRAMD_STUB_XMALLOC_H

#include <stdlib.h>

#define xzalloc(size) calloc(1, (size))
#define xfree(p) free(p)

#endif
