"""A small tool-using task, brought the three ways tiderl takes tasks: an env adapter
(`adapter.py`), a reward function (`reward.py`) and an agent written with the openai client
(`agent.py`), over one task file (`tasks.jsonl`)."""
