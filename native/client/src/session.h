/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd internals: the dump sessions a connection keeps client state for, and a dump's data files
 * handed to the daemon before the BOs that need them (session.c). */
#ifndef VRAMD_SESSION_H
#define VRAMD_SESSION_H

#include "conn.h"

/* The connection's entry for this dump session, or NULL (not a dump, or opened on another connection). */
struct dump_entry *vramd__find_dump(struct vramd_conn *c, const struct vramd_token *t);
/* Forget a dump's client state: abandoned first unless committed (removes what it created, unlocks). */
void vramd__drop_dump(struct vramd_conn *c, struct dump_entry *e);
/* Create and attach the data files of every GPU of bos[] that has none yet. */
int vramd__attach_dump_data(struct vramd_conn *c, struct dump_entry *e, char *tok, const struct vramd_bo *bos,
                            size_t n, struct vramd_error *err);
/* vramd_close_session with its own bound on the reply (-1: none), whatever the connection's timeout_ms. */
int vramd__close_session_within(struct vramd_conn *c, const struct vramd_token *t, int within_ms,
                                struct vramd_session_info *info, struct vramd_error *err);
/* Close every fd of fds[0..n). */
void vramd__close_all(const int *fds, size_t n);

#endif
