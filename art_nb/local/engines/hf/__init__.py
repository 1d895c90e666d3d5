"""The transformers engine: batched decoding with a prefix cache, on CPU or a GPU."""
