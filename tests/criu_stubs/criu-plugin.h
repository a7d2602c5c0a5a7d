/* Stub (ours): the plugin stages and the images-directory accessor the vramd file uses. */
#ifndef VRAMD_STUB_CRIU_PLUGIN_H
#define VRAMD_STUB_CRIU_PLUGIN_H

enum {
	CR_PLUGIN_STAGE__DUMP,
	CR_PLUGIN_STAGE__PRE_DUMP,
	CR_PLUGIN_STAGE__RESTORE,
};

/* the images directory, an O_DIRECTORY fd (stubs.c: the one stub_set_image_dir() was given) */
int criu_get_image_dir(void);

#endif
