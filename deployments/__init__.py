"""The Ray Serve application: the rooms below, each named for its job and its process.

    front/    the HTTP surface (ingress replica process)
    turn/     one turn as the ingress runs it: lease, route, stream, settle (ingress process)
    routing/  the RequestRouter and its prefix hints (runs inside the ingress's handle)
    worker/   a worker replica: engine session, recovery ladder, tier export (worker process)
    service/  reaching or hosting the cache service (every process of the app)

Shared by all: settings.py (the app's arguments), messages.py (what crosses ingress <-> worker),
errors.py (typed failures and OpenAI error bodies), tool_replies.py (tool calls read from text).
"""
