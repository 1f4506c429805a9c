"""The transformers backend: any causal LM transformers implements, behind the native forward contract (its
description, checkpoint layout, document-masked attention and QK-Clip rules)."""
