"""The ``folio`` command (``main.py``) and the offline quantize tool (``quantize.py``, ``awq.py``, ``gptq.py``)."""
