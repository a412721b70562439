"""One turn as the ingress process runs it: what is asked (request.py: TurnRequest, HeadMoved),
lease, route, stream, settle (run.py), what the ledger says of a turn (outcome.py), and the
lease keeper's thread. Never imports worker/."""
