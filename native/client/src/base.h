/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd internals every part uses (base.c): errors, fds, the clock.  Not installed. */
#ifndef VRAMD_BASE_H
#define VRAMD_BASE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "vramd/client.h"

#if defined(__GNUC__)
#define VRAMD_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define VRAMD_PRINTF(a, b)
#endif

/* Fill *err (may be NULL) and return errnum (negative). */
int vramd__fail(struct vramd_error *err, int errnum, int code, const char *fmt, ...) VRAMD_PRINTF(4, 5);
/* A local failure of errno value e (positive): "what: strerror".  Returns -e. */
int vramd__fail_errno(struct vramd_error *err, int e, const char *what);
void vramd__clear_error(struct vramd_error *err);
/* Newlines and carriage returns to spaces (messages are one line). */
void vramd__one_line(char *s);
/* Copy src (NULL: "") into dst[size], truncated, NUL-terminated. */
void vramd__copy_str(char *dst, size_t size, const char *src);

/* close() that keeps errno and ignores EINTR (the fd is gone either way on Linux). */
void vramd__close_fd(int fd);
/* Move fd to >= min_fd with FD_CLOEXEC (closing the original); returns the new fd or -errno (fd closed). */
int vramd__place_fd(int fd, int min_fd);

/* CLOCK_MONOTONIC in ms. */
int64_t vramd__now_ms(void);
/* Wait for `events` on fd until deadline (vramd__now_ms; -1: none).  0 ready, -ETIME, or -errno. */
int vramd__wait_fd(int fd, short events, int64_t deadline);

#endif
