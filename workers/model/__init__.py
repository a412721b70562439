"""Hybrid attention + Mamba2 language models (Bamba, GraniteMoeHybrid, Nemotron-H)."""
