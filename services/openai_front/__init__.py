"""The OpenAI-compatible HTTP front over a LanguageModelService."""
