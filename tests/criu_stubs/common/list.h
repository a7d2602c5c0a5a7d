/* Stub (ours): the vramd file includes it but uses no list. */
#ifndef VRAMD_STUB_COMMON_LIST_H
#define VRAMD_STUB_COMMON_LIST_H
#endif
