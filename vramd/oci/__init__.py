"""vramd images in OCI registries: the client's network side (the daemon never speaks to a registry)."""
