"""Grammar engines for constrained decoding (JSON schema, json_object, forced tool calls):
llguidance vs xgrammar, on our tokenizers.

    python -m bench.grammar_backends [--quick | --smoke] [--results-dir DIR]

Tokenizers: the built-in character-level one (104 ids) and byte-level BPE tokenizers trained here
on the Python standard library's sources (32k ids; 128k in the full run). No model hub is needed.
Grammars: json_object and four JSON schemas, separators ", " and ": ", no free whitespace.

Per (engine, tokenizer, grammar):
  tokenizer info   one-off: the engine's view of the vocabulary
  compile          cold: schema -> a matcher ready for its first mask
  per token        compute the next-token bitmask + consume the sampled token, over a sequence
                   sampled by a seeded uniform choice among the allowed ids (same seed for both
                   engines, at most MAX_TOKENS tokens); the sequence is replayed, per step the
                   least of the replays; mean, median and p99 microseconds over the steps
  agreement        the first engine's sequence walked through both: where the allowed sets differ
Once per engine: whether the mask computation releases the GIL (a pure-Python loop's iterations
beside a thread computing masks, over alone), which schema features compile and are honoured
(samples decoded, parsed, validated with `jsonschema`), single-character probes of JSON's string
and number rules, and what turning a mask into a boolean torch tensor of vocabulary size costs.
Writes bench/results/grammar_backends[.quick|.smoke].{json,md} (--results-dir elsewhere). An
engine that is not installed is recorded as such and left out.
"""
