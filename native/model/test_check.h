/*
 * test_check.h - the checks the model's C tests share (test_model.c, test_kfd.c, test_kfd_shim.c).
 *
 * A failed check prints the test under way (g_test, set by each test), the file and line and the
 * process, then exits 1: a test that forks fails in whichever process saw the failure.
 */
#ifndef VRAMD_MODEL_TEST_CHECK_H
#define VRAMD_MODEL_TEST_CHECK_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static const char *g_test = "?";

static void fail_at(const char *file, int line, const char *fmt, ...)
{
	va_list ap;
	fprintf(stderr, "FAIL [%s] %s:%d (pid %d): ", g_test, file, line, (int)getpid());
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(1);
}

#define fail(line, ...) fail_at(__FILE__, (line), __VA_ARGS__)
#define CHECK(c) do { if (!(c)) fail(__LINE__, "%s", #c); } while (0)
#define CHECK_EQ(a, b) do { long long _a = (long long)(a), _b = (long long)(b); \
	if (_a != _b) fail(__LINE__, "%s == %lld, expected %s == %lld", #a, _a, #b, _b); } while (0)
#define OK(call) CHECK_EQ((call), 0)

#endif
