"""The node side of the Spark backend: inside a barrier task, on an executor's Python worker."""
