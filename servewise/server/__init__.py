"""OpenAI-compatible serving: `servewise serve`."""
