/* Stub (ours): the system's KFD uapi. */
#include <linux/kfd_ioctl.h>
