/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd internals: a connection's state (struct vramd_conn) and its transport, one request and its
 * reply (call.c); connect.c makes connections, session.c, bos.c and listing.c make calls on them. */
#ifndef VRAMD_CONN_H
#define VRAMD_CONN_H

#include "files.h"
#include "frame.h"

#define DEFAULT_MAX_MESSAGE (1u << 20)   /* the daemon's default, used until Hello says otherwise */
#define MIN_MAX_MESSAGE 4096u            /* the protocol's minimum for max_message_bytes */
#define MAX_RX_MESSAGE (16u << 20)       /* the most this library ever receives in one packet */
#define TARGET_MESSAGE_BYTES (64u << 10) /* what AddBos messages aim for, as the Python client */
#define WAIT_SLACK_MS 5000               /* reply slack for a Wait with a timeout and no timeout_ms */
#define MAX_BACKENDS 16
#define FDMAP_SLOTS 512                  /* > 2 x 253: the fd -> index map of one message */
#define MAX_CONN_DUMPS 1024              /* dump sessions one connection keeps client state for */

/* A dump session this connection opened: what its commit needs (files.c). */
struct dump_entry {
    struct vramd_token token;
    struct vramd__dump d;
    bool failed;                         /* its commit failed: `failure` says why, again on a later Wait */
    struct vramd_error failure;
};

struct vramd_conn {
    int fd;
    bool broken;
    int timeout_ms;
    uint64_t next_id;
    uint32_t version;
    char server[64];
    struct vramd_limits limits;
    char backends[MAX_BACKENDS][32];
    unsigned n_backends;
    uint8_t *tx;
    size_t tx_cap;
    uint8_t *rx;
    size_t rx_cap;
    /* AddBos scratch: message BOs, their pointers, the fd -> index map */
    PbBo *bo_buf;
    PbBo **bo_ptrs;
    size_t bo_cap;
    uint32_t fdmap_gen;
    uint32_t fdmap_stamp[FDMAP_SLOTS];
    int fdmap_fd[FDMAP_SLOTS];
    uint16_t fdmap_index[FDMAP_SLOTS];
    int min_fd;                          /* vramd_options.min_fd */
    struct dump_entry *dumps;            /* the dump sessions it opened, until CloseSession */
    size_t n_dumps, cap_dumps;
    uint32_t *gpus;                      /* HelloReply.allowed_gpu_ids: the GPUs a BO may name */
    size_t n_gpus;                       /* 0: the daemon listed none (then no GPU is skipped) */
};

/* Close the socket and mark the connection broken: every later call is -ENOTCONN. */
void vramd__mark_broken(struct vramd_conn *c);
/* The largest request the daemon takes (Hello's max_message_bytes, capped). */
uint32_t vramd__max_message(const struct vramd_conn *c);
/* A call's bound on its reply: timeout_ms, or -1 for none. */
int vramd__reply_ms(const struct vramd_conn *c);
/*
 * Send one request with `nfds` fds attached and receive its response.
 * reply_ms: how long to wait for the reply (-1: as long as it takes).
 * Returns 0 or a negative code; *out is set whenever a response was decoded,
 * error replies included (the caller frees it).
 */
int vramd__call(struct vramd_conn *c, Request *req, const int *fds, size_t nfds, int reply_ms, Response **out,
                struct vramd_error *err);
/* A call (no fds) whose reply must carry body `body` (Response's body case; protobuf-c sets the member with
 * it): 0 and *out (the caller frees it), or the error with *out NULL; a reply without that body is a protocol
 * error (`missing` says which) and breaks the connection. */
int vramd__call_for(struct vramd_conn *c, Request *req, int body, int reply_ms, Response **out, const char *missing,
                    struct vramd_error *err);
/* A call whose reply body is a SessionInfo (also on error, when the daemon sends one), as *info (may be
 * NULL); with keep, the SessionInfo and its response are handed to the caller (who frees *keep_resp). */
int vramd__session_call(struct vramd_conn *c, Request *req, const int *fds, size_t nfds, int reply_ms,
                        struct vramd_session_info *info, PbSessionInfo **keep, Response **keep_resp,
                        struct vramd_error *err);

/* Whether a BO may name this GPU (the daemon's list from Hello; with no list, every GPU may). (connect.c) */
bool vramd__gpu_allowed(const struct vramd_conn *c, uint32_t gpu_id);
/* The bytes of BOs or file refs one message may carry (bos.c). */
uint32_t vramd__message_budget(const struct vramd_conn *c);

#endif
