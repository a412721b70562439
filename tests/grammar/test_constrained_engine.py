"""Constrained decoding in the engine: every reply of the random-weight model follows its
grammar (JSON object, 20 seeded schemas, forced tool calls), a bad schema is refused before
anything runs, and the masks are a pure function of the tokens so far."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.engine.conftest import new_engine, prompt_of, run_engine  # noqa: F401 (integrity fixture)
from tests.grammar.schemas import random_schema
from workers.checkpoint import Arch
from workers.errors import InvalidRequestError
from workers.grammar.compiler import GrammarCompiler
from workers.grammar.constraint import Constraint
from workers.grammar.guide import TokenGuide
from workers.request import FinishReason
from workers.sampling import SamplingParams
from workers.tools.formats import FORMATS, ParsedCall

pytest_plugins = ["tests.engine.conftest"]


def _replies(engine, constraints: list, *, temperature: float, max_tokens: int = 600):
    prompts = {f"r{i}": prompt_of(20 + i, seed=i) for i in range(len(constraints))}
    for (rid, prompt), constraint in zip(prompts.items(), constraints):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=7, constraint=constraint)
        engine.add_request(rid, prompt, params)
    texts, reasons = {rid: "" for rid in prompts}, {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            texts[out.request_id] += out.text_delta
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return [texts[r] for r in prompts], [reasons[r] for r in prompts]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_twenty_random_schemas_are_followed(tiny, temperature):
    engine = new_engine(tiny[Arch.BAMBA].path)
    schemas = [random_schema(seed) for seed in range(20)]
    texts, reasons = _replies(engine, [{"type": "json_schema", "schema": s} for s in schemas],
                              temperature=temperature)
    for schema, text, reason in zip(schemas, texts, reasons):
        assert reason is FinishReason.STOP, (reason, text)
        jsonschema.validate(json.loads(text), schema)
        assert text == json.dumps(json.loads(text))  # json.dumps' separators, no free whitespace


def test_json_object_and_unconstrained_neighbours(tiny):
    """Any JSON object is unbounded: a reply either ends as an object or is cut by max_tokens,
    when every one of its tokens still followed the grammar (OpenAI's documented behaviour)."""
    engine = new_engine(tiny[Arch.GRANITEMOEHYBRID].path)
    texts, reasons = _replies(engine, [{"type": "json_object"}, None, {"type": "json_object"}],
                              temperature=1.0, max_tokens=300)
    matcher = engine.grammars.matcher(Constraint.of({"type": "json_object"}))
    for text, reason in zip(texts[0::2], reasons[0::2]):
        if reason is FinishReason.STOP:
            assert isinstance(json.loads(text), dict)
        else:
            assert reason is FinishReason.LENGTH and text.startswith("{")
            tokens = engine.tokenizer.encode(text)
            assert matcher.validate_tokens(tokens) == len(tokens)
    unconstrained = texts[1]
    assert reasons[1] is not None and not (unconstrained.startswith("{") and unconstrained.endswith("}"))


def test_forced_tool_calls_parse_and_validate(tiny):
    engine = new_engine(tiny[Arch.NEMOTRON_H].path)
    tools = [{"name": f"tool_{i}", "parameters": random_schema(100 + i)} for i in range(3)]
    hermes = FORMATS["hermes"]
    texts, reasons = _replies(engine, [{"type": "tool_calls", "tools": tools, "parallel": p} for p in (True, False)],
                              temperature=1.0, max_tokens=3000)  # up to 8 calls of one character a token
    for text, reason, parallel in zip(texts, reasons, (True, False)):
        assert reason is FinishReason.STOP
        content, calls = hermes.parse(text)
        assert content == "" and calls, text
        assert parallel or len(calls) == 1
        for call in calls:
            tool = next(t for t in tools if t["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments), tool["parameters"])
        assert hermes.calls_text(calls) == text  # what the template renders when the calls come back


def never_ending(tiny, tmp_path):
    """A copy of the tiny checkpoint that never samples its end of turn."""
    model = tmp_path / "never-ending"
    shutil.copytree(tiny[Arch.BAMBA].path, model)
    meta = json.loads((model / "hybridserve.json").read_text())
    meta["never_sample_token_ids"] = sorted({*meta["never_sample_token_ids"], *meta["eos_token_ids"]})
    (model / "hybridserve.json").write_text(json.dumps(meta))
    return model


def test_a_reply_ends_where_its_grammar_ends_even_if_end_of_turn_is_never_sampled(tiny, tmp_path):
    engine = new_engine(never_ending(tiny, tmp_path))
    schemas = [random_schema(seed) for seed in (1, 2)]
    texts, reasons = _replies(engine, [{"type": "json_schema", "schema": s} for s in schemas], temperature=0.0)
    for schema, text, reason in zip(schemas, texts, reasons):
        assert reason is FinishReason.STOP
        jsonschema.validate(json.loads(text), schema)


def test_a_grammar_whole_before_any_token_ends_its_reply_empty_on_a_model_that_never_ends(tiny, tmp_path):
    # Only the end of turn may follow (an empty choice, an optional regex), which the model never
    # samples: the reply is whole as it is, a stop, not a failure (the fuzzer found a 500 there).
    engine = new_engine(never_ending(tiny, tmp_path))
    for n, constraint in enumerate([{"type": "choice", "choices": [""]}, {"type": "regex", "regex": "(ab)?"}]):
        engine.add_request(f"r{n}", prompt_of(12, seed=n), SamplingParams(max_tokens=8, constraint=constraint))
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.request_id == f"r{n}"]
        assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].error is None
        assert "".join(o.text_delta for o in outs) in ("", "ab")


def test_a_bad_schema_is_refused_before_anything_runs(tiny):
    engine = new_engine(tiny[Arch.BAMBA].path)
    with pytest.raises(InvalidRequestError, match="schema"):
        engine.add_request("bad", [6, 7, 8], SamplingParams(
            constraint={"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}))
    with pytest.raises(InvalidRequestError, match="constraint"):
        SamplingParams(constraint={"type": "regex"})
    assert not engine.has_unfinished()


def test_masks_are_a_function_of_the_tokens_so_far(tiny):
    """The guide reached by any path (prefetch, rollback, a refused token) gives the mask a
    fresh matcher gives for the same tokens."""
    engine = new_engine(tiny[Arch.BAMBA].path)
    constraint = Constraint.of({"type": "json_schema", "schema": random_schema(3)})
    pool = ThreadPoolExecutor(1)
    guide = TokenGuide(engine.grammars.matcher(constraint), engine.model_config.vocab_size, pool)
    text, _ = _replies(engine, [constraint], temperature=1.0)
    tokens = engine.tokenizer.encode(text[0])

    def fresh(prefix):
        return TokenGuide(engine.grammars.matcher(constraint), engine.model_config.vocab_size, pool).allowed(prefix)

    guide.prefetch(tokens[:5])
    assert guide.allowed(tokens[:5]).equal(fresh(tokens[:5]))
    assert guide.allowed(tokens[:2]).equal(fresh(tokens[:2]))  # rolled back
    masks = guide.masks_after(tokens, [len(tokens) - 1, 3, -1, len(tokens) + 1])
    assert masks[0].equal(fresh(tokens[:-1])) and masks[1].equal(fresh(tokens[:3]))
    assert masks[2] is None and masks[3] is None
    refused = next(t for t in range(engine.model_config.vocab_size) if not fresh(tokens[:4])[t])
    assert guide.allowed([*tokens[:4], refused]) is None  # after a refused token nothing is constrained
    assert guide.allowed(tokens[:6]).equal(fresh(tokens[:6]))  # and the guide recovers from it
    pool.shutdown()


@pytest.mark.parametrize("form", ["hermes", "nemotron"])
def test_auto_lets_text_through_but_a_begun_call_must_be_valid(tiny, form):
    """tool_choice "auto": any text may end the reply, but once the model writes the start tag
    only a valid call of the tools may follow (then text again)."""
    engine = new_engine(tiny[Arch.BAMBA].path)
    compiler = GrammarCompiler(engine.tokenizer.hf, engine.model_config.vocab_size, sorted(engine.eos_token_ids),
                               FORMATS[form])
    tools = [{"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                            "required": ["a"], "additionalProperties": False}}]
    constraint = Constraint.of({"type": "tool_calls", "tools": tools, "auto": True})
    start, end = FORMATS[form].start_tag, FORMATS[form].end_tag
    call = FORMATS[form].calls_text([ParsedCall("add", '{"a": 12}')])
    matcher = compiler.matcher(constraint)
    assert matcher.is_accepting()  # an empty or plain reply is fine

    def accepts(text: str) -> bool:
        ids = engine.tokenizer.encode(text)
        return compiler.matcher(constraint).validate_tokens(ids) == len(ids)

    assert accepts("Just text, no call.") and accepts(f"Sure. {call} Done.")
    assert not accepts(f"Sure. {start}" + '{"name": "sub"') and not accepts(f"{start}not json")
    ids = engine.tokenizer.encode("Hi " + call)
    assert matcher.consume_tokens(ids) and matcher.is_accepting() and not matcher.is_stopped()
    assert call.endswith(end)


def test_a_grammar_nothing_can_follow_fails_its_request_alone(tiny):
    """The built-in vocabulary has no token for "é": the grammar allows nothing the model may
    sample, and that request fails (never a silent stop), while its neighbour runs on."""
    engine = new_engine(tiny[Arch.BAMBA].path)
    engine.add_request("stuck", prompt_of(12, seed=1), SamplingParams(
        max_tokens=20, constraint={"type": "json_schema", "schema": {"const": "é"}}))
    engine.add_request("free", prompt_of(12, seed=2), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    outcome = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outcome[out.request_id] = (out.finish_reason, out.error)
    assert outcome["stuck"][0] is FinishReason.ERROR and "grammar" in outcome["stuck"][1]
    assert outcome["free"] == (FinishReason.LENGTH, None)
