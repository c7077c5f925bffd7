"""eyas.state: the SQLite run store (schema, migrations, writes and read-only queries), the
rank contract, and the run config with the stage specs it is checked against (runconfig.py, specs.py).

Imports nothing of eyas; stdlib, sqlite-utils and pydantic only.
"""
