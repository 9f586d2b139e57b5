"""Text in and out of the model: tokenizers (Hugging Face, tiktoken, GGUF) and chat templates."""
