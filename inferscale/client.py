"""The memory API's Python client (``serving/memory_api.py``), sync and async, typed results.

One implementation, in the client distribution (``clients/python``, package
``inferscale_client``: installable without the engine); re-exported here for code that imports
``inferscale.client``.
"""

from inferscale_client import *  # noqa: F403 - the client's names, all of them
from inferscale_client import __all__  # noqa: F401
