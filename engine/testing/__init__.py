"""Checkpoints the project makes itself: random-weight tiny Llama/Qwen models in the Hugging
Face layout with a real byte-level BPE tokenizer (``tiny_model``; its tokenizer's training
text in ``tokenizer_corpus``). The tests, the demo and the benchmarks use them; nothing is
downloaded.
"""
