/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd: the operator's calls: cancel by session id, the session listing, the daemon's status. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <string.h>

#include "conn.h"

int vramd_cancel_by_id(struct vramd_conn *c, uint64_t session_id, const char *reason,
                       struct vramd_session_info *info, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_cancel_by_id: NULL argument");
    Vramd__Rpc__V1__Cancel cn = VRAMD__RPC__V1__CANCEL__INIT;
    cn.has_session_id = 1;
    cn.session_id = session_id;
    cn.reason = reason && *reason ? (char *)reason : NULL;
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_CANCEL;
    req.cancel = &cn;
    return vramd__session_call(c, &req, NULL, 0, vramd__reply_ms(c), info, NULL, NULL, err);
}

int vramd_list_sessions(struct vramd_conn *c, struct vramd_session_entry *out, size_t cap, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c || (cap && !out))
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_list_sessions: NULL argument");
    Vramd__Rpc__V1__ListSessions ls = VRAMD__RPC__V1__LIST_SESSIONS__INIT;
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_LIST_SESSIONS;
    req.list_sessions = &ls;
    Response *resp;
    int r = vramd__call_for(c, &req, VRAMD__RPC__V1__RESPONSE__BODY_SESSIONS, vramd__reply_ms(c), &resp,
                            "ListSessions answered without a SessionList", err);
    if (r < 0)
        return r;
    size_t n = resp->sessions->n_sessions;
    if (n > INT_MAX) {
        vramd__mark_broken(c);
        r = vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "%zu sessions listed", n);
        goto out;
    }
    for (size_t i = 0; i < n && i < cap; i++) {
        const PbSessionInfo *s = resp->sessions->sessions[i];
        struct vramd_session_entry *e = &out[i];
        memset(e, 0, sizeof *e);
        vramd__info_from_pb(&e->info, s);
        if (!s)
            continue;
        e->n_target_pids = s->n_target_pids;
        for (size_t k = 0; k < s->n_target_pids && k < VRAMD_MAX_TARGET_PIDS; k++)
            e->target_pids[k] = s->target_pids[k];
        e->rate_bytes_per_s = s->rate_bytes_per_s;
        e->age_s = s->age_s;
    }
    r = (int)n;
out:
    vramd__free_response(resp);
    return r;
}

int vramd_status(struct vramd_conn *c, struct vramd_status *st, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c || !st)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_status: NULL argument");
    Vramd__Rpc__V1__GetStatus gs = VRAMD__RPC__V1__GET_STATUS__INIT;
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_GET_STATUS;
    req.get_status = &gs;
    Response *resp;
    int r = vramd__call_for(c, &req, VRAMD__RPC__V1__RESPONSE__BODY_STATUS, vramd__reply_ms(c), &resp,
                            "GetStatus answered without a StatusReply", err);
    if (r < 0)
        return r;
    const Vramd__Rpc__V1__StatusReply *s = resp->status;
    memset(st, 0, sizeof *st);
    vramd__copy_str(st->server, sizeof st->server, s->server);
    st->version = s->version;
    st->uptime_s = s->uptime_s;
    st->connections = s->connections;
    st->sessions = s->sessions;
    st->staging_budget = s->staging_budget;
    st->staging_in_use = s->staging_in_use;
    st->draining = s->has_draining && s->draining;
    vramd__free_response(resp);
    return 0;
}
