"""What a model is, for both engines: architectures, weights in Hugging Face layout, tokenizer and chat formats."""
