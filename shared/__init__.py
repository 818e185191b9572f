"""The project's wire contract, configuration, transport helpers and logging.

Nothing here imports torch or any service: every process can import it cheaply.
"""
