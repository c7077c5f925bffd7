"""eyas.state: the SQLite run store (schema, migrations, writes and read-only queries).

Imports nothing of eyas; stdlib and sqlite-utils only.
"""
