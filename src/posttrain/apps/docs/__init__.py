"""The document-analysis pipeline (`posttrain docs ...`): object store (`store`) -> queue (`queue`:
SQLite or Redis streams) -> workers (`worker`: `parse`, then `analyze` against a chat model) ->
database (`db`: SQLAlchemy, SQLite or PostgreSQL), with ingest, status, export and the batch report in
`pipeline`. Results are exactly-once per (content hash, schema + questions, model).
"""
