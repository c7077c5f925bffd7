"""Reading the user's data and rendering it for the target: data files to rows, chats to token ids and loss masks.

reader.py reads and checks the rows of prepare's input files; chat.py renders a chat with the
target's template into token ids and an assistant-only loss mask; target_vocab.py reads the
target's vocabulary size. Nothing is imported here.
"""
