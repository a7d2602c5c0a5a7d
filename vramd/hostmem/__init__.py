"""Host memory: the libc primitives (GIL-free copies, zero scans) and the staging budget."""
