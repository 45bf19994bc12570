"""The checkpoint's parts: staging, the background writer, the ranks' agreement, storage, loading.

The public functions are :mod:`sparktrain.checkpoint`'s (``save``, ``wait``, ``load_latest``,
``latest_step``).
"""
