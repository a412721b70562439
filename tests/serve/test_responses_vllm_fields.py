"""vLLM's sampling extensions on the Responses API through the official client (`extra_body`):
they sample as on chat completions (the same reply for the same prompt and fields), and vLLM's
fields this server does not serve pass at their defaults and are a 400 naming them otherwise."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.serve.helpers import user

pytestmark = pytest.mark.timeout(300)


async def test_the_fields_sample_as_on_chat_completions(stack):
    client = stack.client()
    # top_k 1 is greedy at any temperature; the penalty and min_p then decide which token that is.
    fields = {"top_k": 1, "repetition_penalty": 1.5, "min_p": 0.05, "priority": -1}
    salt = {"cache_salt": uuid.uuid4().hex}  # nothing cached: each reply is computed from scratch
    response = await client.responses.create(model=stack.model, input="say something", max_output_tokens=16,
                                             temperature=1.0, store=False, extra_body={**fields, **salt})
    chat = await client.chat.completions.create(model=stack.model, messages=[user("say something")], max_tokens=16,
                                                temperature=1.0, extra_body={**fields, **salt})
    plain = await client.chat.completions.create(model=stack.model, messages=[user("say something")], max_tokens=16,
                                                 temperature=0, extra_body=salt)
    assert response.output_text == chat.choices[0].message.content
    assert chat.choices[0].message.content != plain.choices[0].message.content  # the penalty applied


async def test_a_field_not_served_passes_at_its_default_and_is_refused_by_name_otherwise(stack):
    client = stack.client()
    at_default = await client.responses.create(model=stack.model, input="hi", max_output_tokens=2, store=False,
                                               extra_body={"length_penalty": 1.0, "use_beam_search": False})
    assert at_default.output_text
    with pytest.raises(openai.BadRequestError, match="length_penalty"):
        await client.responses.create(model=stack.model, input="hi", max_output_tokens=2,
                                      extra_body={"length_penalty": 2.0})
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        await client.responses.create(model=stack.model, input="hi", max_output_tokens=2,
                                      extra_body={"min_tokens": 3})
