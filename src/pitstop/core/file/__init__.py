"""The checkpoint file's pure rules: its framing, the layout of its blobs, its manifest and the
arrays it stores. No I/O: the shell (pitstop.shell.format) reads and writes the bytes."""
