"""Procedural memory: what the agent's tools did, logged from the turns' messages as they
commit (``store.tool_log``), queried per tool (``api``), and rendered for the model's context
(``format``). ``extract`` finds the calls in OpenAI-format messages and judges their
outcome; ``model`` holds the data the queries return."""
