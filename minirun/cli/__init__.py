"""The `minirun` command: `main.py` defines the click commands over the engine and tools;
`common.py` their shared options, `bench.py` and `quality.py` the measuring commands, `chat.py`
the chat loop and `chat_input.py` its terminal input."""
