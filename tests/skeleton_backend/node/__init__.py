"""The skeleton's node side: what each node's process runs."""
