"""The Spark backend: one barrier task per node on the active SparkSession's executors."""
