"""The local backend: every rank on this machine, its one node run in the caller's process."""
