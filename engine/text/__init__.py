"""Text in and out of the engine: loading a checkpoint's tokenizer and its limits
(``tokenizer``, torch-free: the router uses it) and incremental detokenization that never
splits a UTF-8 character and holds back text a stop string may still claim
(``detokenizer``).
"""
