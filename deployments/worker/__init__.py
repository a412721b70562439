"""A worker replica's process: the Worker deployment, the engine session of each backend, the
recovery ladder and the tier exporter. The only room where workers/ meets the cache client."""
