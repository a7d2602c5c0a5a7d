/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd: the CRIU adapter's tickets (vramd/criu.h): their 32-byte records over a socket, and the shared
 * table CRIU's restored tasks publish them in for the main process. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>

#include "base.h"
#include "vramd/criu.h"

/* --- ticket records -------------------------------------------------------- */

#define TICKET_MAGIC "VRTK"
#define TICKET_VERSION 1
#define TICKET_BYTES 32 /* magic[4] version u8 reserved[3] pid i32le reserved[4] token[16] */

static void encode_ticket(uint8_t rec[TICKET_BYTES], const struct vramd_criu_ticket *t)
{
    memset(rec, 0, TICKET_BYTES);
    memcpy(rec, TICKET_MAGIC, 4);
    rec[4] = TICKET_VERSION;
    uint32_t pid = (uint32_t)t->pid;
    for (int i = 0; i < 4; i++)
        rec[8 + i] = (uint8_t)(pid >> (8 * i));
    memcpy(rec + 16, t->token.bytes, VRAMD_TOKEN_BYTES);
}

static int decode_ticket(const uint8_t rec[TICKET_BYTES], struct vramd_criu_ticket *t)
{
    if (memcmp(rec, TICKET_MAGIC, 4) != 0 || rec[4] != TICKET_VERSION)
        return -EPROTO;
    uint32_t pid = 0;
    for (int i = 0; i < 4; i++)
        pid |= (uint32_t)rec[8 + i] << (8 * i);
    t->pid = (int32_t)pid;
    memcpy(t->token.bytes, rec + 16, VRAMD_TOKEN_BYTES);
    return 0;
}

static int socket_type(int fd, struct vramd_error *err)
{
    int type = 0;
    socklen_t len = sizeof type;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) < 0) {
        int e = errno;
        return vramd__fail(err, -e, VRAMD_CODE_LOCAL, "ticket fd %d is not a socket: %s", fd, vramd_strerror(-e));
    }
    return type;
}

int vramd_criu_ticket_send(int sock, const struct vramd_criu_ticket *ticket, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!ticket)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_criu_ticket_send: NULL ticket");
    int type = socket_type(sock, err);
    if (type < 0)
        return type;
    uint8_t rec[TICKET_BYTES];
    encode_ticket(rec, ticket);
    size_t off = 0;
    while (off < TICKET_BYTES) {
        ssize_t n = send(sock, rec + off, TICKET_BYTES - off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            int e = errno;
            return vramd__fail(err, -e, VRAMD_CODE_LOCAL, "sending the ticket: %s", vramd_strerror(-e));
        }
        if (type != SOCK_STREAM && (size_t)n != TICKET_BYTES)
            return vramd__fail(err, -EPROTO, VRAMD_CODE_LOCAL, "short send of a ticket record");
        off += (size_t)n;
    }
    return 0;
}

int vramd_criu_ticket_recv(int sock, struct vramd_criu_ticket *ticket, int timeout_ms, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!ticket)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_criu_ticket_recv: NULL ticket");
    int type = socket_type(sock, err);
    if (type < 0)
        return type;
    int64_t deadline = timeout_ms >= 0 ? vramd__now_ms() + timeout_ms : -1;
    uint8_t rec[TICKET_BYTES + 1];
    size_t off = 0;
    while (off < TICKET_BYTES) {
        int t = -1;
        if (deadline >= 0) {
            int64_t left = deadline - vramd__now_ms();
            if (left < 0)
                left = 0;
            t = (int)left;
        }
        struct pollfd p = {.fd = sock, .events = POLLIN};
        int pr = poll(&p, 1, t);
        if (pr < 0) {
            if (errno == EINTR)
                continue;
            int e = errno;
            return vramd__fail(err, -e, VRAMD_CODE_LOCAL, "poll on the ticket socket: %s", vramd_strerror(-e));
        }
        if (pr == 0)
            return vramd__fail(err, -ETIMEDOUT, VRAMD_CODE_LOCAL, "no ticket within %d ms", timeout_ms);
        /* no control buffer: any fd someone attached is discarded by the kernel */
        struct iovec iov = {.iov_base = rec + off, .iov_len = type == SOCK_STREAM ? TICKET_BYTES - off : sizeof rec};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
        ssize_t n = recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            int e = errno;
            return vramd__fail(err, -e, VRAMD_CODE_LOCAL, "receiving a ticket: %s", vramd_strerror(-e));
        }
        if (n == 0)
            return vramd__fail(err, -ECONNRESET, VRAMD_CODE_LOCAL, "the ticket socket was closed before a ticket came");
        if (type != SOCK_STREAM && (n != TICKET_BYTES || (msg.msg_flags & MSG_TRUNC)))
            return vramd__fail(err, -EPROTO, VRAMD_CODE_LOCAL, "ticket record of %zd bytes (expected %d)", n,
                               TICKET_BYTES);
        off += (size_t)n;
    }
    if (decode_ticket(rec, ticket) < 0)
        return vramd__fail(err, -EPROTO, VRAMD_CODE_LOCAL, "not a libvramd ticket record");
    return 0;
}

/* --- the shared table ------------------------------------------------------ */

#define TABLE_MAGIC 0x4b545256u /* "VRTK" */
enum { SLOT_FREE = 0, SLOT_WRITING = 1, SLOT_READY = 2, SLOT_TAKING = 3, SLOT_TAKEN = 4 };

struct slot {
    _Atomic uint32_t state;
    int32_t pid;
    uint8_t token[VRAMD_TOKEN_BYTES];
};

struct vramd_criu_table {
    uint32_t magic;
    uint32_t slots;
    struct slot slot[];
};

size_t vramd_criu_table_size(unsigned slots)
{
    return sizeof(struct vramd_criu_table) + (size_t)slots * sizeof(struct slot);
}

int vramd_criu_table_init(void *mem, size_t len, unsigned slots, struct vramd_criu_table **out)
{
    if (!mem || !out || !slots || len < vramd_criu_table_size(slots) || ((uintptr_t)mem % _Alignof(struct slot)))
        return -EINVAL;
    struct vramd_criu_table *t = mem;
    t->magic = TABLE_MAGIC;
    t->slots = slots;
    for (unsigned i = 0; i < slots; i++) {
        atomic_init(&t->slot[i].state, SLOT_FREE);
        t->slot[i].pid = 0;
        memset(t->slot[i].token, 0, VRAMD_TOKEN_BYTES);
    }
    atomic_thread_fence(memory_order_release);
    *out = t;
    return 0;
}

int vramd_criu_table_publish(struct vramd_criu_table *t, const struct vramd_criu_ticket *ticket)
{
    if (!t || !ticket || t->magic != TABLE_MAGIC)
        return -EINVAL;
    for (uint32_t i = 0; i < t->slots; i++) {
        uint32_t expect = SLOT_FREE;
        if (!atomic_compare_exchange_strong(&t->slot[i].state, &expect, SLOT_WRITING))
            continue;
        t->slot[i].pid = ticket->pid;
        memcpy(t->slot[i].token, ticket->token.bytes, VRAMD_TOKEN_BYTES);
        atomic_store_explicit(&t->slot[i].state, SLOT_READY, memory_order_release);
        return 0;
    }
    return -ENOSPC;
}

static int take(struct vramd_criu_table *t, bool any, int32_t pid, struct vramd_criu_ticket *ticket)
{
    if (!t || !ticket || t->magic != TABLE_MAGIC)
        return -EINVAL;
    for (uint32_t i = 0; i < t->slots; i++) {
        struct slot *s = &t->slot[i];
        if (atomic_load_explicit(&s->state, memory_order_acquire) != SLOT_READY)
            continue;
        if (!any && s->pid != pid)
            continue;
        uint32_t expect = SLOT_READY;
        if (!atomic_compare_exchange_strong(&s->state, &expect, SLOT_TAKING))
            continue;
        ticket->pid = s->pid;
        memcpy(ticket->token.bytes, s->token, VRAMD_TOKEN_BYTES);
        atomic_store_explicit(&s->state, SLOT_TAKEN, memory_order_release);
        return 0;
    }
    return -ENOENT;
}

int vramd_criu_table_take(struct vramd_criu_table *t, int32_t pid, struct vramd_criu_ticket *ticket)
{
    return take(t, false, pid, ticket);
}

int vramd_criu_table_take_any(struct vramd_criu_table *t, struct vramd_criu_ticket *ticket)
{
    return take(t, true, 0, ticket);
}
