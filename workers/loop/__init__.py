"""The engine loop's parts, one job each; `workers.engine.LLMEngine` puts them together."""
