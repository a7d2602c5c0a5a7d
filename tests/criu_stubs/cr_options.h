/* Stub (ours): the one option the vramd file reads. */
#ifndef VRAMD_STUB_CR_OPTIONS_H
#define VRAMD_STUB_CR_OPTIONS_H

struct cr_options {
	int stream; /* --stream */
};

extern struct cr_options opts;

#endif
