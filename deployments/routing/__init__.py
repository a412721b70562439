"""Routing: the custom RequestRouter (runs in the process holding the Worker handle, the
ingress) and the prefix hints the ingress asks for and the workers announce."""
