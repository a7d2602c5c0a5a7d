"""The daemon: command line (main), life cycle (daemon), connections, request handlers, sessions, and
the plumbing around them (transport, config, metrics, systemd)."""
