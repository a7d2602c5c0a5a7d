"""Image formats v1 and v2: the byte layout (format), chunk records (codec), an image's files written and read
through fds (writer, reader), and the client's side of an image directory (local)."""
