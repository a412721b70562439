"""Run in the llama-index venv (client_venvs.py), not by pytest: llama-index's OpenAILike
against the app, as a chat model and in its default completion mode (POST /v1/completions),
plain and streamed. Prints what it got as JSON for test_llama_index.py to check.

    python llama_index_calls.py BASE_URL MODEL
"""

import json
import sys

from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike


def main(base_url: str, model: str) -> None:
    common = dict(model=model, api_base=base_url, api_key="unused", max_tokens=10, temperature=0, max_retries=0,
                  context_window=4096)
    chat_llm = OpenAILike(is_chat_model=True, **common)
    chat = chat_llm.chat([ChatMessage(role="user", content="tell me about llama-index")])
    chat_stream = "".join(r.delta or "" for r in chat_llm.stream_chat(
        [ChatMessage(role="user", content="tell me about llama-index")]))
    completion_llm = OpenAILike(**common)  # is_chat_model defaults to False: the legacy completions endpoint
    completion = completion_llm.complete("The answer is")
    completion_stream = "".join(r.delta or "" for r in completion_llm.stream_complete("The answer is"))
    print(json.dumps({"chat": chat.message.content, "chat_stream": chat_stream, "completion": completion.text,
                      "completion_stream": completion_stream}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
