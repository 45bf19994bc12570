"""The ground every process stands on: the errors, what `/proc` says, the build lock, the version.

Nothing here imports another part of sparktrain: every role may import it.
"""
