"""Where ranks run: ``local`` (this machine); Spark and Ray backends arrive in later versions."""
