"""The HTTP surface, in the ingress replica process: routes (ingress.py), the request guard,
the chat and Responses schemas and bodies, and the ingress's metrics. Never imports worker/."""
