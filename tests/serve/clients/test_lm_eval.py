"""lm-eval's `local-completions` model on a small multiple-choice (log-likelihood) task against the
app, driven in its own venv (client_venvs.py). lm-eval scores each choice from the echoed prompt's
`token_logprobs` of one request (prompt as token ids, `echo`, `logprobs: 1`, `max_tokens: 1`);
each score must equal the one the official SDK reads from our completions for the same text, and
the accuracy must be what those scores give."""

from __future__ import annotations

import json

import pytest

from tests.serve.clients.client_venvs import ClientVenv
from tests.serve.clients.conftest import drive

pytestmark = pytest.mark.timeout(300)

DOCS = [
    {"question": "Q: What is 2 plus 2? A:", "choices": ["4", "5", "22"], "answer": 0},
    {"question": "Q: Which is a colour? A:", "choices": ["chair", "blue", "seven"], "answer": 1},
    {"question": "Q: The sky at noon is A:", "choices": ["green", "bright", "square"], "answer": 1},
    {"question": "Q: Cats say A:", "choices": ["meow", "moo", "quack"], "answer": 0},
    {"question": "Q: Ice is A:", "choices": ["hot", "loud", "cold"], "answer": 2},
    {"question": "Q: The first month is A:", "choices": ["May", "January", "June"], "answer": 1},
    {"question": "Q: Paris is in A:", "choices": ["France", "Peru", "Japan"], "answer": 0},
    {"question": "Q: Ten minus three is A:", "choices": ["13", "30", "7"], "answer": 2},
    {"question": "Q: Fish live in A:", "choices": ["water", "trees", "sand"], "answer": 0},
    {"question": "Q: A week has how many days? A:", "choices": ["5", "7", "9"], "answer": 1},
]


async def loglikelihood(client, model: str, context: str, continuation: str) -> float:
    """The continuation's log-likelihood after the context, from our echoed prompt logprobs: the
    sum over the tokens that start at or after the continuation's first character."""
    completion = await client.completions.create(model=model, prompt=context + continuation, echo=True,
                                                 logprobs=1, max_tokens=0, temperature=0)
    logprobs = completion.choices[0].logprobs
    return sum(logprob for offset, logprob in zip(logprobs.text_offset, logprobs.token_logprobs, strict=True)
               if offset >= len(context))


async def test_local_completions_scores_each_choice_as_our_prompt_logprobs(stack, tmp_path):
    docs_file = tmp_path / "docs.jsonl"
    docs_file.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    got = await drive(ClientVenv.LM_EVAL, "lm_eval_loglikelihood.py", stack, stack.model_dir, str(docs_file))

    # One score per choice of every document, each the choice after its question (" " between).
    assert sorted((s["doc_id"], s["context"], s["continuation"]) for s in got["scored"]) == sorted(
        (i, doc["question"], f" {choice}") for i, doc in enumerate(DOCS) for choice in doc["choices"])
    client = stack.client()
    ours = {}
    for scored in got["scored"]:
        expected = await loglikelihood(client, stack.model, scored["context"], scored["continuation"])
        assert expected < 0 and scored["loglikelihood"] == pytest.approx(expected, abs=1e-4), scored
        ours[scored["doc_id"], scored["continuation"]] = expected
    # Multiple choice picks the likeliest choice: the accuracy over all documents follows from our scores.
    right = [max(doc["choices"], key=lambda choice: ours[i, f" {choice}"]) == doc["choices"][doc["answer"]]
             for i, doc in enumerate(DOCS)]
    assert 0 <= got["acc"] <= 1 and got["acc"] == pytest.approx(sum(right) / len(DOCS))
