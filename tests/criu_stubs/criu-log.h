/* Stub (ours): the log calls, one line each on stderr with its level. */
#ifndef VRAMD_STUB_CRIU_LOG_H
#define VRAMD_STUB_CRIU_LOG_H

#include <errno.h>
#include <stdio.h>
#include <string.h>

#define pr_err(fmt, ...) fprintf(stderr, "E: " fmt, ##__VA_ARGS__)
#define pr_warn(fmt, ...) fprintf(stderr, "W: " fmt, ##__VA_ARGS__)
#define pr_info(fmt, ...) fprintf(stderr, "I: " fmt, ##__VA_ARGS__)
#define pr_perror(fmt, ...)                                                           \
	do {                                                                          \
		int stub_errno_ = errno;                                              \
		fprintf(stderr, "E: " fmt ": %s\n", ##__VA_ARGS__, strerror(stub_errno_)); \
	} while (0)

#endif
