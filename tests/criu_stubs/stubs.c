/*
 * What the stub headers declare, for the unit test of amdgpu_plugin_vramd.c
 * without CRIU (tests/test_criu_plugin_unit.py), plus setters and counters
 * the test reaches through ctypes.
 */
#include "criu-plugin.h"
#include "cr_options.h"
#include "amdgpu_plugin_util.h"

struct cr_options opts;
int fd_next;

static int image_dir = -1;
static int unpause_calls, unpause_kfd_fd = -1, unpause_all_calls;

void stub_set_image_dir(int fd)
{
	image_dir = fd;
}

void stub_set_stream(int on)
{
	opts.stream = on;
}

int criu_get_image_dir(void)
{
	return image_dir;
}

/* amdgpu_plugin.c's: only KFD_CRIU_OP_UNPAUSE reaches it from the vramd file; recorded, not sent */
int kmtIoctl(int fd, unsigned long request, void *arg)
{
	(void)request;
	(void)arg;
	unpause_calls++;
	unpause_kfd_fd = fd;
	return 0;
}

int amdgpu_unpause_processes(int pid)
{
	(void)pid;
	unpause_all_calls++;
	return 0;
}

int stub_unpause_calls(void)
{
	return unpause_calls;
}

int stub_unpause_kfd_fd(void)
{
	return unpause_kfd_fd;
}

int stub_unpause_all_calls(void)
{
	return unpause_all_calls;
}
