"""The HTTP surface, in the ingress replica process: routes only (ingress.py); the request guard
(API key, body size); the turns in flight, counted and settled once (inflight.py); SSE streams;
the chat and Responses schemas, bodies and plan; the conversation routes' work; the ingress's
metrics. Never imports worker/."""
