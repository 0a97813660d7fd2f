"""Storage: tables, database, records, statuses and the Buffer, the one writer of every state change."""
