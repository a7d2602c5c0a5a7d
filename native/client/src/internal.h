/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd internals shared by client.c and criu.c; not installed. */
#ifndef VRAMD_INTERNAL_H
#define VRAMD_INTERNAL_H

#include <stdarg.h>

#include "vramd/client.h"

#if defined(__GNUC__)
#define VRAMD_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define VRAMD_PRINTF(a, b)
#endif

/* Fill *err (may be NULL) and return errnum (negative). */
int vramd__fail(struct vramd_error *err, int errnum, int code, const char *fmt, ...) VRAMD_PRINTF(4, 5);
void vramd__clear_error(struct vramd_error *err);
/* close() that keeps errno and ignores EINTR (the fd is gone either way on Linux). */
void vramd__close_fd(int fd);
/* Move fd to >= min_fd with FD_CLOEXEC (closing the original); returns the new fd or -errno (fd closed). */
int vramd__place_fd(int fd, int min_fd);

#endif
