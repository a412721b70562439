"""The exact conversation cache: committed heads, turn publish/discard, export/import."""
