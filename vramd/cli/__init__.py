"""Command lines on top of the client: vramctl, its selftest, and the end-to-end demo."""
