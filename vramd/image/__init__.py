"""Image format v1: the byte layout (format), chunk records (codec), and image directories (writer, reader)."""
