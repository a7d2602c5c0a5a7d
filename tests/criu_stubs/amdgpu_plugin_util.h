/* Stub (ours): the restore's fd floor the vramd file reads. */
#ifndef VRAMD_STUB_AMDGPU_PLUGIN_UTIL_H
#define VRAMD_STUB_AMDGPU_PLUGIN_UTIL_H

extern int fd_next;

#endif
