"""The LanguageModelService: Score and Generate over the engine, its client and its arguments."""
