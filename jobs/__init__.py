"""Job builder, the client script, and the exported job folders (``jobs/<name>/``)."""
