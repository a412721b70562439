"""Constrained decoding: a request's reply held to a grammar (JSON, a JSON schema, tool calls).

    constraint.py  what the request asks for (from the API's response_format / tool_choice)
    compiler.py    the grammar's text and its llguidance matcher, over the engine's tokenizer
    guide.py       one request's matcher: the tokens it allows next, computed off the engine thread
"""
