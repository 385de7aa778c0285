"""The ways in besides HTTP that stand over the server's own code: `Engine`, pyserve in-process."""
