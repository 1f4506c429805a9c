"""Text: tokenizers, each family's chat and tool-call format, a multi-turn conversation as the template renders it."""
