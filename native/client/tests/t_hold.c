/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The restore's hold (vramd_criu_config.hold_s, vramd_open_args.hold_s): vramd_criu_restore_submit asks the
 * daemon to keep the session, once the submit has hung up, for as long as its max_hold allows, so CRIU main's
 * barrier finds it however long CRIU took in between (not only within the grace period).
 *
 * Group "hold" needs the driver (tests/test_libvramd.py): a daemon with grace_period 0 and a max_hold of
 * minutes.  submit_held prints "SUBMITTED <session token>", then waits for a line on stdin (sent once the
 * daemon has logged that nobody holds the session and it keeps it), then runs the barrier.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <stdio.h>
#include <unistd.h>

#include "harness.h"

#define SIZE (3u << 20)

static int t_submit_held(void)
{
    char path[PATH_MAX];
    struct vramd_error err;
    int dfd = make_image_dir(path);
    int src = make_memfd(SIZE, 21, 0, SIZE);
    int dst = make_memfd(SIZE, 0, 0, 0);
    CHECK(dfd >= 0 && src >= 0 && dst >= 0, "setup");
    struct vramd_criu_config cfg;
    vramd_criu_config_init(&cfg);
    CHECK(cfg.hold_s == 0, "hold_s defaults to 0 (as long as the daemon allows)");
    struct vramd_criu_bo bo;
    vramd_criu_bo_init(&bo);
    bo.id = 1;
    bo.fd = src;
    bo.size = SIZE;
    OK(vramd_criu_dump(&cfg, dfd, &bo, 1, NULL, &err), &err);
    close(src);

    bo.fd = dst;
    struct vramd_criu_ticket tk;
    OK(vramd_criu_restore_submit(&cfg, dfd, &bo, 1, 0, &tk, &err), &err); /* hangs up: nobody holds it */
    char tok[33];
    vramd_token_format(&tk.token, tok);
    printf("SUBMITTED %s\n", tok);
    fflush(stdout);
    char line[64];
    CHECK(fgets(line, sizeof line, stdin), "no go-ahead on stdin");

    struct vramd_session_info info;
    OK(vramd_criu_restore_barrier(&cfg, &tk, &info, &err), &err); /* after the grace period: held */
    CHECK(info.state == VRAMD_STATE_DONE, "state %d", info.state);
    long long bad = check_memfd(dst, SIZE, 21, 0, SIZE);
    CHECK(bad < 0, "restored bytes differ at %lld", bad);
    close(dst);
    close(dfd);
    remove_dir(path);
    return 0;
}

const struct test hold_tests[] = {
    {"submit_held", t_submit_held, "hold"},
    {NULL, NULL, NULL},
};
