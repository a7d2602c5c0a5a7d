/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd: what every part uses: errors (codes, messages), fds, the clock. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base.h"


static const struct {
    int code;
    const char *name;
    int errnum;
} codes[] = {
    {VRAMD_CODE_OK, "OK", 0},
    {VRAMD_CODE_PROTOCOL_ERROR, "PROTOCOL_ERROR", EPROTO},
    {VRAMD_CODE_PERMISSION_DENIED, "PERMISSION_DENIED", EACCES},
    {VRAMD_CODE_NOT_FOUND, "NOT_FOUND", ENOENT},
    {VRAMD_CODE_LIMIT_EXCEEDED, "LIMIT_EXCEEDED", E2BIG},
    {VRAMD_CODE_SHUTTING_DOWN, "SHUTTING_DOWN", ESHUTDOWN},
    {VRAMD_CODE_TIMEOUT, "TIMEOUT", ETIMEDOUT},
    {VRAMD_CODE_INTERNAL, "INTERNAL", EREMOTEIO},
    {VRAMD_CODE_UNSUPPORTED_PROTOCOL, "UNSUPPORTED_PROTOCOL", EPROTONOSUPPORT},
    {VRAMD_CODE_JOB_ERROR, "JOB_ERROR", EIO},
    {VRAMD_CODE_INVALID_REQUEST, "INVALID_REQUEST", EINVAL},
    {VRAMD_CODE_CANCELLED, "CANCELLED", ECANCELED},
    {VRAMD_CODE_INCOMPLETE_RESTORE, "INCOMPLETE_RESTORE", ENODATA},
    {VRAMD_CODE_BACKEND_ERROR, "BACKEND_ERROR", EIO},
    {VRAMD_CODE_UNMAPPED_RANGE, "UNMAPPED_RANGE", EFAULT},
    {VRAMD_CODE_TARGET_TOO_SMALL, "TARGET_TOO_SMALL", ENOSPC},
    {VRAMD_CODE_BAD_DESCRIPTOR, "BAD_DESCRIPTOR", EBADF},
    {VRAMD_CODE_BACKEND_UNAVAILABLE, "BACKEND_UNAVAILABLE", EOPNOTSUPP},
    {VRAMD_CODE_IMAGE_ERROR, "IMAGE_ERROR", EIO},
    {VRAMD_CODE_MANIFEST_MISSING, "MANIFEST_MISSING", ENOMSG},
    {VRAMD_CODE_UNSUPPORTED_VERSION, "UNSUPPORTED_VERSION", EOPNOTSUPP},
    {VRAMD_CODE_CORRUPT_MANIFEST, "CORRUPT_MANIFEST", EBADMSG},
    {VRAMD_CODE_CORRUPT_CHUNK, "CORRUPT_CHUNK", EBADMSG},
    {VRAMD_CODE_TRUNCATED_DATA, "TRUNCATED_DATA", EBADMSG},
    {VRAMD_CODE_FOREIGN_DATA_FILE, "FOREIGN_DATA_FILE", EBADMSG},
    {VRAMD_CODE_NO_SPACE, "NO_SPACE", ENOSPC},
    {VRAMD_CODE_READ_ONLY_FS, "READ_ONLY_FS", EROFS},
    {VRAMD_CODE_IO_ERROR, "IO_ERROR", EIO},
    {VRAMD_CODE_NOT_WRITABLE, "NOT_WRITABLE", EACCES},
    {VRAMD_CODE_PARENT_MISSING, "PARENT_MISSING", ENOENT},
    {VRAMD_CODE_PARENT_MISMATCH, "PARENT_MISMATCH", EBADMSG},
    {VRAMD_CODE_TOPOLOGY_ERROR, "TOPOLOGY_ERROR", ENODEV},
    {VRAMD_CODE_TOPOLOGY_MISMATCH, "TOPOLOGY_MISMATCH", ENODEV},
    {VRAMD_CODE_VRAMD_ERROR, "VRAMD_ERROR", EREMOTEIO},
};

const char *vramd_code_name(int code)
{
    if (code == VRAMD_CODE_LOCAL)
        return "LOCAL";
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++)
        if (codes[i].code == code)
            return codes[i].name;
    return "UNKNOWN";
}

int vramd_code_errno(int code)
{
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++)
        if (codes[i].code == code)
            return -codes[i].errnum;
    return -EREMOTEIO;
}

const char *vramd_strerror(int ret)
{
    if (ret >= 0)
        return "success";
    switch (-ret) {
    case ETIME:
        return "no reply from vramd in time (the connection is closed)";
    case ETIMEDOUT:
        return "the session still runs (Wait timed out)";
    case ENOTCONN:
        return "the connection to vramd is broken";
    case ECONNRESET:
        return "vramd closed the connection";
    case EPROTO:
        return "vramd protocol error";
    case EREMOTEIO:
        return "vramd reported an internal or unknown error";
    default: {
        const char *s = strerrordesc_np(-ret);
        return s ? s : "unknown error";
    }
    }
}

void vramd__clear_error(struct vramd_error *err)
{
    if (err)
        memset(err, 0, sizeof *err);
}

void vramd__one_line(char *s)
{
    for (; *s; s++)
        if (*s == '\n' || *s == '\r')
            *s = ' ';
}

int vramd__fail(struct vramd_error *err, int errnum, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        memset(err, 0, sizeof *err);
        err->errnum = errnum;
        err->code = code;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
        vramd__one_line(err->message);
    }
    return errnum;
}

int vramd__fail_errno(struct vramd_error *err, int e, const char *what)
{
    return vramd__fail(err, -e, VRAMD_CODE_LOCAL, "%s: %s", what, strerrordesc_np(e) ? strerrordesc_np(e) : "error");
}

void vramd__copy_str(char *dst, size_t size, const char *src)
{
    if (!src)
        src = "";
    size_t n = strnlen(src, size - 1);
    memcpy(dst, src, n);
    dst[n] = '\0';
}

void vramd__close_fd(int fd)
{
    if (fd < 0)
        return;
    int saved = errno;
    (void)close(fd); /* Linux releases the fd even on EINTR: never retry */
    errno = saved;
}

int vramd__place_fd(int fd, int min_fd)
{
    if (min_fd <= 0 || fd >= min_fd)
        return fd;
    int nfd = fcntl(fd, F_DUPFD_CLOEXEC, min_fd);
    int e = errno;
    vramd__close_fd(fd);
    return nfd < 0 ? -e : nfd;
}

int64_t vramd__now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait for `events` on fd until deadline (-1: none).  0 ready, -ETIME, or -errno. */
int vramd__wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        int t = -1;
        if (deadline >= 0) {
            int64_t left = deadline - vramd__now_ms();
            if (left <= 0)
                return -ETIME;
            t = left > INT_MAX ? INT_MAX : (int)left;
        }
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, t);
        if (r > 0)
            return 0; /* readable, writable, or POLLHUP/POLLERR: the next call says which */
        if (r == 0)
            continue; /* re-check the deadline */
        if (errno != EINTR)
            return -errno;
    }
}
